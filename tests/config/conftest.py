"""Fixtures: a tiny local model folder and small parquet files in verl's layout (nothing downloaded)."""

import random

import pandas as pd
import pytest

from rlflow.models.tiny import char_tokenizer, tiny_qwen2

# A chat template the character tokenizer can encode: the user's content, then "=" as the generation prompt.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"


def verl_rows(n: int, split: str, seed: int, source: str = "openai/gsm8k") -> list[dict]:
    """GSM8K-style rows with digits-only questions (``12+7``) and ``#### N``-style ground truths."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        rows.append({
            "data_source": source,
            "prompt": [{"role": "user", "content": f"{a}+{b}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": i},
        })
    return rows


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-model")
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    model = tiny_qwen2(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       intermediate_size=64, seed=0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gsm8k")
    pd.DataFrame(verl_rows(12, "train", 0)).to_parquet(path / "train.parquet")
    pd.DataFrame(verl_rows(4, "test", 1)).to_parquet(path / "test.parquet")
    return path


@pytest.fixture
def tiny(model_dir, data_dir, tmp_path):
    """Overrides that make any verl command tiny and CPU-only, writing under tmp_path."""
    return [
        f"data.train_files={data_dir}/train.parquet", f"data.val_files={data_dir}/test.parquet",
        f"actor_rollout_ref.model.path={model_dir}", "trainer.device=cpu", "trainer.n_gpus_per_node=1",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "data.max_prompt_length=8", "data.max_response_length=4", "trainer.total_training_steps=2",
        f"trainer.default_local_dir={tmp_path}/run", "trainer.logger=[console]", "algorithm.adv_estimator=grpo",
    ]
