"""Left padding with a real BPE tokenizer: a prompt in a batch of longer and shorter ones gets what it gets alone.

The prompts differ in length by tens of tokens, and SmolLM2's pad id (2) is also a real token of every prompt
(``<|im_end|>``), so a position or attention mask derived from the ids would shift or hide real tokens. Greedy
responses must match token for token, and the sampler's and the policy's log-probs (padded and packed) to 1e-4
(measured: at most 1e-5 with padding vs alone; float32 on CPU, batched matrix products only reorder sums).
"""

from __future__ import annotations

import pytest
import torch

from rlflow import HFRollout, Policy
from rlflow.data import keys as K
from tests.real_model.helpers import chat_batch

QUESTIONS = ("Hi!", "What is 2+2? Reply with only the number.",
             ("Here is a longer question, so that the other prompts of the batch need many padding tokens on their "
              "left: what is the capital of France? Answer in one word."))
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def rollout(policy, tok):
    r = HFRollout(n=1, do_sample=False, max_new_tokens=12)
    r.bind(policy.model, tok)
    return r


def test_a_prompt_in_a_padded_batch_gets_what_it_gets_alone(rollout, policy, tok):
    batch = chat_batch(tok, QUESTIONS)
    lengths = batch[K.PROMPT_MASK].sum(-1)
    assert lengths.max() - lengths.min() > 20  # real padding: tens of columns
    together = policy(rollout(batch))
    packed = Policy(policy.model, tok, remove_padding=True)(together.clone())  # padding-free scoring of the same rows
    for row, question in enumerate(QUESTIONS):
        alone = policy(rollout(chat_batch(tok, [question])))
        assert alone[K.PROMPT_MASK].all()  # no padding at all
        mask = together[K.RESPONSE_MASK][row].bool()
        n = int(mask.sum())
        assert alone[K.RESPONSE_MASK][0].sum() == n
        assert together[K.RESPONSE_IDS][row, :n].tolist() == alone[K.RESPONSE_IDS][0, :n].tolist(), question
        for key in (K.ROLLOUT_LOG_PROBS, K.OLD_LOG_PROBS):
            torch.testing.assert_close(together[key][row, :n], alone[key][0, :n], atol=TOLERANCE, rtol=0,
                                       msg=f"{key}, {question!r}")
        torch.testing.assert_close(packed[K.OLD_LOG_PROBS][row, :n], alone[K.OLD_LOG_PROBS][0, :n], atol=TOLERANCE,
                                   rtol=0, msg=f"remove_padding, {question!r}")
    assert together[K.RESPONSE_TEXT][1].strip().endswith("4")
