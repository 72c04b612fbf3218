"""A vision-language model (tiny Qwen2.5-VL) under the Megatron strategy on CPU processes (gloo): the language model
converted to megatron-core, the vision tower kept as transformers' module (strategies/megatron/vision.py).

One launch of two forked ranks (``forked.py``, scenarios in ``vlm_scenarios.py``) runs the conversion at tensor
parallel 2 against transformers, then one GRPO step at data parallel 2 against the same Trainer on one process,
checkpointed and exported back to a transformers folder.
"""

import pytest
import torch

from rlflow.strategies.megatron import megatron_available

from ..distributed.launch import assert_same_weights, assert_updates
from . import vlm_scenarios  # noqa: F401  (its scenarios, for the forked ranks)
from .forked import fork_launch

pytestmark = pytest.mark.skipif(not megatron_available(),
                                reason="megatron-core is not installed (pip install -e '.[megatron]')")


@pytest.fixture(scope="module")
def vlm_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("vlm")
    return out, fork_launch(2, out, ("vlm_convert",))


def test_qwen2_5_vl_at_tensor_parallel_2_equals_transformers_with_images(vlm_runs):
    """Rows with one image, two images of different sizes, none: log-probs, entropy and every gradient (the vision
    tower's, run whole on each rank, and the language model's, split) equal transformers'; the weights go to the
    engines under transformers' names (model.visual.*, model.language_model.*), exactly the ones loaded."""
    r = vlm_runs[1]["vlm_convert"]
    assert r["tensor_parallel"] == 2
    assert r["log_probs"] < 1e-5 * max(1.0, r["log_probs_scale"]) and r["entropy"] < 1e-5, r
    assert r["grad_names"] and r["grad"] < 1e-5 * r["grad_scale"], (r["grad"], r["grad_scale"])
    assert r["tower_grad"] > 0  # the images reached the loss through the tower
    assert r["exported_names"] and r["exported"] == 0.0
