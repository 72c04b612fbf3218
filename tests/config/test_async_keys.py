"""The seed's ``trainer.async_weight_update`` and verl's ``async_training.*``: AsyncRollout with IS on."""

import json

import pytest

import rlflow.config.devices as devices
from rlflow.config import ConfigError, NotSupportedError, load_config, make_plan
from rlflow.trainer.main_ppo import main

BASE = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.model.path=m", "data.train_files=t.parquet",
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.logger=[console]"]


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


def plan(*overrides):
    return make_plan(load_config(BASE + list(overrides)))


def test_the_seed_switch_means_one_step_off_with_truncated_is():
    p = plan("trainer.async_weight_update=true")
    assert p.async_rollout == {"max_staleness": 1}
    assert [(cls.__name__, kwargs) for cls, kwargs in p.after] == [("TruncatedIS", {"level": "token", "threshold": 2.0})]
    assert p.loss_kwargs["is_weights"] is True
    assert any("truncated importance sampling is on" in n for n in p.notes)
    default = plan()
    assert default.async_rollout is None and not default.after  # off by default


def test_staleness_threshold_sets_the_bound_and_turns_the_mode_on():
    assert plan("async_training.staleness_threshold=2").async_rollout == {"max_staleness": 2}
    restarts = plan("trainer.async_weight_update=true", "async_training.max_engine_restarts=0").async_rollout
    assert restarts == {"max_staleness": 1, "max_engine_restarts": 0}  # rlflow's key, passed to AsyncRollout
    kept = plan("trainer.async_weight_update=true", "algorithm.rollout_correction.rollout_is=sequence")
    assert [(c.__name__, k["level"]) for c, k in kept.after] == [("TruncatedIS", "sequence")]  # the user's, once
    off = plan("trainer.async_weight_update=true", "algorithm.rollout_correction.rollout_is=null")
    assert not off.after and any("without importance-sampling correction" in n for n in off.notes)
    bypass = plan("trainer.async_weight_update=true", "algorithm.rollout_correction.bypass_mode=true")
    assert not bypass.after and bypass.loss_cls.__name__ == "BypassLoss"  # the loss corrects against the sampler
    assert any("taken against the sampler's log-probs" in n for n in bypass.notes)


@pytest.mark.parametrize("overrides, error, message", [
    (["async_training.staleness_threshold=0.5"], ConfigError, "whole number of steps"),
    (["trainer.async_weight_update=true", "async_training.max_engine_restarts=-1"], ConfigError,
     r"async_training.max_engine_restarts=-1: must be .*>= 0"),
    (["trainer.async_weight_update=true", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"],
     NotSupportedError, "dynamic sampling"),
])
def test_what_the_mode_cannot_do_is_refused(overrides, error, message):
    with pytest.raises(error, match=message):
        plan(*overrides)


def test_the_entry_point_trains_one_step_off(tiny, capsys, tmp_path):
    """Two steps through ``main_ppo`` with the engine in a child process: the second batch is one version old,
    and the IS correction weighed it."""
    assert main(tiny + ["trainer.async_weight_update=true", "trainer.logger=[console,file]"]) == 0
    assert "AsyncRollout(rollout, max_staleness=1)" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "async/staleness_max" in r]
    assert [r["async/staleness_max"] for r in steps] == [0, 1]
    assert all("rollout_corr/rollout_is_mean" in r and "timing_s/gen_wait" in r for r in steps)


def test_the_max_staleness_flag_reaches_the_default_job(monkeypatch):
    """``rlflow train --max-staleness K`` is the default job's; with a config the bound is a config key."""
    import rlflow.tasks.default_job as default_job
    from rlflow.cli import main as cli_main

    calls = []
    monkeypatch.setattr(default_job, "run", lambda **kwargs: calls.append(kwargs))
    assert cli_main(["train", "--max-staleness", "2", "--steps", "3"]) == 0
    assert calls[0]["max_staleness"] == 2 and calls[0]["steps"] == 3
    assert cli_main(["train"]) == 0 and calls[1]["max_staleness"] is None  # synchronous unless asked
    with pytest.raises(SystemExit):
        cli_main(["train", "--max-staleness", "1", "algorithm.adv_estimator=grpo"])
