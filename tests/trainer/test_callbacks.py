"""The Trainer's own callbacks: a run without any learning signal warns once, naming the likely causes."""

import warnings

import pytest
import torch

from rlflow import FunctionReward
from rlflow.trainer.callbacks import NoLearningSignal, NoLearningSignalWarning, identical_group_frac, unwritable_chars

from .helpers import make_trainer


def no_signal_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, NoLearningSignalWarning)]


def fit(trainer, data) -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(data)
    return no_signal_warnings(record)


def test_a_reward_that_is_always_zero_warns_once(model, tokenizer, addition_rows, tmp_path):
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=4)
    trainer.reward = FunctionReward(lambda solution_str, ground_truth: 0.0)
    (message,) = fit(trainer, data)  # after step 3, and not again at step 4
    assert "no learning signal for 3 steps in a row (to step 3)" in message and "Every sample scored 0." in message
    # the built-in character tokenizer has no '\', '{', '}': the seed's \boxed{} reward can never score
    assert "the tokenizer cannot write '\\\\', '{', '}', '<', '>', so no response can contain" in message
    assert "\\boxed{...}" in message and "answer format is never produced" in message
    assert "a sample: response" in message and "ground truth" in message


def test_a_reward_with_signal_does_not_warn(model, tokenizer, addition_rows, tmp_path):
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=3)  # starts_with_digit
    assert fit(trainer, data) == []


def test_all_rewards_one_and_identical_samples(model, tokenizer, addition_rows, tmp_path):
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=3)
    trainer.reward = FunctionReward(lambda solution_str, ground_truth: 1.0)
    (message,) = fit(trainer, data)
    assert "Every sample scored 1." in message and "too easy" in message and "tokenizer" not in message


def test_patience_and_turning_it_off(model, tokenizer, addition_rows, tmp_path):
    zero = FunctionReward(lambda solution_str, ground_truth: 0.0)
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=3,
                                 callbacks=[NoLearningSignal(patience=0)])
    assert [type(c).__name__ for c in trainer.fabric._callbacks] == ["NoLearningSignal", "Watchdog"]  # not a second one
    trainer.reward = zero
    assert fit(trainer, data) == []


def test_identical_groups_and_unwritable_characters(tokenizer):
    ids = torch.tensor([[5, 6, 0], [5, 6, 7], [3, 4, 0], [3, 4, 9], [1, 1, 1]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    group = torch.tensor([0, 0, 1, 1, 2])
    # group 0: the same tokens under the mask; group 1: differ in length; group 2: a single sample
    assert identical_group_frac(ids, mask, group) == pytest.approx(1 / 2)
    assert unwritable_chars(tokenizer, "What is \\boxed{42}?") == ["W", "\\", "{", "}"]


def test_the_seeds_workflow_1_on_the_builtin_tiny_model_says_why(tmp_path, monkeypatch):
    """The seed's \\boxed{} reward file through the verl entry point on the character-tokenizer model: every
    step scores 0, and the warning says the tokenizer cannot write the box."""
    import pandas as pd

    import rlflow.config.verl.devices as devices
    from rlflow.models.tiny import char_tokenizer, tiny_qwen2
    from rlflow.trainer.main_ppo import main
    from tests.config.conftest import CHAT_TEMPLATE, verl_rows
    from tests.config.test_main_ppo import SEED_REWARD

    monkeypatch.setattr(devices, "cuda_count", lambda: 0)
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tiny_qwen2(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
               seed=0).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    pd.DataFrame(verl_rows(12, "train", 0)).to_parquet(tmp_path / "train.parquet")
    (tmp_path / "reward_function.py").write_text(SEED_REWARD)
    argv = [f"data.train_files={tmp_path}/train.parquet", f"actor_rollout_ref.model.path={tmp_path}/model",
            f"custom_reward_function.path={tmp_path}/reward_function.py", "custom_reward_function.name=compute_reward",
            "trainer.device=cpu", "trainer.n_gpus_per_node=1", "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2", "data.max_prompt_length=8",
            "data.max_response_length=4", "trainer.total_training_steps=3", "trainer.logger=[console]",
            f"trainer.default_local_dir={tmp_path}/run", "algorithm.adv_estimator=grpo"]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert main(argv) == 0
    (message,) = no_signal_warnings(record)
    assert "Every sample scored 0." in message and "the tokenizer cannot write '\\\\', '{', '}'" in message
