"""FSDP2 on 2 CPU processes equals one process for a tiny vision-language model (2 gloo ranks forked from
the test process, with the environment torchrun gives them).

The vision blocks are sharded like the decoder layers (each one FSDP2 unit); a micro-batch without
images runs the tower on a blank image so both ranks join its collectives.
"""

import pytest
import torch

from .launch import assert_same_weights, assert_updates, free_port
from .vision_worker import build, run_forked, vision_blocks_sharded


def test_fsdp2_two_processes_equal_one_for_a_vision_language_model(tmp_path):
    trainer, data, record = build(str(tmp_path / "one"), "auto", devices=1)
    tower = {k: v.detach().clone() for k, v in trainer.policy.model.state_dict().items() if "visual" in k}
    trainer.fit(data)
    assert_updates(record.steps)
    assert not vision_blocks_sharded(trainer)
    two = run_forked(2, tmp_path / "two", "fsdp2", free_port())
    assert two["vision_sharded"]
    one, two = record.steps[1], two["steps"][1]
    assert two["metrics"]["actor/pg_loss"] == pytest.approx(one["metrics"]["actor/pg_loss"], abs=1e-5)
    assert two["metrics"]["critic/score/mean"] == pytest.approx(one["metrics"]["critic/score/mean"], abs=1e-6)
    assert_same_weights(two["weights"], one["weights"])
    assert all(not torch.equal(one["weights"][k], v) for k, v in tower.items())  # the whole tower trained
    assert tower and tower.keys() <= one["weights"].keys()  # and was compared
