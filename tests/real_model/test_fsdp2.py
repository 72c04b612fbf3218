"""FSDP2 on 2 CPU processes (gloo; ranks forked from the test process with torchrun's environment) equals one
process, for one step on the real model.

The samples are greedy and the advantage is per sample, so both runs make the same update from the same four
samples (two per rank under FSDP2): loss, gradient norm and weights must agree. AdamW's first step moves each weight
by about ``lr`` (1e-4), so weights are compared as updates (after - before), on a fixed sample of 4,096 elements of
each of the 272 tensors, to 1e-6, a hundredth of a step (measured: 6e-8, float32 rounding of the weights); a rank
that trained on its own half of the batch, or a tied head updated twice, is off by about a step.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from tests.distributed.launch import can_fork_ranks, fork_ranks, torchrun
from tests.real_model import fsdp2_worker
from tests.real_model.fsdp2_worker import LR, build, sample


def test_fsdp2_on_two_processes_equals_one_process(smollm2_dir, tmp_path):
    trainer, data, record = build(str(smollm2_dir), str(tmp_path / "one"), "auto", 1)
    trainer.fit(data)
    one = record.result
    del trainer, data, record

    if can_fork_ranks():  # 2 ranks forked from this warm process: no fresh interpreters importing rlflow
        fork_ranks(2, tmp_path, fsdp2_worker.main, str(smollm2_dir), str(tmp_path), "fsdp2", timeout=600)
    else:
        proc = torchrun(2, smollm2_dir, tmp_path, "fsdp2", worker=fsdp2_worker.__file__, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    two = torch.load(tmp_path / "result.pt", weights_only=False)

    for key in ("actor/pg_loss", "critic/score/mean", "response_length/mean"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], abs=1e-5), key
    # a norm over 135M float32 gradients summed in another order: measured 1.2e-5 relative
    assert two["metrics"]["actor/grad_norm"] == pytest.approx(one["metrics"]["actor/grad_norm"], rel=1e-4)
    assert one["metrics"]["actor/grad_norm"] > 0.1 and one["metrics"]["response_length/mean"] > 1
    assert one["engine_gap"] < 1e-4 and two["engine_gap"] < 1e-4  # the synced engine copy (tied head included)

    assert one["weights"].keys() == two["weights"].keys() and len(one["weights"]) == 272
    moved = 0
    with safe_open(smollm2_dir / "model.safetensors", "pt") as f:
        for name, after in one["weights"].items():
            before = sample(name, f.get_tensor(name))
            update_one, update_two = after - before, two["weights"][name] - before
            torch.testing.assert_close(update_two, update_one, atol=1e-6, rtol=0, msg=name)  # measured: 6e-8
            moved += int(update_one.abs().max() > LR / 2)
    assert moved == len(one["weights"])  # every tensor took a real step (an untouched model would pass the comparison)
