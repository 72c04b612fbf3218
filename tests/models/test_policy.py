import copy

import pytest
import torch
from tensordict import TensorDict

from rlflow.models.checks import activation_checkpointing
from rlflow.data import keys as K
from rlflow.models.critic import Critic
from rlflow.models.logprobs import TokenLogProbs, position_ids_from_mask
from rlflow.models.policy import Policy


def batch_of(prompt_ids, prompt_mask, response_ids):
    return TensorDict({K.PROMPT_IDS: prompt_ids, K.PROMPT_MASK: prompt_mask, K.RESPONSE_IDS: response_ids},
                      batch_size=[prompt_ids.shape[0]])


def naive_log_probs(model, prompt_ids, prompt_mask, response_ids, temperature):
    """Straightforward reference: full logits, float32, one row at a time without any padding."""
    lps, ents = [], []
    for i in range(prompt_ids.shape[0]):
        p = prompt_ids[i][prompt_mask[i].bool()]
        ids = torch.cat([p, response_ids[i]])[None]
        logits = model(input_ids=ids).logits[0, len(p) - 1 : -1].float() / temperature
        logp = torch.log_softmax(logits, -1)
        lps.append(logp.gather(-1, response_ids[i][:, None]).squeeze(-1))
        ents.append(-(logp.exp() * logp).sum(-1))
    return torch.stack(lps), torch.stack(ents)


@pytest.fixture
def scored_batch(tokenizer):
    enc = tokenizer(["12+34=", "5+6=", "99+99="], padding=True, return_tensors="pt")
    response = torch.randint(3, len(tokenizer), (3, 5), generator=torch.Generator().manual_seed(0))
    return enc["input_ids"], enc["attention_mask"], response


def test_position_ids_skip_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 4, 4096])
def test_log_probs_and_entropy_match_full_logits(model, scored_batch, temperature, chunk):
    prompt_ids, prompt_mask, response = scored_batch
    expected_lp, expected_ent = naive_log_probs(model, prompt_ids, prompt_mask, response, temperature)
    lp, ent = TokenLogProbs(model, temperature=temperature, chunk_tokens=chunk)(prompt_ids, prompt_mask, response)
    torch.testing.assert_close(lp, expected_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, expected_ent, atol=1e-5, rtol=1e-5)


def test_chunked_gradients_equal_unchunked(model, scored_batch):
    prompt_ids, prompt_mask, response = scored_batch
    grads = []
    for chunk in (2, 4096):
        m = copy.deepcopy(model)
        lp, ent = TokenLogProbs(m, chunk_tokens=chunk)(prompt_ids, prompt_mask, response)
        (lp.sum() + 0.1 * ent.sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


def test_policy_writes_old_log_probs_in_micro_batches(model, tokenizer, scored_batch):
    batch = batch_of(*scored_batch)
    whole = Policy(model, tokenizer)(batch.clone())
    split = Policy(model, tokenizer, micro_batch_size=1)(batch.clone())
    assert set(whole.keys()) >= {K.OLD_LOG_PROBS, K.ENTROPY}
    assert not whole[K.OLD_LOG_PROBS].requires_grad
    torch.testing.assert_close(whole[K.OLD_LOG_PROBS], split[K.OLD_LOG_PROBS], atol=1e-6, rtol=1e-6)


def test_reference_is_a_frozen_copy(model, tokenizer, scored_batch):
    policy = Policy(model, tokenizer)
    ref = policy.reference()
    assert ref.out_keys == (K.REF_LOG_PROBS,)
    assert all(not p.requires_grad for p in ref.model.parameters())
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # training the policy must not move the reference
    assert not torch.equal(next(ref.model.parameters()), next(model.parameters()))


def test_policy_from_pretrained_local_folder(model, tokenizer, tmp_path, scored_batch):
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = Policy.from_pretrained(tmp_path)
    assert loaded.tokenizer.padding_side == "left"
    out = loaded(batch_of(*scored_batch))
    expected = Policy(model, tokenizer)(batch_of(*scored_batch))
    torch.testing.assert_close(out[K.OLD_LOG_PROBS], expected[K.OLD_LOG_PROBS])


def test_critic_starts_at_zero_and_reads_the_predicting_position(model, scored_batch):
    critic = Critic(copy.deepcopy(model))
    batch = batch_of(*scored_batch)
    batch[K.RESPONSE_MASK] = torch.ones_like(batch[K.RESPONSE_IDS])
    assert torch.count_nonzero(critic(batch)[K.VALUES]) == 0  # zero-initialised head
    torch.nn.init.ones_(critic.module.value_head.weight)
    values = critic.values(batch)
    # The value of response token t depends only on tokens before it: changing the last token leaves it unchanged.
    changed = batch.clone()
    changed[K.RESPONSE_IDS][:, -1] = (changed[K.RESPONSE_IDS][:, -1] + 1) % 40 + 3
    torch.testing.assert_close(critic.values(changed), values)
    assert values.shape == batch[K.RESPONSE_IDS].shape


def test_gradient_checkpointing_gives_the_same_gradients(model, tokenizer, scored_batch):
    grads = []
    for ckpt in (False, True):
        policy = Policy(copy.deepcopy(model), tokenizer, gradient_checkpointing=ckpt)
        policy.model.train()
        lp, _ = policy.log_probs(batch_of(*scored_batch))
        lp.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None]))
    assert activation_checkpointing(policy.model)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)
