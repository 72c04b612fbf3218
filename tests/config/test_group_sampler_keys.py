"""verl's trainer.v1.sampler.custom_sampler.*: a GroupSampler class from a file, built with sampler_kwargs, chooses
FullyAsyncRollout's batches; a class written against verl's ReplayBuffer is refused naming file, class and change."""

import pytest

import rlflow.config.verl.devices as devices
from rlflow.config import ConfigError, load_config, make_plan
from rlflow.registry import load_object
from rlflow.trainer.main_ppo import main

BASE = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.model.path=m", "data.train_files=t.parquet",
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.logger=[console]",
        "trainer.v1.trainer_mode=colocate_async"]
LONGEST = '''from rlflow.rollout.group_sampler import GroupSampler

CALLS = []


class Longest(GroupSampler):
    def __init__(self, top=1):
        self.top = top

    def choose(self, groups, k, step):
        CALLS.append((len(groups), k, step))
        return sorted(range(len(groups)), key=lambda i: -sum(map(len, groups[i].responses)))[:k]
'''
VERL_STYLE = '''from verl.experimental.replay_buffer import ReplayBuffer


class MySampler(ReplayBuffer):
    def sample(self, global_steps, partition_id, batch_size):
        return None, {}
'''


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


def plan(tmp_path, source, name, *overrides):
    (tmp_path / "sampler.py").write_text(source)
    return make_plan(load_config(BASE + [f"trainer.v1.sampler.custom_sampler.path={tmp_path / 'sampler.py'}",
                                         f"trainer.v1.sampler.custom_sampler.name={name}", *overrides]))


def test_the_sampler_class_is_built_with_its_kwargs_and_given_to_fully_async_rollout(tmp_path):
    p = plan(tmp_path, LONGEST, "Longest", "+trainer.v1.sampler.sampler_kwargs.top=3")
    sampler = p.fully_async["sampler"]
    assert type(sampler).__name__ == "Longest" and sampler.top == 3
    assert any("FullyAsyncRollout(sampler=Longest())" in n for n in p.notes)


@pytest.mark.parametrize("source, name, overrides, message", [
    (VERL_STYLE, "MySampler", [], r"custom_sampler.path='.*sampler.py': class MySampler in .*sampler.py is written "
     r"against verl's replay-buffer sampler \(it subclasses verl's ReplayBuffer; it implements verl's ReplayBuffer "
     r"sample\(global_steps, partition_id, batch_size\)\).*Change it to subclass rlflow.rollout.group_sampler.GroupSampler"),
    (LONGEST, "Longest", ["trainer.v1.trainer_mode=sync"], r"custom_sampler.path=.*only the asynchronous modes have"),
    (LONGEST, "null", [], r"custom_sampler.name=None: the class name"),
    (LONGEST, "Longest", ["+trainer.v1.sampler.sampler_kwargs.width=2"], r"sampler_kwargs=\{'width': 2\}: Longest"),
    ("class Longest:\n    pass\n", "Longest", [], r"not a subclass.*Change it to subclass rlflow.rollout.group_sampler"),
])
def test_what_the_sampler_keys_cannot_take_is_refused_naming_the_key(tmp_path, source, name, overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan(tmp_path, source, name, *overrides)


def test_the_entry_point_trains_with_the_sampler_choosing_each_batch(tiny, tmp_path, capsys):
    (tmp_path / "sampler.py").write_text(LONGEST)
    calls = load_object(str(tmp_path / "sampler.py"), "CALLS", "test")
    assert main(tiny + ["trainer.v1.trainer_mode=colocate_async", f"trainer.v1.sampler.custom_sampler.path="
                        f"{tmp_path / 'sampler.py'}", "trainer.v1.sampler.custom_sampler.name=Longest"]) == 0
    assert "sampler=Longest()" in capsys.readouterr().out
    assert [k for _, k, _ in calls] == [4, 4] and all(offered >= k for offered, k, _ in calls)  # two steps of 4
