"""The sampler's log-probs are the policy's, for transformers' ``generate`` (HFRollout) and vLLM (VLLMRollout,
in-process CPU engine), at a temperature with top-k/top-p truncation (log-probs are reported before it).

Tolerances from measurement (float32, 2-core CPU, 6 samples x 16 tokens): HF max |sampler - policy| 1.9e-5,
vLLM 3.3e-5 (2.5e-5 greedy). The bounds below leave a few times that for other CPUs' kernels; a wrong temperature,
a log-prob read after truncation, an off-by-one position or a bf16 engine are all off by 1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch

from rlflow import HFRollout, Policy
from rlflow.data import keys as K
from tests.real_model.helpers import EOS, chat_batch, requires_vllm

QUESTIONS = ("What is 2+2? Reply with only the number.", "Name a color.", "Write a haiku about the sea.")
SAMPLING = {"n": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 50, "max_new_tokens": 16, "seed": 0}
HF_TOLERANCE, VLLM_TOLERANCE = 1e-4, 2e-4


def largest_gap(batch) -> float:
    mask = batch[K.RESPONSE_MASK].bool()
    return (batch[K.ROLLOUT_LOG_PROBS] - batch[K.OLD_LOG_PROBS])[mask].abs().max().item()


def check_layout(batch, max_new: int) -> None:
    """Each row ends at its first EOS (kept) or at the limit; padding after it has mask 0 and log-prob 0."""
    for ids, mask in zip(batch[K.RESPONSE_IDS].tolist(), batch[K.RESPONSE_MASK].tolist()):
        n = sum(mask)
        assert mask[:n] == [1] * n and EOS not in ids[: n - 1] and (ids[n - 1] == EOS or n == max_new)
    assert batch[K.ROLLOUT_LOG_PROBS][batch[K.RESPONSE_MASK] == 0].eq(0).all()


@pytest.fixture(scope="module")
def warm_policy(policy, tok):
    """The session's model at the sampling temperature (same weights, no copy)."""
    return Policy(policy.model, tok, temperature=SAMPLING["temperature"])


def test_hf_rollout_log_probs_equal_the_policys(policy, warm_policy, tok):
    rollout = HFRollout(**SAMPLING)
    rollout.bind(policy.model, tok)
    batch = warm_policy(rollout(chat_batch(tok, QUESTIONS)))
    check_layout(batch, SAMPLING["max_new_tokens"])
    assert batch[K.RESPONSE_MASK].sum() > 60  # enough tokens to mean something
    assert largest_gap(batch) < HF_TOLERANCE


@pytest.fixture(scope="module")
def vllm_rollout(policy, tok):
    """An in-process vLLM engine on the real model, float32 as rlflow's default job runs it (vLLM's own default
    would load this float32 folder in bfloat16), with the default context length and CPU KV cache."""
    from rlflow.rollout import VLLMRollout

    rollout = VLLMRollout(**SAMPLING, dtype="float32", enforce_eager=True)
    rollout.bind(policy.model, tok)
    yield rollout
    # Closed with the module: the engine holds GBs for this model, and it would stay in the process's engine pool
    # for the rest of the session (tests/rollout/test_vllm_config.py counts the pool's engines).
    rollout.engine.close()


@requires_vllm
def test_vllm_log_probs_equal_the_policys(vllm_rollout, warm_policy, tok):
    config = vllm_rollout.engine.llm.llm_engine.model_config
    assert config.dtype == torch.float32
    # SmolLM2's 8,192-token context needs 0.35 GiB of float32 KV cache, more than the 256 MiB CPU default: the engine
    # takes what that cache holds (5,632 tokens) instead of failing to start
    assert 4096 <= config.max_model_len < 8192
    batch = warm_policy(vllm_rollout(chat_batch(tok, QUESTIONS)))
    check_layout(batch, SAMPLING["max_new_tokens"])
    assert batch[K.RESPONSE_MASK].sum() > 60
    assert largest_gap(batch) < VLLM_TOLERANCE


@requires_vllm
def test_vllm_greedy_is_transformers_greedy(vllm_rollout, policy, tok):
    prompts = chat_batch(tok, QUESTIONS + ("What is the capital of France? Answer in one word.",))
    greedy = policy(vllm_rollout.with_options(n=1, do_sample=False)(prompts))
    check_layout(greedy, SAMPLING["max_new_tokens"])
    assert (greedy[K.RESPONSE_MASK].sum(-1) < SAMPLING["max_new_tokens"]).any()  # some row stopped at its EOS
    assert largest_gap(greedy) < VLLM_TOLERANCE
    hf = HFRollout(n=1, do_sample=False, max_new_tokens=SAMPLING["max_new_tokens"])
    hf.bind(policy.model, tok)
    assert torch.equal(hf(prompts)[K.RESPONSE_IDS], greedy[K.RESPONSE_IDS])
