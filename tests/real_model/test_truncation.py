"""``data.max_prompt_length`` with the real tokenizer: an over-long chat prompt (counted in tokens after the chat
template, default system prompt included) is cut to exactly ``max_prompt_length`` tokens on the side verl's
``data.truncation`` names (``left`` keeps the end, ``right`` the start, ``middle`` both ends), or, with ``error``,
stops with the file and the row; ``filter_overlong_prompts`` drops such rows instead."""

from __future__ import annotations

import pandas as pd
import pytest

from rlflow import PromptData
from rlflow.data import keys as K
from rlflow.data.prompts import DataError
from tests.real_model.helpers import chat_rows

LIMIT = 32
LONG = ("Tell me about the history of the printing press, from the first movable type in East Asia to Gutenberg's "
        "workshop in Mainz, and how cheap books changed schooling, science and religion across Europe.")
QUESTIONS = ("Hi", LONG, LONG.upper())  # a short row (padded, untouched) and two long ones


@pytest.fixture
def train_file(tmp_path):
    pd.DataFrame(chat_rows(QUESTIONS)).to_parquet(tmp_path / "train.parquet")
    return tmp_path / "train.parquet"


def full_ids(tok, question):
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_over_long_prompts_keep_exactly_max_prompt_length_tokens_on_the_chosen_side(side, train_file, tok):
    data = PromptData(str(train_file), max_prompt_length=LIMIT, truncation=side, shuffle=False)
    batch = next(iter(data.loader(len(QUESTIONS), tok)))
    ids, mask = batch[K.PROMPT_IDS], batch[K.PROMPT_MASK]
    assert ids.shape == (3, LIMIT) and mask.sum(-1).tolist() == [len(full_ids(tok, "Hi")), LIMIT, LIMIT]
    assert ids[0][mask[0].bool()].tolist() == full_ids(tok, "Hi")  # short prompts are left alone
    for row in (1, 2):
        full = full_ids(tok, QUESTIONS[row])
        assert len(full) > 2 * LIMIT
        kept = {"left": full[-LIMIT:], "right": full[:LIMIT], "middle": full[: LIMIT // 2] + full[-LIMIT // 2:]}[side]
        assert ids[row].tolist() == kept
    text = tok.decode(ids[1])
    if side == "right":  # the start: the default system prompt; the generation prompt is gone
        assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant") and "assistant\n" not in text[-12:]
    else:  # the end survives: the model is still asked to answer
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    if side == "middle":
        assert text.startswith("<|im_start|>system\n")


def test_error_mode_names_the_file_and_the_row(train_file, tok):
    data = PromptData(str(train_file), max_prompt_length=LIMIT, truncation="error", shuffle=False)
    with pytest.raises(DataError) as e:
        next(iter(data.loader(3, tok)))
    n = len(full_ids(tok, LONG))
    assert f"{train_file}, row 1: prompt has {n} tokens > max_prompt_length={LIMIT}" in str(e.value)


def test_filter_overlong_prompts_drops_and_counts_them(train_file, tok):
    data = PromptData(str(train_file), max_prompt_length=LIMIT, filter_overlong_prompts=True, shuffle=False)
    assert data.filter_overlong(tok) == {"train": 2, "val": 0}
    assert [r["prompt"][-1]["content"] for r in data.train] == ["Hi"]


def test_the_verl_keys_reach_the_data(train_file, smollm2_dir, tok):
    """``data.max_prompt_length`` / ``data.truncation`` through the verl entry point's config, on the real model."""
    from rlflow.config import load_config, make_plan

    cfg = load_config([f"data.train_files={train_file}", f"actor_rollout_ref.model.path={smollm2_dir}",
                       f"data.max_prompt_length={LIMIT}", "data.truncation=middle", "data.max_response_length=16",
                       "data.train_batch_size=3", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
                       "trainer.device=cpu", "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf"])
    data = PromptData(**make_plan(cfg).data_kwargs)
    batch = data.collate(data.train, tok)
    full = full_ids(tok, LONG)
    assert batch[K.PROMPT_IDS][1].tolist() == full[: LIMIT // 2] + full[-LIMIT // 2:]
