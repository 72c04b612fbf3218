import pytest
import torch
from tensordict import TensorDict

from rlflow import PPOLoss
from rlflow.data import keys as K
from rlflow.trainer.batching import micro_batches, plan, row_tokens

from .helpers import make_trainer, params


def ragged(lengths_p, lengths_r, R=None):
    B, P, R = len(lengths_p), max(lengths_p), R or max(lengths_r)
    pm = torch.zeros(B, P, dtype=torch.long)
    rm = torch.zeros(B, R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(lengths_p, lengths_r)):
        pm[i, P - p :] = 1
        rm[i, :r] = 1
    return TensorDict({K.PROMPT_IDS: pm * 5, K.PROMPT_MASK: pm, K.RESPONSE_IDS: rm * 7, K.RESPONSE_MASK: rm,
                       "row": torch.arange(B)}, batch_size=[B])


def test_row_tokens_count_prompt_and_response_up_to_its_end():
    batch = ragged([3, 1], [4, 0], R=6)
    batch[K.RESPONSE_MASK][0, 1:3] = 0  # a tool span inside the response still counts
    assert row_tokens(batch).tolist() == [7, 1]


def test_without_budget_it_is_split():
    batch = ragged([2] * 5, [3] * 5)
    parts = micro_batches(batch, 2, None)
    assert [p["row"].tolist() for p in parts] == [[0, 1], [2, 3], [4]]
    assert [p["row"].tolist() for p in micro_batches(batch, None, None)] == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize("micro", [None, 3])
def test_budget_is_respected_and_every_row_appears_once(micro):
    g = torch.Generator().manual_seed(0)
    p_lens = torch.randint(1, 10, (20,), generator=g).tolist()
    r_lens = torch.randint(0, 60, (20,), generator=g).tolist()
    batch = ragged(p_lens, r_lens)
    tokens = row_tokens(batch)
    budget = 80
    parts = micro_batches(batch, micro, budget)
    rows = sorted(r for p in parts for r in p["row"].tolist())
    assert rows == list(range(20))
    for p in parts:
        assert p["row"].tolist() == sorted(p["row"].tolist())  # original order inside a micro-batch
        assert row_tokens(p).sum() <= budget or p.batch_size[0] == 1
        assert micro is None or p.batch_size[0] <= micro
    assert len(parts) <= 2 * int(tokens.sum()) // budget + 1  # first-fit decreasing is not wasteful


def test_a_row_over_budget_goes_alone():
    parts = plan([100, 5, 5, 5], None, 20)
    assert parts == [[0], [1, 2, 3]]


def test_plan_splits_to_reach_the_count_of_other_ranks():
    lengths = [10, 9, 8, 2, 2, 1]
    base = plan(lengths, None, 40)
    assert len(base) == 1
    for k in (2, 4, 6):
        parts = plan(lengths, None, 40, min_count=k)
        assert len(parts) == k and sorted(i for p in parts for i in p) == list(range(6))
    with pytest.raises(RuntimeError, match="same number of micro-batches"):
        plan(lengths, None, 40, min_count=7)


def test_update_with_token_budget_equals_update_without(model, tokenizer, addition_rows, tmp_path):
    results = []
    for budget in (None, 24):
        trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path / str(budget), ppo=True,
                                     batch_size=6, max_steps=1, max_tokens_per_micro_batch=budget,
                                     loss=PPOLoss(agg="seq-mean-token-mean"))
        seen = []
        if budget:
            import rlflow.trainer.trainer as tr

            original = tr.micro_batches

            def spy(*args, **kwargs):
                parts = original(*args, **kwargs)
                seen.append([int(row_tokens(p).sum()) for p in parts])
                return parts

            tr.micro_batches = spy
        try:
            history = trainer.fit(data)
        finally:
            if budget:
                tr.micro_batches = original
        if budget:
            assert len(seen) == 2 and all(len(s) > 1 for s in seen)  # actor and critic were split
            assert all(t <= budget for s in seen for t in s)
        results.append((params(trainer.policy.model), params(trainer.critic.module), history[0]))
    for a, b in zip(results[0][0] + results[0][1], results[1][0] + results[1][1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert results[0][2]["actor/pg_loss"] == pytest.approx(results[1][2]["actor/pg_loss"], abs=1e-6)


def scored_batch(vocab: int, seed: int = 0, rows: int = 10):
    """Ragged rows with real token ids: prompts of 1-6 tokens, responses of 1-8 (right-padded with id 0)."""
    g = torch.Generator().manual_seed(seed)
    batch = ragged(torch.randint(1, 7, (rows,), generator=g).tolist(),
                   torch.randint(1, 9, (rows,), generator=g).tolist())
    batch[K.PROMPT_IDS] = torch.randint(3, vocab, batch[K.PROMPT_IDS].shape, generator=g) * batch[K.PROMPT_MASK]
    batch[K.RESPONSE_IDS] = torch.randint(3, vocab, batch[K.RESPONSE_IDS].shape, generator=g) * batch[K.RESPONSE_MASK]
    return batch


def count_passes(role):
    """Each forward of ``role.module`` (the real model under the role) with the rows and tokens it was given."""
    calls = []

    def hook(module, args):
        prompt_ids, prompt_mask, response_ids = args[:3]
        piece = TensorDict({K.PROMPT_MASK: prompt_mask, K.RESPONSE_MASK: (response_ids != 0).long()},
                           batch_size=[prompt_ids.shape[0]])
        calls.append((prompt_ids.shape[0], int(row_tokens(piece).sum())))

    return calls, role.module.register_forward_pre_hook(hook)


@pytest.mark.parametrize("remove_padding", [False, True])
def test_scoring_passes_split_by_token_budget_with_the_same_results(model, tokenizer, remove_padding):
    from rlflow import Critic, Policy

    batch = scored_batch(len(tokenizer))
    budget = 20
    assert int(row_tokens(batch).max()) <= budget < int(row_tokens(batch).sum())
    policy = Policy(model, tokenizer, micro_batch_size=3, remove_padding=remove_padding)
    fixed = policy(batch.clone())
    policy.max_tokens_per_micro_batch, policy.micro_batch_size = budget, None
    calls, handle = count_passes(policy)
    dynamic = policy(batch.clone())
    handle.remove()
    assert 1 < len(calls) < batch.batch_size[0] and sum(rows for rows, _ in calls) == batch.batch_size[0]
    assert all(tokens <= budget for _, tokens in calls)
    mask = batch[K.RESPONSE_MASK].bool()
    for key in (K.OLD_LOG_PROBS, K.ENTROPY):  # in the batch's row order
        torch.testing.assert_close(dynamic[key][mask], fixed[key][mask], atol=1e-5, rtol=1e-5)

    ref = policy.reference()  # the reference keeps the budget, or takes its own
    assert ref.max_tokens_per_micro_batch == budget and policy.reference(max_tokens_per_micro_batch=9) \
        .max_tokens_per_micro_batch == 9
    calls, handle = count_passes(ref)
    ref(batch.clone())
    handle.remove()
    assert len(calls) > 1 and all(tokens <= budget for _, tokens in calls)

    critic = Critic(model, micro_batch_size=3, remove_padding=remove_padding)
    torch.nn.init.normal_(critic.module.value_head.weight, generator=torch.Generator().manual_seed(1))
    fixed = critic(batch.clone())[K.VALUES]
    critic.max_tokens_per_micro_batch, critic.micro_batch_size = budget, None
    calls, handle = count_passes(critic)
    values = critic(batch.clone())[K.VALUES]
    handle.remove()
    assert len(calls) > 1 and all(tokens <= budget for _, tokens in calls)
    assert fixed.abs().sum() > 0
    torch.testing.assert_close(values, fixed, atol=1e-5, rtol=1e-5)


def test_scoring_pieces_restore_the_row_order():
    from rlflow.trainer.batching import scoring_pieces

    batch = ragged([5, 1, 4, 1, 3], [5, 1, 4, 1, 3])
    pieces, restore = scoring_pieces(batch, None, 10)
    assert len(pieces) > 1 and restore is not None
    assert torch.cat([p["row"] for p in pieces])[restore].tolist() == list(range(5))
    pieces, restore = scoring_pieces(batch, 2, None)
    assert restore is None and [p["row"].tolist() for p in pieces] == [[0, 1], [2, 3], [4]]
