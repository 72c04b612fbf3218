import copy

import pytest
import torch
from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.models.critic import Critic
from rlflow.models.logprobs import TokenLogProbs, response_hidden_states
from rlflow.models.packing import pack, response_lengths
from rlflow.models.policy import Policy


def ragged_batch(vocab, seed=0):
    """Rows of very different lengths: prompts 1..7 real tokens (left-padded), responses 1..20 (right-padded),
    one with a tool span (mask 0) in the middle and one with an empty response."""
    g = torch.Generator().manual_seed(seed)
    p_lens, r_lens = [7, 1, 3, 5, 2], [20, 1, 9, 0, 14]
    B, P, R = len(p_lens), max(p_lens), max(r_lens)
    prompt_ids = torch.zeros(B, P, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    response_ids = torch.zeros(B, R, dtype=torch.long)
    response_mask = torch.zeros(B, R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(p_lens, r_lens)):
        prompt_ids[i, P - p :] = torch.randint(3, vocab, (p,), generator=g)
        prompt_mask[i, P - p :] = 1
        response_ids[i, :r] = torch.randint(3, vocab, (r,), generator=g)
        response_mask[i, :r] = 1
    response_mask[0, 4:8] = 0  # tool/observation tokens: context, not trained on
    return prompt_ids, prompt_mask, response_ids, response_mask


def kept(response_mask):
    """Positions up to each response's last valid token (tool tokens included)."""
    return torch.arange(response_mask.shape[1])[None] < response_lengths(response_mask)[:, None]


def test_response_lengths_keep_tool_spans():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    assert response_lengths(mask).tolist() == [5, 0, 7]


def test_pack_layout(tokenizer):
    prompt_ids, prompt_mask, response_ids, response_mask = ragged_batch(len(tokenizer))
    packed = pack(prompt_ids, prompt_mask, response_ids, response_mask)
    # fed tokens: prompt + response[: len - 1] (tool span kept)
    fed = [7 + 19, 1 + 0, 3 + 8, 5 + 0, 2 + 13]
    L = max(fed)
    assert packed.input_ids.shape[1] == L and packed.input_ids.numel() < prompt_ids.numel() + response_ids.numel()
    assert (packed.input_ids != 0).sum() == sum(fed)
    assert packed.src.numel() == 20 + 1 + 9 + 0 + 14
    # positions restart at 0 per sequence: as many restarts as sequences (+ tails of pad tokens)
    restarts = (packed.position_ids == 0).sum().item()
    assert restarts >= len([f for f in fed if f > 0])
    # a long pack_length puts everything in one row
    one = pack(prompt_ids, prompt_mask, response_ids, response_mask, pack_length=1000)
    assert one.input_ids.shape == (1, 1000)


@pytest.mark.parametrize("pack_length", [None, 1000])
def test_packed_log_probs_equal_padded(model, tokenizer, pack_length):
    prompt_ids, prompt_mask, response_ids, response_mask = ragged_batch(len(tokenizer))
    keep = kept(response_mask)
    ref_lp, ref_ent = TokenLogProbs(model, temperature=0.7)(prompt_ids, prompt_mask, response_ids)
    packed = TokenLogProbs(model, temperature=0.7, chunk_tokens=8, remove_padding=True, pack_length=pack_length)
    lp, ent = packed(prompt_ids, prompt_mask, response_ids, response_mask)
    torch.testing.assert_close(lp[keep], ref_lp[keep], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent[keep], ref_ent[keep], atol=1e-5, rtol=1e-5)
    assert (lp[~keep] == 0).all() and (ent[~keep] == 0).all()


def test_packed_hidden_states_equal_padded(model, tokenizer):
    prompt_ids, prompt_mask, response_ids, response_mask = ragged_batch(len(tokenizer))
    keep = kept(response_mask)
    ref = response_hidden_states(model, prompt_ids, prompt_mask, response_ids)
    got = response_hidden_states(model, prompt_ids, prompt_mask, response_ids, response_mask, remove_padding=True)
    torch.testing.assert_close(got[keep], ref[keep], atol=1e-5, rtol=1e-5)


def test_packed_gradients_equal_padded(model, tokenizer):
    prompt_ids, prompt_mask, response_ids, response_mask = ragged_batch(len(tokenizer))
    w = response_mask.float()  # a loss that, like the real ones, reads only masked-in tokens
    grads = []
    for remove_padding in (False, True):
        m = copy.deepcopy(model)
        lp, ent = TokenLogProbs(m, chunk_tokens=16, remove_padding=remove_padding)(
            prompt_ids, prompt_mask, response_ids, response_mask)
        ((lp * w).sum() + 0.1 * (ent * w).sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


def test_policy_and_critic_remove_padding(model, tokenizer):
    prompt_ids, prompt_mask, response_ids, response_mask = ragged_batch(len(tokenizer))
    batch = TensorDict({K.PROMPT_IDS: prompt_ids, K.PROMPT_MASK: prompt_mask, K.RESPONSE_IDS: response_ids,
                        K.RESPONSE_MASK: response_mask}, batch_size=[5])
    keep = kept(response_mask)
    plain = Policy(model, tokenizer)(batch.clone())
    packed = Policy(model, tokenizer, remove_padding=True, micro_batch_size=2)(batch.clone())
    torch.testing.assert_close(packed[K.OLD_LOG_PROBS][keep], plain[K.OLD_LOG_PROBS][keep], atol=1e-5, rtol=1e-5)
    ref = Policy(model, tokenizer, remove_padding=True).reference()
    assert ref.remove_padding and ref.module.remove_padding

    critic = Critic(copy.deepcopy(model))
    torch.nn.init.normal_(critic.module.value_head.weight, generator=torch.Generator().manual_seed(0))
    packed_critic = Critic(copy.deepcopy(model), remove_padding=True)
    packed_critic.module.value_head.load_state_dict(critic.module.value_head.state_dict())
    v_plain = critic(batch.clone())[K.VALUES]
    v_packed = packed_critic(batch.clone())[K.VALUES]
    torch.testing.assert_close(v_packed, v_plain, atol=1e-5, rtol=1e-5)
    assert v_plain.abs().sum() > 0
    # under autograd too
    (critic.values(batch) * response_mask).sum().backward()
    (packed_critic.values(batch) * response_mask).sum().backward()
    for a, b in zip(critic.module.parameters(), packed_critic.module.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4)
