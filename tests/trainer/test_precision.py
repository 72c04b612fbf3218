"""Generation runs in the training precision; options of the HF engine that change how, not what, it samples."""

import pytest
import torch

from rlflow.data import keys as K
from rlflow.data.prompts import collate, load_rows
from rlflow.rollout.hf import HFRollout
from .helpers import make_trainer


@pytest.mark.parametrize("precision, generated", [("bf16-mixed", torch.bfloat16), ("32-true", torch.float32)])
def test_generation_runs_in_the_training_precision(model, tokenizer, addition_rows, tmp_path, precision, generated):
    """On an H200, precision="bf16-mixed" used to sample in float32 (generate ran outside Fabric's autocast)."""
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, precision=precision, max_steps=1,
                                 loggers=())
    seen = []  # (grad enabled, dtype of the LM head's output); one update per batch: no-grad calls are sampling

    def record(module, inputs, output):
        seen.append((torch.is_grad_enabled(), output.dtype))

    trainer.policy.model.lm_head.register_forward_hook(record)
    trainer.fit(data)
    assert {d for grad, d in seen if not grad} == {generated}, seen
    assert {d for grad, d in seen if grad} == {generated}, seen
    seen.clear()
    trainer.validate(data)
    assert seen and {d for _, d in seen} == {generated}


def test_static_cache_samples_what_the_dynamic_cache_samples(model, tokenizer):
    rows, _ = load_rows([{"prompt": t, "ground_truth": "0"} for t in ("12+34=", "5+6=", "99+99=")])
    batch = collate(rows, tokenizer)
    out = {}
    for cache in (None, "static"):
        rollout = HFRollout(n=2, max_new_tokens=5, cache_implementation=cache)
        rollout.bind(model, tokenizer)
        torch.manual_seed(0)
        out[cache] = rollout(batch)
    assert torch.equal(out[None][K.RESPONSE_IDS], out["static"][K.RESPONSE_IDS])
    torch.testing.assert_close(out[None][K.ROLLOUT_LOG_PROBS], out["static"][K.ROLLOUT_LOG_PROBS], atol=1e-5, rtol=0)
