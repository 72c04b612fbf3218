"""verl's reward-manager classes from a file (reward.reward_manager.source=importlib, and the older
reward_model.reward_loop_source=importlib): a class written for rlflow's reward role is built and scores; one written
against verl's DataProto interface is refused, naming the file, the class and what to change."""

from pathlib import Path

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

import rlflow.config.verl.devices as devices
from rlflow.config import load_config, make_plan
from rlflow.config.verl.build import build_reward
from rlflow.config.verl.loading import ConfigError
from rlflow.config.verl.run import unused_notes
from rlflow.data.keys import DATA_SOURCE, EXTRA_INFO, GROUND_TRUTH, RESPONSE_MASK, RESPONSE_TEXT, SCORES, TOKEN_REWARDS
from rlflow.trainer.main_ppo import main

from .test_main_ppo import steps

EXAMPLE = Path(__file__).parents[2] / "examples" / "reward_class" / "length_bonus.py"
SCORER = '''
def exact(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth)
'''
VERL_STYLE = '''
from verl import DataProto
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase


class MyManager(RewardManagerBase):
    async def run_single(self, data: DataProto) -> dict:
        return {"reward_score": 1.0}
'''
DATAPROTO_ONLY = '''
from rlflow import Reward


class Scorer(Reward):
    def score(self, data: "DataProto"):
        return [0.0]
'''


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


def batch(texts, truths):
    b = len(texts)
    return TensorDict({RESPONSE_TEXT: NonTensorStack(*texts), GROUND_TRUTH: NonTensorStack(*truths),
                       DATA_SOURCE: NonTensorStack(*["mine"] * b), EXTRA_INFO: NonTensorStack(*[None] * b),
                       RESPONSE_MASK: torch.ones(b, 3, dtype=torch.int64)}, batch_size=[b])


def plan_of(tiny, *overrides):
    return make_plan(load_config(tiny + list(overrides)))


def test_verl09_reward_manager_class_from_a_file_scores_the_batch(tiny, tmp_path):
    scorer = tmp_path / "scorer.py"
    scorer.write_text(SCORER)
    keys = ["reward.reward_manager.source=importlib", f"reward.reward_manager.module.path={EXAMPLE}",
            "reward.reward_manager.name=LengthBonus", "+reward.reward_kwargs.per_char=0.5",
            f"reward.custom_reward_function.path={scorer}", "reward.custom_reward_function.name=exact"]
    plan = plan_of(tiny, *keys)
    reward = build_reward(plan)
    assert type(reward).__name__ == "LengthBonus" and reward.per_char == 0.5
    out = reward(batch(["12", "7"], ["12", "3"]))
    assert out[SCORES].tolist() == [2.0, 0.5]  # exact match + 0.5 per character
    assert out[TOKEN_REWARDS][:, -1].tolist() == [2.0, 0.5] and reward.stats["reward/extra/length"] == 1.5
    assert not [n for n in unused_notes(plan.cfg) if "reward_manager" in n]  # every key took effect



def test_dry_run_shows_the_class_in_the_tree(tiny, capsys):
    assert main(tiny + ["--dry-run", "reward.reward_manager.source=importlib",
                        f"reward.reward_manager.module.path={EXAMPLE}", "reward.reward_manager.name=LengthBonus"]) == 0
    out = capsys.readouterr().out
    assert f"LengthBonus = load_object('{EXAMPLE}', 'LengthBonus'" in out
    assert "reward=LengthBonus(compute_score=default_compute_score)" in out


def test_older_reward_loop_keys_and_a_real_run(tiny, capsys):
    run = tiny + ["reward_model.reward_loop_source=importlib", f"reward_model.reward_loop_module_path={EXAMPLE}",
                  "reward_model.reward_loop_class_name=LengthBonus", "+reward_model.reward_kwargs.per_char=1.0",
                  "trainer.total_training_steps=1", "trainer.val_before_train=false"]
    assert type(build_reward(make_plan(load_config(run)))).__name__ == "LengthBonus"
    assert main(run) == 0
    logged = steps(capsys.readouterr().out)[1]
    # the built-in gsm8k scorer gives 0 to a 4-token random response; the bonus is 1 per character
    assert logged["critic/score/mean"] == pytest.approx(logged["reward/extra/length"]) and logged["critic/score/mean"] > 0


def test_a_class_written_against_verl_is_refused_with_what_to_change(tiny, tmp_path):
    verl_style = tmp_path / "verl_manager.py"
    verl_style.write_text(VERL_STYLE)
    with pytest.raises(ConfigError, match=r"reward.reward_manager.module.path='.*verl_manager.py': class MyManager in "
                                          r".*verl_manager.py is written against verl's reward-manager interface \(it "
                                          r"subclasses verl's RewardManagerBase; it implements verl's run_single; its "
                                          r"run_single takes a DataProto\).*Change it to subclass rlflow.Reward and "
                                          r"implement score\(self, batch\)"):
        plan_of(tiny, "reward.reward_manager.source=importlib", f"reward.reward_manager.module.path={verl_style}",
                "reward.reward_manager.name=MyManager")
    annotated = tmp_path / "annotated.py"
    annotated.write_text(DATAPROTO_ONLY)
    with pytest.raises(ConfigError, match=r"class Scorer .*\(its score takes a DataProto\)"):
        plan_of(tiny, "reward_model.reward_loop_source=importlib", f"reward_model.reward_loop_module_path={annotated}",
                "reward_model.reward_loop_class_name=Scorer")


def test_bad_reward_class_keys_name_their_key(tiny, tmp_path):
    with pytest.raises(ConfigError, match=r"reward.reward_manager.source=importlib needs "
                                          r"reward.reward_manager.module.path"):
        plan_of(tiny, "reward.reward_manager.source=importlib", "reward.reward_manager.name=LengthBonus")
    with pytest.raises(ConfigError, match=r"reward.reward_manager.source='pip': choose from register, importlib"):
        plan_of(tiny, "reward.reward_manager.source=pip")
    with pytest.raises(ConfigError, match=r"defines no 'LenBonus'.*LengthBonus"):
        plan_of(tiny, "reward.reward_manager.source=importlib", f"reward.reward_manager.module.path={EXAMPLE}",
                "reward.reward_manager.name=LenBonus")
    with pytest.raises(ConfigError, match=r"reward.reward_kwargs: LengthBonus.__init__ takes no scale"):
        plan_of(tiny, "reward.reward_manager.source=importlib", f"reward.reward_manager.module.path={EXAMPLE}",
                "reward.reward_manager.name=LengthBonus", "+reward.reward_kwargs.scale=2")
    plain = tmp_path / "plain.py"
    plain.write_text("class Plain:\n    pass\n")
    with pytest.raises(ConfigError, match=r"the class Plain is not a subclass of rlflow.rewards.base.Reward. Change it to subclass"):
        plan_of(tiny, "reward.reward_manager.source=importlib", f"reward.reward_manager.module.path={plain}",
                "reward.reward_manager.name=Plain")
