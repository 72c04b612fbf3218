"""Self-play: WithReferenceResponses' layout, SPIN and SPPO by hand, against loops, and under micro-batching."""

import math

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from rlflow.algorithms import Aggregation, GroupWinRate, NoAdvantage, SPINLoss, SPPOLoss, UpdateReference
from rlflow.algorithms import policy_functional as PF
from rlflow.data import keys as K
from rlflow.module import BatchModule
from rlflow.rollout import WithReferenceResponses

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum")


class SampleRollout(BatchModule):
    """n samples per prompt without a model: sample j of prompt i is the tokens of str(10 * i + j) + EOS."""

    in_keys = (K.PROMPT_IDS, K.PROMPT_MASK)
    out_keys = (K.RESPONSE_IDS, K.RESPONSE_MASK, K.ROLLOUT_LOG_PROBS, K.GROUP, K.RESPONSE_TEXT)
    temperature = 1.0

    def __init__(self, n, tokenizer):
        self.n, self.tokenizer = n, tokenizer

    def forward(self, batch):
        p = batch.batch_size[0]
        out = batch.repeat_interleave(self.n, dim=0)
        texts = [str(10 * i + j) for i in range(p) for j in range(self.n)]
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id] for t in texts]
        width = max(map(len, ids))
        out[K.RESPONSE_IDS] = torch.tensor([x + [self.tokenizer.pad_token_id] * (width - len(x)) for x in ids])
        out[K.RESPONSE_MASK] = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
        out[K.ROLLOUT_LOG_PROBS] = -torch.rand(p * self.n, width) * out[K.RESPONSE_MASK]
        out[K.GROUP] = torch.arange(p).repeat_interleave(self.n)
        out[K.RESPONSE_TEXT] = NonTensorStack(*texts)
        return out

    def with_options(self, **kw):
        return ("plain", kw)


def prompts(tokenizer, truths):
    p = len(truths)
    return TensorDict({
        K.PROMPT_IDS: torch.full((p, 3), 5), K.PROMPT_MASK: torch.ones(p, 3, dtype=torch.long),
        K.PROMPT_TEXT: NonTensorStack(*["1+1="] * p), K.GROUND_TRUTH: NonTensorStack(*truths),
        K.DATA_SOURCE: NonTensorStack(*["t"] * p), K.EXTRA_INFO: NonTensorStack(*[None] * p),
    }, batch_size=[p])


def test_with_reference_responses_layout(tokenizer):
    wrapped = WithReferenceResponses(SampleRollout(2, tokenizer))
    out = wrapped(prompts(tokenizer, ["12345", "7"]))
    # per prompt: its 2 samples, then its reference row; B = 2 x (2 + 1)
    assert out.batch_size[0] == 6
    assert out[K.IS_REFERENCE].tolist() == [False, False, True, False, False, True]
    assert out[K.GROUP].tolist() == [0, 0, 0, 1, 1, 1]
    assert list(out[K.RESPONSE_TEXT]) == ["0", "1", "12345", "10", "11", "7"]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ref = tokenizer("12345", add_special_tokens=False)["input_ids"] + [eos]
    assert out[K.RESPONSE_IDS][2].tolist() == ref and out[K.RESPONSE_MASK][2].tolist() == [1] * 6
    # the samples are right-padded to the reference's width; the short reference too
    assert out[K.RESPONSE_IDS][0].tolist()[2:] == [pad] * 4 and out[K.RESPONSE_MASK][0].tolist() == [1, 1, 0, 0, 0, 0]
    assert out[K.RESPONSE_MASK][5].tolist() == [1, 1, 0, 0, 0, 0]
    assert out[K.ROLLOUT_LOG_PROBS][2].abs().sum() == 0  # not sampled
    assert list(out[K.GROUND_TRUTH]) == ["12345"] * 3 + ["7"] * 3
    assert K.IS_REFERENCE in wrapped.out_keys and K.GROUND_TRUTH in wrapped.in_keys
    assert wrapped.with_options(n=1) == ("plain", {"n": 1})  # validation samples without reference rows
    with pytest.raises(ValueError, match="ground_truth"):
        wrapped(prompts(tokenizer, ["1", None]))


def test_reference_text_can_be_overridden(tokenizer):
    class Doubled(WithReferenceResponses):
        def reference_text(self, ground_truth, extra_info):
            return ground_truth * 2

    out = Doubled(SampleRollout(1, tokenizer))(prompts(tokenizer, ["3"]))
    assert list(out[K.RESPONSE_TEXT]) == ["0", "33"]


# ---------------------------------------------------------------- SPIN


def spin_example():
    # group 0: rows (real, gen, gen) with D = log pi/pi_ref = [1.0, 0.5, -1.0]; group 1: (gen, real) with D = [0, 0]
    # each D is spread over the row's valid tokens (the last column is padding with a large value)
    d = torch.tensor([1.0, 0.5, -1.0, 0.0, 0.0])
    ref = -torch.rand(5, 3, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0], [1, 1, 0], [1, 0, 0]])
    logp = ref + d[:, None] * mask / mask.sum(-1, keepdim=True) + 50 * (1 - mask)
    group = torch.tensor([0, 0, 0, 1, 1])
    is_ref = torch.tensor([True, False, False, False, True])
    return logp.requires_grad_(True), ref, mask, group, is_ref


def test_spin_by_hand():
    logp, ref, mask, group, is_ref = spin_example()
    loss, stats = PF.spin_loss(logp, ref, mask, group, is_ref, beta=0.5)
    # group 0: l = log(1 + e^-(0.5 * 0.5)) = 0.575939, log(1 + e^-(0.5 * 2)) = 0.313262 -> c0 = 0.444601
    # group 1: l = log 2 -> c1 = 0.693147; rows carry their group's loss: (3 c0 + 2 c1) / 5 rows
    assert loss.item() == pytest.approx(0.5440192, rel=1e-6)
    assert stats["spin_margin"].item() == pytest.approx((0.5 + 2.0 + 0.0) / 3, rel=1e-6)
    assert stats["spin_accuracy"].item() == pytest.approx(2 / 3)
    # D is a sum over tokens, so each valid token of a row gets dL/dD of its row:
    # dL/dD_real(group 0) = 3/5 * 1/2 * -0.5 (sigmoid(-0.25) + sigmoid(-1)) = -0.1060147
    grad = torch.autograd.grad(loss, logp)[0]
    assert grad[0, 0].item() == pytest.approx(-0.1060147, rel=1e-5) and grad[0, 1] == grad[0, 0]
    assert grad[:, 2].abs().sum() == 0 and grad[3, 0] == -grad[4, 0]  # padding; real and generated pull apart
    assert grad[3, 0].item() == pytest.approx(2 / 5 * 0.5 * 0.5, rel=1e-5)  # group 1's generated row: +beta sigma(0)


def loop_spin(logp, ref, mask, group, is_ref, beta):
    d = [sum(logp[i, t].item() - ref[i, t].item() for t in range(mask.shape[1]) if mask[i, t])
         for i in range(len(group))]
    groups = {}
    for i, g in enumerate(group.tolist()):
        groups.setdefault(g, []).append(i)
    total, rows = 0.0, 0
    for members in groups.values():
        real = [i for i in members if is_ref[i]][0]
        pairs = [math.log1p(math.exp(-beta * (d[real] - d[j]))) for j in members if not is_ref[j]]
        total += len(members) * sum(pairs) / len(pairs)
        rows += len(members)
    return total / rows


def spin_batch(seed, groups=4, n=3, r=5):
    gen = torch.Generator().manual_seed(seed)
    b = groups * (n + 1)
    mask = (torch.arange(r)[None] < torch.randint(1, r + 1, (b,), generator=gen)[:, None]).long()
    is_ref = torch.zeros(b, dtype=torch.bool)
    is_ref[n::n + 1] = True
    return TensorDict({
        "x": torch.randn(b, r, generator=gen, dtype=torch.float64),
        K.OLD_LOG_PROBS: -torch.rand(b, r, generator=gen, dtype=torch.float64) * 2,
        K.REF_LOG_PROBS: -torch.rand(b, r, generator=gen, dtype=torch.float64) * 2,
        K.RESPONSE_MASK: mask, K.GROUP: torch.arange(groups).repeat_interleave(n + 1) + 10, K.IS_REFERENCE: is_ref,
        K.TOKEN_REWARDS: (torch.rand(b, r, generator=gen) < 0.2).double() * mask,
    }, batch_size=[b])


def with_policy(batch, theta):
    out = batch.clone(False)
    out[K.LOG_PROBS] = batch[K.OLD_LOG_PROBS] + torch.tanh(batch["x"] * theta)
    return out


def test_spin_matches_loop():
    for seed in range(3):
        batch = with_policy(spin_batch(seed), torch.ones(5, dtype=torch.float64))
        keys = (K.LOG_PROBS, K.REF_LOG_PROBS, K.RESPONSE_MASK, K.GROUP, K.IS_REFERENCE)
        args = tuple(batch[k] for k in keys)
        assert PF.spin_loss(*args, beta=0.3)[0].item() == pytest.approx(loop_spin(*args, 0.3), rel=1e-7)


def test_spin_needs_whole_groups():
    logp, ref, mask, group, is_ref = spin_example()
    # rows 2..3 cut both groups: group 0 without its reference row (the error names the first such group)
    with pytest.raises(ValueError, match="group 0 has 0 reference and 1 generated.*multiple of n \\+ 1"):
        PF.spin_loss(logp[2:4], ref[2:4], mask[2:4], group[2:4], is_ref[2:4])
    with pytest.raises(ValueError, match="group 1 has 1 reference and 0 generated"):
        PF.spin_loss(logp[4:], ref[4:], mask[4:], group[4:], is_ref[4:])
    assert len({g for g in group.tolist()}) == 2


@pytest.mark.parametrize("mode", MODES)
def test_spin_micro_batches_of_whole_groups(mode):
    batch = spin_batch(7)
    theta = torch.randn(5, dtype=torch.float64, requires_grad=True)
    loss_fn = SPINLoss(beta=0.2, agg=mode)
    mask = batch[K.RESPONSE_MASK]
    counts = Aggregation(num_tokens=mask.sum(), num_seqs=(mask.sum(-1) > 0).sum())
    full = loss_fn(with_policy(batch, theta))
    (g_full,) = torch.autograd.grad(full.loss, theta)
    for split in ([4, 8, 4], [4] * 4):  # whole groups of n + 1 = 4 rows
        total, g_sum = 0.0, torch.zeros_like(theta)
        for idx in torch.arange(16).split(split):
            part = loss_fn(with_policy(batch[idx], theta), counts)
            g_sum += torch.autograd.grad(part.loss, theta)[0]
            total += part.loss.item()
        assert total == pytest.approx(full.loss.item(), rel=1e-9)
        torch.testing.assert_close(g_sum, g_full)
    assert g_full.abs().sum() > 0
    with pytest.raises(ValueError, match="whole groups"):
        loss_fn(with_policy(batch[:6], theta), counts)


def test_spin_loss_module():
    loss = SPINLoss(beta=0.1)
    assert {K.REF_LOG_PROBS, K.GROUP, K.IS_REFERENCE} <= set(loss.in_keys)  # the Trainer builds the reference
    batch = with_policy(spin_batch(1), torch.ones(5, dtype=torch.float64))
    batch[K.ADVANTAGES] = torch.zeros_like(batch[K.LOG_PROBS])
    out = loss(batch)
    assert out.stats["actor/pg_loss"] == pytest.approx(out.loss.item())
    assert {"actor/spin_margin", "actor/spin_accuracy"} <= set(out.stats)
    with pytest.raises(ValueError, match="beta"):
        SPINLoss(beta=0)


def test_spin_loss_scale_factor():
    # spin_example with beta 0.5: c0 = 0.444601 on the 2 + 2 + 1 valid tokens of group 0, c1 = log 2 on the 2 + 1 of
    # group 1; seq-mean-token-sum-norm divides the token sum by the 5 sequences and by loss_scale_factor (default:
    # the padded length R = 3), as verl 0.9.1
    logp, ref, mask, group, is_ref = spin_example()
    batch = TensorDict({K.LOG_PROBS: logp, K.REF_LOG_PROBS: ref, K.RESPONSE_MASK: mask, K.GROUP: group,
                        K.IS_REFERENCE: is_ref}, batch_size=[5])
    token_sum = 5 * 0.44460055 + 3 * math.log(2)
    out = SPINLoss(beta=0.5, agg="seq-mean-token-sum-norm", loss_scale_factor=4.0)(batch)
    assert out.loss.item() == pytest.approx(token_sum / 5 / 4, rel=1e-6)
    default = SPINLoss(beta=0.5, agg="seq-mean-token-sum-norm")(batch)
    assert default.loss.item() == pytest.approx(token_sum / 5 / 3, rel=1e-6)


def test_self_play_losses_refuse_is_weights():
    for loss_cls in (SPINLoss, SPPOLoss):
        with pytest.raises(ValueError, match=f"{loss_cls.__name__} does not support is_weights=True"):
            loss_cls(is_weights=True)
        assert K.IS_WEIGHTS not in loss_cls(is_weights=False).in_keys


def test_no_advantage():
    batch = spin_batch(0)
    out = NoAdvantage()(batch)
    assert out[K.ADVANTAGES].abs().sum() == 0 and out[K.ADVANTAGES].shape == batch[K.RESPONSE_MASK].shape
    assert NoAdvantage.in_keys == (K.RESPONSE_MASK,)


# ---------------------------------------------------------------- SPPO


def test_group_win_rate_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.3, 0.9])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    # group 0, row 0: vs (1, 0, 0, 1) -> (1/2 + 1 + 1 + 1/2) / 4 = 3/4; row 1: (0 + 1/2 + 1/2 + 0) / 4 = 1/4
    # group 1: a tie -> 1/2; group 2: alone -> 1/2 (itself)
    torch.testing.assert_close(PF.group_win_rate(scores, group), torch.tensor([0.75, 0.25, 0.25, 0.75, 0.5, 0.5, 0.5]))
    scores = torch.tensor([3.0, 1.0, 2.0])
    torch.testing.assert_close(PF.group_win_rate(scores, torch.zeros(3)), torch.tensor([5 / 6, 1 / 6, 1 / 2]))


def test_group_win_rate_estimator():
    batch = spin_batch(3)
    out = GroupWinRate()(batch.clone())
    mask = batch[K.RESPONSE_MASK]
    expected = PF.group_win_rate(batch[K.TOKEN_REWARDS].sum(-1), batch[K.GROUP]) - 0.5
    torch.testing.assert_close(out[K.ADVANTAGES], expected[:, None] * mask)

    class Soft(GroupWinRate):
        def win_rate(self, scores, group):
            return torch.full_like(scores, 0.9)

    assert Soft()(batch.clone())[K.ADVANTAGES].max().item() == pytest.approx(0.4)


def test_sppo_by_hand():
    # D = [0.5, 0, -1, 1], win rates - 1/2 = [0.25, -0.25, -0.25, 0.25], eta = 2 -> targets [0.5, -0.5, -0.5, 0.5]
    # squared errors [0, 0.25, 0.25, 0.25] -> mean over rows 0.1875
    d = torch.tensor([0.5, 0.0, -1.0, 1.0])
    ref = torch.zeros(4, 2)
    logp = (ref + d[:, None] / 2).requires_grad_(True)
    loss, stats = PF.sppo_loss(logp, ref, torch.ones(4, 2), torch.tensor([0.25, -0.25, -0.25, 0.25]), eta=2.0)
    assert loss.item() == pytest.approx(0.1875)
    assert stats["sppo_log_ratio"].item() == pytest.approx(0.125)
    # dL/dlogp_t = 2 (D - target) / 4 rows, on each token of the row
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.tensor([[0.0] * 2, [0.25] * 2, [-0.25] * 2,
                                                                                  [0.25] * 2]))


def test_sppo_loss_scale_factor():
    # test_sppo_by_hand's rows: squared errors [0, 0.25, 0.25, 0.25], each on 2 tokens -> token sum 1.5;
    # seq-mean-token-sum-norm divides it by the 4 sequences and by loss_scale_factor (default: the padded length R = 2)
    ref, mask = torch.zeros(4, 2), torch.ones(4, 2)
    target = torch.tensor([0.25, -0.25, -0.25, 0.25])
    batch = TensorDict({K.LOG_PROBS: ref + torch.tensor([0.5, 0.0, -1.0, 1.0])[:, None] / 2, K.REF_LOG_PROBS: ref,
                        K.RESPONSE_MASK: mask, K.ADVANTAGES: target[:, None] * mask}, batch_size=[4])
    out = SPPOLoss(eta=2.0, agg="seq-mean-token-sum-norm", loss_scale_factor=6.0)(batch)
    assert out.loss.item() == pytest.approx(1.5 / 4 / 6)
    assert SPPOLoss(eta=2.0, agg="seq-mean-token-sum-norm")(batch).loss.item() == pytest.approx(1.5 / 4 / 2)


def test_sppo_matches_loop():
    batch = with_policy(spin_batch(5), torch.ones(5, dtype=torch.float64))
    mask = batch[K.RESPONSE_MASK]
    scores = batch[K.TOKEN_REWARDS].sum(-1).tolist()
    groups = batch[K.GROUP].tolist()
    total = 0.0
    for i in range(len(groups)):
        mates = [k for k in range(len(groups)) if groups[k] == groups[i]]
        p = sum(1.0 if scores[i] > scores[k] else 0.5 if scores[i] == scores[k] else 0.0 for k in mates) / len(mates)
        d = sum(batch[K.LOG_PROBS][i, t].item() - batch[K.REF_LOG_PROBS][i, t].item()
                for t in range(mask.shape[1]) if mask[i, t])
        total += (d - 3.0 * (p - 0.5)) ** 2
    out = SPPOLoss(eta=3.0)(GroupWinRate()(batch))
    assert out.loss.item() == pytest.approx(total / len(groups), rel=1e-9)
    assert K.REF_LOG_PROBS in SPPOLoss().in_keys


@pytest.mark.parametrize("mode", MODES)
def test_sppo_micro_batches_any_split(mode):
    batch = GroupWinRate()(spin_batch(9))  # the win rate needs whole groups: computed before the split
    theta = torch.randn(5, dtype=torch.float64, requires_grad=True)
    loss_fn = SPPOLoss(eta=2.0, agg=mode)
    mask = batch[K.RESPONSE_MASK]
    counts = Aggregation(num_tokens=mask.sum(), num_seqs=(mask.sum(-1) > 0).sum())
    full = loss_fn(with_policy(batch, theta))
    (g_full,) = torch.autograd.grad(full.loss, theta)
    for split in ([3, 1, 5, 7], [1] * 16):
        total, g_sum = 0.0, torch.zeros_like(theta)
        for idx in torch.arange(16).split(split):
            part = loss_fn(with_policy(batch[idx], theta), counts)
            g_sum += torch.autograd.grad(part.loss, theta)[0]
            total += part.loss.item()
        assert total == pytest.approx(full.loss.item(), rel=1e-9)
        torch.testing.assert_close(g_sum, g_full)
    assert g_full.abs().sum() > 0


def test_update_reference_copies_policy_weights():
    class Holder:
        def __init__(self, value):
            self.model = torch.nn.Linear(2, 2)
            torch.nn.init.constant_(self.model.weight, value)

    class FakeTrainer:
        policy, reference = Holder(1.0), Holder(0.0)

    cb, trainer = UpdateReference(every=3), FakeTrainer()
    cb.on_step_end(trainer, step=2, metrics={})
    assert trainer.reference.model.weight.sum() == 0
    cb.on_step_end(trainer, step=3, metrics={})
    torch.testing.assert_close(trainer.reference.model.weight, trainer.policy.model.weight)
    assert trainer.reference.model.weight is not trainer.policy.model.weight
    with pytest.raises(ValueError, match="every"):
        UpdateReference(0)
