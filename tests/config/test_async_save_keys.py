"""verl's checkpoint.async_save through main_ppo: the same checkpoint files as a synchronous save at every step,
and a run resumed from one continues exactly as the synchronous run did."""

import json

import pytest
import torch

import rlflow.config.verl.devices as devices
from rlflow.config import load_config, make_plan
from rlflow.trainer.main_ppo import main


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


def test_resume_from_an_async_checkpoint_equals_resume_from_a_synchronous_one(tiny, tmp_path):
    """verl's key through main_ppo: the same files as a synchronous save at every step, and a resumed step 3
    with every metric equal to the uninterrupted synchronous run's."""
    common = tiny + ["trainer.save_freq=1", "trainer.total_training_steps=3", "trainer.val_before_train=false",
                     "trainer.logger=[jsonl]"]
    key = "actor_rollout_ref.actor.checkpoint.async_save"
    assert make_plan(load_config(common + [f"{key}=true"])).trainer_kwargs["async_save"] is True
    assert make_plan(load_config(common)).trainer_kwargs["async_save"] is False
    for name, flag in (("sync", "false"), ("async", "true")):
        assert main(common + [f"trainer.default_local_dir={tmp_path / name}", f"{key}={flag}"]) == 0
    for step in (1, 2, 3):
        a, s = (torch.load(tmp_path / n / f"global_step_{step}" / "state.ckpt", weights_only=False)
                for n in ("async", "sync"))
        assert a["global_step"] == s["global_step"] == step and a["schedulers"] == s["schedulers"]
        assert all(torch.equal(a["policy"][k], s["policy"][k]) for k in s["policy"])
        assert a["rng"]["torch"].equal(s["rng"]["torch"]) and a["loader"] == s["loader"]
    assert main(common + [f"trainer.default_local_dir={tmp_path / 'resumed'}", f"{key}=true",
                          "trainer.resume_mode=resume_path",
                          f"trainer.resume_from_path={tmp_path / 'async' / 'global_step_2'}"]) == 0

    def rows(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("timing", "perf"))}
                for r in map(json.loads, lines)}

    assert rows("resumed")[3] == rows("sync")[3]


def test_del_local_ckpt_after_load_is_accepted_with_verls_reason(tiny):
    from rlflow.config.verl.run import unused_notes

    p = make_plan(load_config(tiny + ["trainer.del_local_ckpt_after_load=true"]))
    assert ("trainer.del_local_ckpt_after_load=True has no effect in rlflow: verl deletes only the local copy of a "
            "checkpoint it downloaded from HDFS") in "\n".join(unused_notes(p.cfg))
