"""Qwen3.5 (transformers' ``qwen3_5_text``: Gated DeltaNet and gated attention layers) under the Megatron strategy
on a CPU process (gloo), against transformers (strategies/megatron/qwen3_5.py).

One forked rank (``forked.py``) runs ``qwen3_5_convert`` at tensor parallel 1: megatron-core's GatedDeltaNet (with
its pure-torch chunked delta rule standing in for fla's kernel) and its gated attention reproduce transformers'
``Qwen3_5ForCausalLM``. Tensor parallel 2 is refused by name (see ``check_layout``).
"""

import pytest

from rlflow.strategies.megatron import ParallelLayout, megatron_available
from rlflow.strategies.megatron.qwen3_5 import check_layout

from . import qwen3_5_scenarios  # noqa: F401  (its scenarios, for the forked ranks)
from .forked import fork_launch

pytestmark = pytest.mark.skipif(not megatron_available(),
                                reason="megatron-core is not installed (pip install -e '.[megatron]')")


def test_qwen3_5_converted_equals_transformers_at_tensor_parallel_1(tmp_path):
    """A linear-attention layer then a full-attention one, left padding in a row: logits, log-probs, entropy, a
    teacher's top-k log-probs and every gradient equal transformers'; the weights go back to the engines under
    transformers' names, exactly the ones loaded."""
    r = fork_launch(1, tmp_path, ("qwen3_5_convert",))["qwen3_5_convert"]
    assert r["logits"] < 1e-5 * max(1.0, r["logits_scale"]), r["logits"]
    assert r["log_probs"] < 1e-5 and r["entropy"] < 1e-5 and r["topk_log_probs"] < 1e-5, r
    assert r["grad_names"] and r["grad"] < 1e-5 * r["grad_scale"], (r["grad"], r["grad_scale"])
    assert r["exported_names"] and r["exported"] == 0.0


def test_qwen3_5_at_tensor_parallel_2_is_refused_by_name():
    check_layout(ParallelLayout())
    with pytest.raises(ValueError, match="tensor parallel 1 only .*in_proj_qkv"):
        check_layout(ParallelLayout(tensor=2))
