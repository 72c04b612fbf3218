"""verl's replay of dumped rollouts through the verl entry point: skip.<section>.enable (verl 0.9) and
rollout.skip_rollout (older) wrap the rollout in ReplayRollout; a second run with the same keys trains on the first
run's samples; other settings and verl's own dumps are refused."""

import pickle

import pytest

from rlflow.config import ConfigError, load_config, make_plan
from rlflow.config.verl.build import build_trainer
from rlflow.rollout.replay import ReplayRollout

R = "actor_rollout_ref.rollout"


def fit(overrides):
    trainer, data = build_trainer(make_plan(load_config(overrides)))
    assert isinstance(trainer.rollout, ReplayRollout)
    return trainer.fit(data)


def test_skip_rollout_dumps_then_replays_every_step(tiny, tmp_path):
    keys = tiny + [f"{R}.skip_rollout=True", f"{R}.skip_dump_dir={tmp_path}/dump", "trainer.val_before_train=false",
                   "trainer.test_freq=-1", "trainer.experiment_name=e", "trainer.project_name=p"]
    first = fit(keys)
    assert [h["replay/replayed"] for h in first] == [0.0, 0.0] and (tmp_path / "dump" / "e_p" / "2" / "rank0" / "samples").is_dir()
    second = fit(keys)
    assert [h["replay/replayed"] for h in second] == [1.0, 1.0]
    assert second[0]["actor/pg_loss"] == first[0]["actor/pg_loss"]
    assert [h["critic/score/mean"] for h in second] == [h["critic/score/mean"] for h in first]
    with pytest.raises(ValueError, match=r"other settings \(temperature: dumped 1.0, now 0.7\)"):
        fit(keys + [f"{R}.temperature=0.7"])


def test_skip_sections_map_steps_and_action_and_say_which_verl_trainer_reads_them(tiny, tmp_path):
    plan = make_plan(load_config(tiny + ["skip.rollout_tq.enable=True", f"skip.rollout_tq.dump_dir={tmp_path}",
                                         "skip.rollout_tq.steps=[1,3]", "skip.rollout_tq.action=repeat"]))
    assert plan.replay["rounds"] == [1, 3] and plan.replay["action"] == "repeat"
    assert plan.replay["dump_dir"].startswith(f"{tmp_path}/")
    assert any("verl reads it in the V1 trainer" in n for n in plan.notes)
    plan = make_plan(load_config(tiny + ["skip.rollout.enable=True"]))
    assert plan.replay["rounds"] == [] and any("no step is dumped or replayed" in n for n in plan.notes)
    assert make_plan(load_config(tiny)).replay is None
    with pytest.raises(ConfigError, match="keep one"):
        make_plan(load_config(tiny + ["skip.rollout.enable=True", f"{R}.skip_rollout=True"]))
    with pytest.raises(ConfigError, match="skip.rollout.action='random': expected one of"):
        make_plan(load_config(tiny + ["skip.rollout.enable=True", "skip.rollout.action=random"]))
    with pytest.raises(ConfigError, match="with asynchronous generation .* is not supported yet"):
        make_plan(load_config(tiny + ["skip.rollout.enable=True", "trainer.async_weight_update=true"]))


def test_a_folder_verl_dumped_into_is_refused_saying_so(tiny, tmp_path):
    step = tmp_path / "dump" / "e_p" / "GBS4_N2_in8_out4" / "1"  # verl: dump_dir/{exp}_{project}/GBS.../{step}
    step.mkdir(parents=True)
    (step / "gen_batch.dp").write_bytes(pickle.dumps({"batch": None}))
    keys = tiny + ["skip.rollout.enable=True", f"skip.rollout.dump_dir={tmp_path}/dump", "skip.rollout.steps=[1]",
                   "trainer.experiment_name=e", "trainer.project_name=p"]
    with pytest.raises(ValueError, match="holds rollouts verl dumped .*a pickled verl DataProto"):
        build_trainer(make_plan(load_config(keys)))
