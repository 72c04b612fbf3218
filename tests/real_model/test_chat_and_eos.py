"""SmolLM2's chat template and its end of turn through rlflow's data path, rollout, reward and loss.

SmolLM2's pad token *is* its EOS (``<|im_end|>``, id 2), and its chat prompts hold that id as real tokens (after
the system and the user message). So any code that finds padding by ``ids == pad_token_id`` would drop real prompt
tokens, mask the EOS the model wrote, or score the wrong token; rlflow carries masks instead, and these tests hold
it to that: prompt tokens with id 2 keep mask 1, each response keeps its first EOS (mask 1, as verl's
``get_response_mask``), everything after it has mask 0 and gets no gradient, and the reward lands on the EOS.
"""

from __future__ import annotations

import pytest
import torch

from rlflow import FunctionReward, HFRollout, PPOLoss, PromptData
from rlflow.data import keys as K
from tests.real_model.helpers import EOS, chat_batch, chat_rows

# greedy answers of SmolLM2-135M-Instruct (float32): the first two end with <|im_end|> within 16 tokens,
# the third is still talking at 16
QUESTIONS = ("What is the capital of France? Answer in one word.", "Is the sky blue? Answer yes or no.",
             "Name a color.")
MAX_NEW = 16


def template_ids(tok, messages) -> list[int]:
    """The chat template's own tokenization of a prompt (transformers' apply_chat_template, tokenize=True)."""
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_verl_parquet_chat_prompts_are_the_chat_template_left_padded(tok, tmp_path):
    import pandas as pd

    rows = chat_rows(QUESTIONS[:2] + ("Hi",))
    rows[2]["prompt"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")  # verl's layout: prompt = list of messages
    data = PromptData(str(tmp_path / "train.parquet"), shuffle=False)
    batch = next(iter(data.loader(3, tok)))
    ids, mask = batch[K.PROMPT_IDS], batch[K.PROMPT_MASK]
    for row, source in enumerate(rows):
        expected = template_ids(tok, source["prompt"])
        assert ids[row][mask[row].bool()].tolist() == expected, row
        assert mask[row].sum() == len(expected) and mask[row][-len(expected):].all()  # left padding only
        assert (ids[row][~mask[row].bool()] == tok.pad_token_id).all()
        assert expected.count(EOS) == len(source["prompt"]) + (source["prompt"][0]["role"] != "system")
    text = batch[K.PROMPT_TEXT]
    assert text[0].startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")  # default system
    assert text[2].startswith("<|im_start|>system\nBe brief.<|im_end|>") and "SmolLM" not in text[2]
    assert all(t.endswith("<|im_end|>\n<|im_start|>assistant\n") for t in text)
    # the row with the shortest prompt is padded with id 2 (== EOS) on the left: mask 0 there, 1 on its real 2s
    short = int(mask.sum(-1).argmin())
    assert ids[short, 0] == EOS and mask[short, 0] == 0 and (ids[short][mask[short].bool()] == EOS).sum() >= 2


@pytest.fixture(scope="module")
def greedy_samples(policy, tok):
    rollout = HFRollout(n=1, do_sample=False, max_new_tokens=MAX_NEW)
    rollout.bind(policy.model, tok)
    return rollout(chat_batch(tok, QUESTIONS))


def test_responses_end_at_the_first_im_end_which_is_kept(greedy_samples, tok):
    ids, mask = greedy_samples[K.RESPONSE_IDS], greedy_samples[K.RESPONSE_MASK]
    lengths = mask.sum(-1).tolist()
    for row in range(2):  # stopped: the EOS is the last masked token, the first 2 of the row
        n = lengths[row]
        assert n < MAX_NEW and ids[row, n - 1] == EOS and EOS not in ids[row, : n - 1].tolist()
        assert mask[row, :n].all() and not mask[row, n:].any()
        assert (ids[row, n:] == tok.pad_token_id).all()  # padding after it: the same id, mask 0
    assert lengths[2] == MAX_NEW and EOS not in ids[2].tolist()  # cut by the limit: no EOS, every token kept
    texts = greedy_samples[K.RESPONSE_TEXT]
    assert "Paris" in texts[0] and all("<|im_end|>" not in t for t in texts)
    assert greedy_samples[K.ROLLOUT_LOG_PROBS][mask == 0].eq(0).all()


def test_the_reward_lands_on_the_eos_and_nothing_after_it_is_trained(greedy_samples, policy, tok):
    seen = []

    def score(solution_str, ground_truth):
        seen.append(solution_str)
        return 1.0 + len(solution_str) / 100

    batch = FunctionReward(score)(greedy_samples.clone())
    mask = batch[K.RESPONSE_MASK]
    lengths = mask.sum(-1)
    assert sorted(seen) == sorted(batch[K.RESPONSE_TEXT]) and all("<|im_end|>" not in s for s in seen)
    rewarded = batch[K.TOKEN_REWARDS].ne(0).float().argmax(-1)
    assert rewarded.tolist() == (lengths - 1).tolist()  # the EOS (or the last token when cut), not the last "2"

    batch = policy(batch)  # old_log_probs on the same tokens
    log_probs = batch[K.OLD_LOG_PROBS].clone().requires_grad_()
    batch[K.LOG_PROBS] = log_probs
    batch[K.ADVANTAGES] = torch.ones_like(log_probs)  # unmasked on purpose: the loss must apply the mask itself
    PPOLoss()(batch).loss.backward()
    trained = log_probs.grad.ne(0)
    assert torch.equal(trained, mask.bool())  # every token up to and including the EOS, none after
    for row in range(2):
        assert trained[row, lengths[row] - 1] and batch[K.RESPONSE_IDS][row, lengths[row] - 1] == EOS
    # the policy scores the EOS like any token: a real, confident log-prob where the model stopped
    eos_log_probs = batch[K.OLD_LOG_PROBS][torch.arange(2), lengths[:2] - 1]
    assert (eos_log_probs > -2).all(), eos_log_probs
