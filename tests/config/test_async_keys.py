"""The seed's ``trainer.async_weight_update`` and verl's ``async_training.*``: AsyncRollout with IS on."""

import json

import pytest

import rlflow.config.verl.devices as devices
from rlflow.config import ConfigError, load_config, make_plan
from rlflow.config.verl.key_notes import unused_notes
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


def test_v1_async_modes_are_fully_async_with_verls_sampler_keys_and_truncated_is():
    p = plan("trainer.v1.trainer_mode=colocate_async")
    assert p.fully_async == {"max_off_policy_threshold": 8, "max_off_policy_strategy": "drop", "num_warmup_batches": 1}
    assert p.async_rollout is None
    assert [(cls.__name__, kwargs) for cls, kwargs in p.after] == [("TruncatedIS", {"level": "token", "threshold": 2.0})]
    assert any("FullyAsyncRollout(rollout, max_off_policy_threshold=8" in n for n in p.notes)
    p = plan("trainer.v1.trainer_mode=separate_async", "trainer.v1.sampler.max_off_policy_threshold=2",
             "trainer.v1.sampler.max_off_policy_strategy=wait", "trainer.v1.separate_async.num_warmup_batches=0.5")
    assert p.fully_async == {"max_off_policy_threshold": 2, "max_off_policy_strategy": "wait", "num_warmup_batches": 0.5}
    assert plan("trainer.v1.trainer_mode=colocate_async",
                "trainer.v1.sampler.max_off_policy_threshold=null").fully_async["max_off_policy_threshold"] is None
    assert plan("trainer.use_v1=false", "trainer.v1.trainer_mode=colocate_async").fully_async is None  # verl's legacy


@pytest.mark.parametrize("overrides, error, message", [
    (["trainer.v1.sampler.max_off_policy_threshold=0"], ConfigError, "trainer.v1.sampler.max_off_policy_threshold=0"),
    (["trainer.v1.sampler.max_off_policy_strategy=skip"], ConfigError, "max_off_policy_strategy='skip'"),
    (["trainer.v1.colocate_async.num_warmup_batches=-1"], ConfigError, "colocate_async.num_warmup_batches=-1"),
    (["trainer.async_weight_update=true"], ConfigError, "two asynchronous modes"),
])
def test_what_the_v1_async_modes_cannot_take_is_refused_naming_the_key(overrides, error, message):
    with pytest.raises(error, match=message):
        plan("trainer.v1.trainer_mode=colocate_async", *overrides)


def test_the_entry_point_trains_fully_async_and_v1_sync_is_the_synchronous_run(tiny, capsys, tmp_path):
    """``colocate_async`` trains through ``main_ppo`` with verl's off-policy metrics; ``use_v1=True`` in ``sync``
    mode is exactly the legacy (``use_v1=False``) synchronous run: equal metrics."""
    def rows(run):
        return [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    assert main(tiny + ["trainer.v1.trainer_mode=colocate_async", "trainer.v1.sampler.max_off_policy_threshold=2",
                        "trainer.logger=[console,file]", f"trainer.default_local_dir={tmp_path}/fully"]) == 0
    assert "FullyAsyncRollout(" in capsys.readouterr().out
    steps = [r for r in rows("fully") if "training/off_policy/trajectory_spans/max" in r]
    assert len(steps) == 2 and all(r["training/off_policy/trajectory_staleness_worst/max"] <= 1 for r in steps)
    assert all("rollout_corr/rollout_is_mean" in r and "async/dropped_groups" in r for r in steps)
    for run, mode in (("v1", ["trainer.use_v1=true", "trainer.v1.trainer_mode=sync"]), ("legacy", ["trainer.use_v1=false"])):
        assert main(tiny + mode + ["trainer.logger=[console,file]", f"trainer.default_local_dir={tmp_path}/{run}"]) == 0
    drop = ("timing_s/", "perf/")
    same = [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows("v1")]
    assert same and same == [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows("legacy")]


FILTER = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
          "algorithm.filter_groups.max_num_gen_batches=4"]


ONE_STEP_OFF, COLOCATE = ["trainer.async_weight_update=true"], ["trainer.v1.trainer_mode=colocate_async"]


@pytest.mark.parametrize("mode", [COLOCATE, ["async_training.partial_rollout=true"], ONE_STEP_OFF])
@pytest.mark.parametrize("processes", [1, 2])
def test_dynamic_sampling_is_planned_with_every_async_mode_on_one_or_several_processes(mode, processes):
    """One step off, the engine generates the top-up batches ahead; fully asynchronous, group by group; on several
    processes rank 0 filters and hands out kept groups (tests/distributed/test_async_ranks.py runs it)."""
    p = plan(f"trainer.n_gpus_per_node={processes}", *mode, *FILTER)
    assert p.devices.processes == processes and p.dynamic_sampling == {"metric": "score", "max_gen_batches": 4}
    assert (p.async_rollout if mode == ONE_STEP_OFF else p.fully_async) is not None
    said = [n for n in p.notes if n.startswith("algorithm.filter_groups with")]
    assert len(said) == 1 and ("rank 0 scores and filters" in said[0]) == (processes > 1)
    assert ("top-up batches" in said[0]) == (mode == ONE_STEP_OFF)


def metric_rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def parity_reward(tmp_path):
    """Overrides for a reward that filters: even sums score a constant 1, odd ones a score of the response's text."""
    (tmp_path / "parity.py").write_text("def compute_reward(responses, ground_truths):\n"
                                        "    return [1.0 if int(g) % 2 == 0 else sum(map(ord, r)) / 100.0\n"
                                        "            for r, g in zip(responses, ground_truths)]\n")
    return [f"custom_reward_function.path={tmp_path}/parity.py", "custom_reward_function.name=compute_reward"]


@pytest.mark.parametrize("mode", [COLOCATE, ONE_STEP_OFF], ids=["colocate_async", "one_step_off"])
def test_the_entry_point_trains_async_with_dynamic_sampling(tiny, capsys, tmp_path, mode):
    """verl's keys select DAPO's filter with either asynchronous mode: even sums score a constant 1 (filtered), odd
    ones a score of the response's text; every dumped trained group has distinct scores, the dapo/* metrics count
    what was scored per step (fully async: groups; one step off: whole batches, the top-ups generated ahead)."""
    assert main(tiny + FILTER + mode + parity_reward(tmp_path) + ["trainer.logger=[console,file]",
                                                                  f"trainer.rollout_data_dir={tmp_path}/rollouts",
                                                                  f"trainer.default_local_dir={tmp_path}/run"]) == 0
    assert "FilterGroups(" in capsys.readouterr().out
    steps = [r for r in metric_rows(tmp_path / "run") if "dapo/num_gen_batches" in r]
    assert len(steps) == 2 and any(r["dapo/num_gen_batches"] > 1 for r in steps)  # it did filter (half are even)
    if mode == COLOCATE:
        assert all("training/off_policy/trajectory_spans/max" in r for r in steps)
        assert all(r["dapo/kept_group_frac"] == pytest.approx(1 / r["dapo/num_gen_batches"]) for r in steps)
    else:
        assert [r["async/staleness_max"] for r in steps] == [0, 1]  # the second step's batches generated ahead
        assert all(r["dapo/num_gen_batches"] == int(r["dapo/num_gen_batches"]) for r in steps)  # whole batches
    for step in (1, 2):
        dumped = [json.loads(line) for line in (tmp_path / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
        by_prompt = {}
        for r in dumped:
            by_prompt.setdefault(r["input"], []).append(r["score"])
        assert len(dumped) == 8 and all(len(set(s)) > 1 for s in by_prompt.values())


def test_staleness_zero_with_dynamic_sampling_is_the_synchronous_dynamic_sampling_run(tiny, tmp_path):
    """``async_training.staleness_threshold=0``: the engine in its own process, nothing ahead; with DAPO's filter the
    run's metrics are the synchronous filtered run's (without the IS correction the mode turns on: its weights are
    1 up to rounding here)."""
    for run, mode in (("sync", []), ("zero", ["async_training.staleness_threshold=0",
                                              "algorithm.rollout_correction.rollout_is=null"])):
        assert main(tiny + FILTER + mode + parity_reward(tmp_path) + [
            "trainer.logger=[console,file]", f"trainer.default_local_dir={tmp_path}/{run}"]) == 0
    drop = ("timing_s/", "perf/", "async/", "weight_sync/")
    sync = [{k: v for k, v in r.items() if not k.startswith(drop)} for r in metric_rows(tmp_path / "sync")]
    steps = [r for r in sync if "dapo/num_gen_batches" in r]
    assert len(steps) == 2 and any(r["dapo/num_gen_batches"] > 1 for r in steps)  # a step topped up
    assert sync == [{k: v for k, v in r.items() if not k.startswith(drop)} for r in metric_rows(tmp_path / "zero")]


# verl's fully-async recipe (verl/experimental/fully_async_policy): partial_rollout, trigger_parameter_sync_step,
# require_batches
RECIPE = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=2"]


def test_partial_rollout_is_fully_async_with_the_staleness_threshold_as_the_generation_ahead():
    p = plan("async_training.partial_rollout=true", "async_training.staleness_threshold=0.5")
    assert p.fully_async == {"max_off_policy_threshold": None, "max_off_policy_strategy": "drop",
                             "num_warmup_batches": 0.5}  # verl's (1 + threshold) batches ahead, no age bound
    assert p.async_rollout is None
    assert any("async_training.partial_rollout=True: the Trainer gets rollout=FullyAsyncRollout(" in n for n in p.notes)
    recipe = plan("async_training.partial_rollout=true").fully_async
    assert recipe["num_warmup_batches"] == 0.1  # the recipe's default bound
    assert plan("async_training.partial_rollout=true", "async_training.staleness_threshold=2"
                ).fully_async["num_warmup_batches"] == 2
    sync = plan("async_training.partial_rollout=true", "async_training.staleness_threshold=0")
    assert sync.fully_async is None and sync.async_rollout == {"max_staleness": 0}  # verl: no effect at 0
    assert any("no effect" in n for n in sync.notes)
    assert plan("async_training.partial_rollout=false", "async_training.staleness_threshold=1"
                ).async_rollout == {"max_staleness": 1}  # verl's stale-samples mode without partial rollouts


@pytest.mark.parametrize("overrides, error, message", [
    (["async_training.staleness_threshold=-0.5"], ConfigError, r"staleness_threshold=-0.5: with .*partial_rollout"),
    (["trainer.async_weight_update=true"], ConfigError, "two asynchronous modes"),
    (["trainer.v1.trainer_mode=colocate_async"], ConfigError, "partial_rollout=True both ask"),
])
def test_what_partial_rollouts_cannot_take_is_refused_naming_the_key(overrides, error, message):
    with pytest.raises(error, match=message):
        plan("async_training.partial_rollout=true", *overrides)


def test_a_sync_cycle_of_trigger_x_require_mini_batches_is_one_step():
    p = plan(*RECIPE, "async_training.trigger_parameter_sync_step=2", "async_training.require_batches=2")
    assert p.trainer_kwargs["batch_size"] == 8 and p.trainer_kwargs["mini_batch_size"] == 2
    assert any("synced once per step of data.train_batch_size=8 prompts = 2 x 2 mini-batches" in n for n in p.notes)
    assert any("require_batches=4" in n for n in plan(*RECIPE, "async_training.require_batches=4").notes)
    assert not any("trigger_parameter_sync_step" in n for n in plan(*RECIPE).notes)  # unset: nothing to say


@pytest.mark.parametrize("overrides, message", [
    (["async_training.trigger_parameter_sync_step=2"], r"every 2 x 1 x ppo_mini_batch_size = 4 prompts, rlflow once "
                                                       r"per step of data.train_batch_size=8; set data.train_batch_size=4"),
    (["async_training.require_batches=3"], "set data.train_batch_size=6"),
    (["async_training.trigger_parameter_sync_step=0"], "trigger_parameter_sync_step=0: an integer >= 1"),
    (["async_training.trigger_parameter_sync_step=4", "actor_rollout_ref.actor.ppo_epochs=2"],
     "over each of the 4 local batches.*require_batches=4"),
])
def test_a_sync_cadence_rlflow_would_change_is_refused_naming_the_batch_size(overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan(*RECIPE, *overrides)


def test_partial_rollouts_correct_as_verls_fully_async_recipe_bypass_mode_unless_the_config_says_otherwise():
    """verl's fully_async_ppo_trainer.yaml sets bypass_mode=True (PPO-clip against the sampler's log-probs, no
    old-log-prob pass); on the default job it learned more than decoupled truncated IS (docs/async.md)."""
    p = plan("async_training.partial_rollout=true", "async_training.staleness_threshold=0.5")
    assert p.loss_cls.__name__ == "BypassLoss" and p.loss_kwargs["loss_type"] == "ppo_clip"
    assert [cls.__name__ for cls, _ in p.before] == ["RolloutAsOld"] and not p.after
    assert any("bypass_mode=True (verl's fully-async recipe default" in n for n in p.notes)
    decoupled = plan("async_training.partial_rollout=true", "algorithm.rollout_correction.bypass_mode=false")
    assert decoupled.loss_cls.__name__ == "PPOLoss" and decoupled.loss_kwargs["is_weights"]
    assert [(cls.__name__, kwargs["level"]) for cls, kwargs in decoupled.after] == [("TruncatedIS", "token")]
    for other in (["async_training.partial_rollout=true", "async_training.staleness_threshold=0"],  # synchronous
                  ["trainer.use_v1=true", "trainer.v1.trainer_mode=colocate_async"],  # verl V1: bypass_mode=false
                  ["async_training.staleness_threshold=1"]):  # one-step-off
        assert plan(*other).loss_cls.__name__ == "PPOLoss", other


def test_the_entry_point_trains_verls_fully_async_recipe_keys(tiny, capsys, tmp_path):
    """The recipe's four keys through ``main_ppo``: partial rollouts at most 1.5 batches ahead, a sync cycle of
    2 x 1 mini-batches of 2 prompts = the step's 4 prompts; two steps trained, the second on stale samples at most."""
    assert main(tiny + ["async_training.partial_rollout=true", "async_training.staleness_threshold=0.5",
                        "async_training.trigger_parameter_sync_step=2", "async_training.require_batches=1",
                        "trainer.logger=[console,file]"]) == 0
    out = capsys.readouterr().out
    assert "FullyAsyncRollout(" in out and "num_warmup_batches=0.5" in out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "training/off_policy/trajectory_spans/max" in r]
    assert len(steps) == 2 and all("rollout_corr/k3_kl" in r for r in steps)  # bypass mode: the loss's metrics


def test_pause_mode_chooses_how_partial_rollouts_continue_a_request_and_a_bad_one_is_named():
    """rlflow's async_training.pause_mode (verl has no key for it) reaches FullyAsyncRollout in both fully
    asynchronous modes; unset, FullyAsyncRollout's own default (auto) holds."""
    v1 = ["trainer.use_v1=true", "trainer.v1.trainer_mode=separate_async"]
    assert plan(*v1, "async_training.pause_mode=chunks").fully_async["pause_mode"] == "chunks"
    assert plan("async_training.partial_rollout=true", "async_training.pause_mode=keep").fully_async["pause_mode"] == "keep"
    assert "pause_mode" not in plan(*v1).fully_async
    with pytest.raises(ConfigError, match="async_training.pause_mode='abort'.*auto, keep, chunks"):
        plan(*v1, "async_training.pause_mode=abort")
    noted = [n for n in unused_notes(plan("async_training.pause_mode=keep").cfg) if "pause_mode" in n]
    assert noted and "only used with the fully asynchronous modes" in noted[0]  # a synchronous run says so
    assert not [n for n in unused_notes(plan(*v1, "async_training.pause_mode=keep").cfg) if "pause_mode" in n]
