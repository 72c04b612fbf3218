"""Vision-language models (tiny Qwen2.5-VL and Qwen3.5) under the Megatron strategy on CPU processes (gloo): the
language model converted to megatron-core, the vision tower kept as transformers' module
(strategies/megatron/vision.py).

One launch of two forked ranks (``forked.py``, scenarios in ``vlm_scenarios.py``) runs the conversion of Qwen2.5-VL
and Qwen3.5 at tensor parallel 2 and of Qwen2.5-VL at pipeline parallel 2 against transformers, then one GRPO step
at data parallel 2, checkpointed, compared with the same Trainer on one process and exported back to a transformers
folder.
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
    return out, fork_launch(2, out, ("vlm_convert", "vlm_convert_pp", "vlm_train"))


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_5"])
def test_vision_language_model_at_tensor_parallel_2_equals_transformers_with_images(vlm_runs, kind):
    """Qwen2.5-VL (Qwen2 decoder, M-RoPE in consecutive sections) and Qwen3.5 (Gated DeltaNet + gated attention,
    interleaved sections, partial rotary), rows with one image, two images of different sizes, none: log-probs,
    entropy and every gradient (the vision tower's, run whole on each rank, and the language model's, split) equal
    transformers'; the weights go to the engines under transformers' names (model.visual.*,
    model.language_model.*), exactly the ones loaded."""
    r = vlm_runs[1]["vlm_convert"][kind]
    assert r["layout"] == (2, 1)
    assert r["log_probs"] < 1e-5 * max(1.0, r["log_probs_scale"]) and r["entropy"] < 1e-5, r
    assert r["grad_names"] and r["grad"] < 1e-5 * r["grad_scale"], (r["grad"], r["grad_scale"])
    assert r["tower_grad"] > 0  # the images reached the loss through the tower
    assert r["exported_names"] and r["exported"] == 0.0


def test_qwen2_5_vl_at_pipeline_parallel_2_equals_transformers_with_images(vlm_runs):
    """The tower on the first stage only, the 3-D positions on both: log-probs, entropy and both stages' gradients
    (the tower's, and the tied embedding's summed over its two copies) equal transformers'; the weights exported from
    both stages are the ones loaded."""
    r = vlm_runs[1]["vlm_convert_pp"]["qwen2_5_vl"]
    assert r["layout"] == (1, 2)
    assert r["log_probs"] < 1e-5 * max(1.0, r["log_probs_scale"]) and r["entropy"] < 1e-5, r
    assert r["grad_names"] and r["grad"] < 1e-5 * r["grad_scale"], (r["grad"], r["grad_scale"])
    assert r["tower_grad"] > 0
    assert r["exported_names"] and r["exported"] == 0.0


def test_qwen2_5_vl_grpo_step_at_data_parallel_2_equals_one_process_and_exports_with_its_tower(vlm_runs, tmp_path):
    """One GRPO step (micro-batches of one sample, half without an image: a replica's tower may get no gradient)
    under the Megatron strategy on two data-parallel ranks gives the loss and weights of the same Trainer with
    transformers' model on one process, the vision tower's included (it trained: verl's freeze_vision_tower=False);
    the engine holds the trained weights after the sync; the checkpoint exports to a transformers folder that holds
    them all."""
    from transformers import AutoModelForImageTextToText

    from rlflow.trainer.hf_export import export_hf

    from ..distributed.vision_worker import build

    _, runs = vlm_runs
    trainer, data, record = build(str(tmp_path / "one"), "auto", 1)
    tower = {k: v.detach().clone() for k, v in trainer.policy.model.state_dict().items() if "visual" in k}
    trainer.fit(data)
    assert_updates(record.steps)
    one, two = record.steps[1], runs["vlm_train"]["steps"][1]
    assert two["metrics"]["actor/pg_loss"] == pytest.approx(one["metrics"]["actor/pg_loss"], abs=1e-5)
    assert two["metrics"]["actor/grad_norm"] == pytest.approx(one["metrics"]["actor/grad_norm"], rel=1e-4)
    assert_same_weights(two["weights"], one["weights"])
    assert tower and all(not torch.equal(one["weights"][k], v) for k, v in tower.items())  # the whole tower trained
    assert runs["vlm_train"]["engine_diff"] == 0.0
    folder = export_hf(runs["vlm_train"]["checkpoint"], tmp_path / "exported")
    exported = AutoModelForImageTextToText.from_pretrained(folder)
    assert_same_weights({n: p.detach() for n, p in exported.named_parameters()}, two["weights"])


def test_what_the_vision_language_conversion_does_not_cover_is_refused_by_name():
    """Another vision-language model (Qwen2-VL), sequence parallelism (the image features are written into the whole
    sequence) and LoRA (the dry run's check of its targets) are refused with the reason; Qwen2.5-VL is accepted."""
    from rlflow.strategies.megatron import ParallelLayout
    from rlflow.strategies.megatron.lora import check_targets
    from rlflow.strategies.megatron.model import architecture

    from ..vlm import tiny_vlm

    qwen2_5_vl, qwen2_vl = tiny_vlm("qwen2_5_vl")[0].config, tiny_vlm("qwen2_vl")[0].config
    assert architecture(qwen2_5_vl, ParallelLayout(tensor=2)).qkv_bias  # its language model: Qwen2's
    with pytest.raises(ValueError, match="and the vision-language qwen2_5_vl, qwen3_5, qwen3_5_moe; "
                                         "got model_type='qwen2_vl'"):
        architecture(qwen2_vl)
    with pytest.raises(ValueError, match="sequence parallelism does not combine with a vision-language model"):
        architecture(qwen2_5_vl, ParallelLayout(tensor=2, sequence_parallel=True))
    with pytest.raises(ValueError, match=r"does not adapt a vision-language model \(qwen2_5_vl\)"):
        check_targets(qwen2_5_vl, ["q_proj"])
