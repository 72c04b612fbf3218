"""Estimators and policy losses chosen from config: registered names, file.py:Class and module:Class."""

import pytest
import torch
from tensordict import TensorDict

import rlflow.config.verl.devices as devices
from rlflow import GRPO, PPOLoss, keys, register_estimator
from rlflow.config import ConfigError, load_config, make_plan
from rlflow.config.verl.build import build_trainer
from rlflow.config.verl.native import load_native
from rlflow.registry import ESTIMATORS, POLICY_LOSSES

MEDIAN = '''
import torch
from rlflow import GRPO, keys


class MedianGRPO(GRPO):
    """A_i = s_i - median of the scores of i's group (the whole group, i included)."""

    def compute(self, batch):
        s = batch[keys.TOKEN_REWARDS].sum(-1)
        g = batch[keys.GROUP]
        med = torch.stack([s[g == k].median() for k in g.tolist()])
        adv = (s - med)[:, None] * batch[keys.RESPONSE_MASK]
        return adv, adv.clone()


class NotAnEstimator:
    pass
'''
LOSS = '''
from rlflow import PPOLoss


class HalfPPO(PPOLoss):
    def __init__(self, clip_ratio=0.2, **kwargs):
        super().__init__(clip_ratio=clip_ratio, **kwargs)
'''


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


@pytest.fixture
def user_files(tmp_path, monkeypatch):
    (tmp_path / "my_est.py").write_text(MEDIAN)
    (tmp_path / "my_loss.py").write_text(LOSS)
    monkeypatch.chdir(tmp_path)  # the command line's relative paths are the current folder's
    return tmp_path


def batch() -> TensorDict:
    """Two groups of three samples; token rewards on the last valid token."""
    scores = torch.tensor([1.0, 0.0, 3.0, 2.0, 2.0, 5.0])
    mask = torch.ones(6, 2)
    rewards = torch.zeros(6, 2)
    rewards[:, -1] = scores
    return TensorDict({keys.TOKEN_REWARDS: rewards, keys.RESPONSE_MASK: mask,
                       keys.GROUP: torch.tensor([0, 0, 0, 1, 1, 1])}, batch_size=[6])


def test_estimator_from_a_file_on_the_command_line(tiny, user_files):
    plan = make_plan(load_config(tiny + ["algorithm.adv_estimator=my_est.py:MedianGRPO",
                                         "actor_rollout_ref.actor.policy_loss.loss_mode=my_loss.py:HalfPPO"]))
    assert plan.estimator_cls.__name__ == "MedianGRPO" and issubclass(plan.estimator_cls, GRPO)
    assert plan.loss_cls.__name__ == "HalfPPO" and issubclass(plan.loss_cls, PPOLoss)
    out = plan.estimator_cls()(batch())[keys.ADVANTAGES][:, 0]
    # medians by hand: group 0 {1, 0, 3} -> 1; group 1 {2, 2, 5} -> 2
    assert out.tolist() == [0.0, -1.0, 2.0, 0.0, 0.0, 3.0]
    trainer, _ = build_trainer(plan)
    assert type(trainer.estimator).__name__ == "MedianGRPO" and type(trainer.loss).__name__ == "HalfPPO"
    # verl's default strategy (fsdp, not written by the user) on one process: single device, and no note about it
    assert type(trainer.fabric.strategy).__name__ == "SingleDeviceStrategy"
    assert not any("strategy" in note for note in plan.notes)


def test_estimator_from_a_module_and_a_registered_name(tiny):
    plan = make_plan(load_config(tiny + ["algorithm.adv_estimator=rlflow.algorithms.estimators:RLOO"]))
    assert plan.estimator_cls.__name__ == "RLOO"

    class Median(GRPO):
        pass

    register_estimator("median_grpo", Median)
    try:
        assert make_plan(load_config(tiny + ["algorithm.adv_estimator=median_grpo"])).estimator_cls is Median
        with pytest.raises(ValueError, match="already registered"):
            register_estimator("median_grpo", GRPO)
        with pytest.raises(ValueError, match="already registered"):
            POLICY_LOSSES.register("vanilla", PPOLoss)
    finally:
        ESTIMATORS.unregister("median_grpo")
    with pytest.raises(ConfigError, match="'median_grpo': not a registered advantage estimator.*or give a class as "
                                          "file.py:ClassName or package.module:ClassName"):
        make_plan(load_config(tiny + ["algorithm.adv_estimator=median_grpo"]))  # unregistered again


def test_errors_name_what_was_tried(tiny, user_files):
    cases = [
        ("algorithm.adv_estimator=my_est.py:MedianGRP",
         f"{user_files / 'my_est.py'} defines no 'MedianGRP' (it defines classes: MedianGRPO, NotAnEstimator). "
         "Did you mean MedianGRPO?"),
        ("algorithm.adv_estimator=my_est.py:NotAnEstimator",
         "the class NotAnEstimator is not a subclass of rlflow.algorithms.AdvantageEstimator"),
        ("algorithm.adv_estimator=nope.py:X", f"no such file {user_files / 'nope.py'}"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=my_est.py:MedianGRPO",
         "the class MedianGRPO is not a subclass of rlflow.algorithms.PPOLoss"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=rlflow.algorithms:NoSuchLoss", "module rlflow.algorithms has no "
                                                                                       "'NoSuchLoss'"),
    ]
    for override, expected in cases:
        with pytest.raises(ConfigError) as e:
            make_plan(load_config(tiny + [override]))
        assert expected in str(e.value), (override, str(e.value))
        assert override.split("=")[0] in str(e.value)


def test_recipe_names_an_estimator_file_next_to_it(tmp_path, model_dir, data_dir):
    (tmp_path / "my_est.py").write_text(MEDIAN)
    (tmp_path / "r.yaml").write_text(
        f"policy: {{path: {model_dir}}}\nestimator: my_est.py:MedianGRPO\nloss: {{name: vanilla, clip_ratio: 0.2}}\n"
        f"data: {{train: {data_dir}/train.parquet, max_prompt_length: 8}}\nrollout: {{n: 2, max_new_tokens: 4}}\n"
        "trainer: {batch_size: 4, mini_batch_size: 2, max_steps: 1, device: cpu}\n")
    plan = make_plan(load_native(tmp_path / "r.yaml"))
    assert plan.estimator_cls.__name__ == "MedianGRPO"
    assert plan.cfg["algorithm.adv_estimator"] == f"{tmp_path}/my_est.py:MedianGRPO"



def test_recipe_sections_given_by_one_string_on_the_command_line(user_files, model_dir, data_dir):
    """``estimator=file.py:Class`` (and ``loss=``, ``reward=``) overrides a recipe as the same line in it would."""
    (user_files / "r.yaml").write_text(
        f"policy: {{path: {model_dir}}}\nestimator: grpo\n"
        f"data: {{train: {data_dir}/train.parquet, max_prompt_length: 8}}\nrollout: {{n: 2, max_new_tokens: 4}}\n"
        "trainer: {batch_size: 4, mini_batch_size: 2, max_steps: 1, device: cpu}\n")
    cfg = load_native(user_files / "r.yaml", ["estimator=my_est.py:MedianGRPO", "loss=my_loss.py:HalfPPO",
                                              "reward=rlflow.tasks.addition:exact_match"])
    plan = make_plan(cfg)
    assert plan.estimator_cls.__name__ == "MedianGRPO" and plan.loss_cls.__name__ == "HalfPPO"
    assert cfg["custom_reward_function.path"] == "rlflow.tasks.addition"
    assert cfg["custom_reward_function.name"] == "exact_match"

def test_reward_function_from_a_module(tiny, tmp_path):
    """``custom_reward_function.path`` takes an importable module too (native: ``reward: package.module:name``)."""
    from rlflow.tasks.addition import exact_match

    plan = make_plan(load_config(tiny + ["custom_reward_function.path=rlflow.tasks.addition",
                                         "custom_reward_function.name=exact_match"]))
    assert plan.reward_fn is exact_match and plan.custom_reward
    (tmp_path / "r.yaml").write_text("reward: rlflow.tasks.addition:digit_match\n")
    assert load_native(tmp_path / "r.yaml")["custom_reward_function.path"] == "rlflow.tasks.addition"  # not a file
    with pytest.raises(ConfigError, match="no importable module 'rlflow.no_such_rewards'"):
        make_plan(load_config(tiny + ["custom_reward_function.path=rlflow.no_such_rewards"]))
