"""recipes/reward_model.py runs: a reward model trained in code on a preference, then GRPO with it as the
reward and the preference's rule logged beside it (weight 0). The full run's figures are in docs/rewards.md."""

import importlib.util
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "reward_model.py"


@pytest.fixture(scope="module")
def recipe():
    spec = importlib.util.spec_from_file_location("reward_model_recipe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rule_and_preference_pairs(recipe):
    import random

    assert recipe.even_digits("2468") == 1.0 and recipe.even_digits("21") == 0.5 and recipe.even_digits("") == 0.0
    for _, chosen, rejected in recipe.preference_pairs(["1+1="], 50, random.Random(0)):
        assert recipe.even_digits(chosen) > recipe.even_digits(rejected)


def test_recipe_trains_the_reward_model_then_runs_grpo_on_it(recipe, monkeypatch, tmp_path):
    monkeypatch.setattr(recipe, "warm_started_model", lambda task, seed: (task.model(seed), task.tokenizer()))
    trainer, data, accuracy = recipe.build(steps=2, rm_steps=12, run_dir=tmp_path, loggers=(), progress=False)
    assert accuracy > 0.8  # the preference is easy: a dozen Bradley-Terry steps learn most of it
    history = trainer.fit(data)
    last = history[-1]
    assert last["critic/score/mean"] == pytest.approx(last["reward/reward_model/mean"], abs=1e-5)  # the rule: weight 0
    assert 0.0 <= last["reward/even_digits/mean"] <= 1.0
    assert set(recipe.summary(history, window=1)) == {"reward/reward_model/mean", "reward/even_digits/mean"}
