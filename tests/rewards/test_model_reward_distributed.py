"""A reward model under FSDP2 on 2 CPU processes (gloo), launched with torchrun as users launch rlflow:
sharded like the policy, and the step equals one process on the same global batch. The 2-process job is one of
tests/distributed/launch.py's FSDP2_JOBS (tests/conftest.py's shared launch)."""

import pytest

from tests.distributed.launch import FSDP2_JOBS, assert_same_weights, assert_updates
from tests.distributed.worker import build


def test_reward_model_sharded_by_fsdp2_equals_one_process(fsdp2_launched, tmp_path):
    trainer, data, record = build(str(tmp_path / "one"), "auto", steps=1, devices=1, rm=1)
    trainer.fit(data)
    reference = record.steps
    assert_updates(reference)
    assert FSDP2_JOBS["rm"] == ("fsdp2", 1, "rm=1")
    two = fsdp2_launched["rm"][0]
    assert two[1]["rm_sharded"] and not reference[1]["rm_sharded"]
    for key in ("critic/score/mean", "critic/score/max", "critic/score/min"):
        assert two[1]["metrics"][key] == pytest.approx(reference[1]["metrics"][key], abs=1e-5), key
    assert_same_weights(two[1]["weights"], reference[1]["weights"])
