"""verl's learning-rate schedules (cosine with warm-up, floor and cycles) and its shuffled mini-batches.

The expected values are verl 0.9.1's code written out here (``verl/utils/torch_functional.py``,
``verl/utils/tensordict_utils.py::make_iterator``), not rlflow's.
"""

import math

import pytest
import torch
from torch.utils.data import DataLoader

from rlflow import GRPO, PPOLoss
from rlflow.data import keys as K
from rlflow.trainer.batching import shuffled_mini_batches
from rlflow.trainer.schedule import Schedule, lr_lambda
from tests.trainer.helpers import make_trainer


def verl_cosine(step, warmup, total, min_lr_ratio=0.0, num_cycles=0.5, zero_indexed_step=True):
    """verl's get_cosine_schedule_with_warmup lr_lambda (init_lr_ratio None -> 0)."""
    coef, intercept, init = (1 - min_lr_ratio) * 0.5, (1 + min_lr_ratio) * 0.5, 0.0
    if not zero_indexed_step:
        step += 1
    if step < warmup:
        return init + (1.0 - init) * (float(step) / float(max(1, warmup)))
    progress = float(step - warmup) / float(max(1, total - warmup))
    x = math.cos(math.pi * float(num_cycles) * 2.0 * progress)
    return max(min_lr_ratio, x * coef + intercept)


def verl_constant(step, warmup):
    """verl's get_constant_schedule_with_warmup lr_lambda."""
    return float(step) / float(max(1.0, warmup)) if step < warmup else 1.0


@pytest.mark.parametrize("warmup, total, ratio, cycles, zero", [
    (0, 10, 0.0, 0.5, True), (3, 12, 0.1, 0.5, True), (2, 9, 0.25, 1.0, True), (0, 8, 0.0, 2.0, True),
    (4, 10, 0.05, 0.5, False), (1, 5, 1.0, 0.5, True)])
def test_cosine_equals_verls_formula(warmup, total, ratio, cycles, zero):
    got = Schedule("cosine", ratio, cycles, zero).factor(warmup, total)
    for step in range(total + 1):
        assert got(step) == pytest.approx(verl_cosine(step, warmup, total, ratio, cycles, zero), abs=1e-12), step


@pytest.mark.parametrize("warmup, zero", [(0, True), (4, True), (3, False)])
def test_constant_equals_verls_formula(warmup, zero):
    got = Schedule("constant", zero_indexed_step=zero).factor(warmup, 10)  # verl's constant is always 0-indexed
    assert [got(s) for s in range(10)] == [verl_constant(s, warmup) for s in range(10)]
    assert lr_lambda("constant", warmup, 10)(0) == verl_constant(0, warmup)


def test_floor_and_cycles_change_the_lr_a_lambdalr_gives():
    """Through torch's LambdaLR as the Trainer uses it: the floor and the cycle count each change the sequence."""
    def lrs(schedule, steps=8):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(schedule, 2, steps))
        out = []
        for _ in range(steps):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    plain, floored, cycled = lrs("cosine"), lrs(Schedule("cosine", min_lr_ratio=0.3)), lrs(Schedule("cosine",
                                                                                                   num_cycles=1.0))
    assert plain == pytest.approx([2.0 * verl_cosine(s, 2, 8) for s in range(8)])
    assert floored == pytest.approx([2.0 * verl_cosine(s, 2, 8, 0.3) for s in range(8)])
    assert cycled == pytest.approx([2.0 * verl_cosine(s, 2, 8, 0.0, 1.0) for s in range(8)])
    assert min(floored[2:]) > min(plain[2:]) and floored != plain
    assert cycled[-1] > cycled[5]  # the full wave comes back up
    with pytest.raises(ValueError, match="min_lr_ratio"):
        Schedule("cosine", min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="unknown lr_schedule 'linear'"):
        lr_lambda("linear", 0, 10)


# ---------------------------------------------------------------- shuffle

def verl_make_iterator(rows, mini, epochs, seed):
    """verl's make_iterator(dataloader_kwargs={"shuffle": True}, seed=seed): index tensors per mini-batch."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    loader = DataLoader(dataset=torch.arange(rows), batch_size=mini, collate_fn=lambda x: x, generator=generator,
                        shuffle=True)
    return [[int(i) for i in idx] for _ in range(epochs) for idx in loader]


def test_shuffled_mini_batches_are_verls():
    got = [[int(i) for i in idx] for epoch in shuffled_mini_batches(32, 8, 3, seed=42) for idx in epoch]
    assert got == verl_make_iterator(32, 8, 3, 42)
    assert got[:4] != got[4:8]  # a new permutation each epoch
    assert all(sorted(sum(got[e * 4:(e + 1) * 4], [])) == list(range(32)) for e in range(3))
    assert got != [[int(i) for i in idx] for epoch in shuffled_mini_batches(32, 8, 3, seed=43) for idx in epoch]


class RowsGRPO(GRPO):
    """GRPO that remembers each step's rows in batch order (a row: its prompt and response ids)."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def forward(self, batch):
        self.batches.append(rows_of(batch))
        return super().forward(batch)


class RowsLoss(PPOLoss):
    """PPOLoss that remembers the rows of each (mini-batch = micro-batch) it is called on."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __call__(self, batch, aggregation=None):
        self.calls.append(rows_of(batch))
        return super().__call__(batch, aggregation)


def rows_of(batch):
    return [tuple(p) + (-1,) + tuple(r) for p, r in zip(batch[K.PROMPT_IDS].tolist(), batch[K.RESPONSE_IDS].tolist())]


@pytest.mark.parametrize("shuffle_seed", [None, 7])
def test_trainer_mini_batches_follow_verls_shuffle(model, tokenizer, addition_rows, tmp_path, shuffle_seed):
    """8 prompts x 4 samples, mini-batches of 2 prompts (8 rows), 2 PPO epochs, 2 steps: without a seed the
    mini-batches are the batch's consecutive rows; with one, verl's permutation (the same at every step)."""
    estimator, loss = RowsGRPO(), RowsLoss()
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, estimator=estimator, loss=loss,
                                 mini_batch_size=2, ppo_epochs=2, shuffle_seed=shuffle_seed)
    trainer.fit(data)
    assert len(estimator.batches) == 2 and len(loss.calls) == 2 * 2 * 4
    orders = ([list(range(k * 8, k * 8 + 8)) for k in range(4)] * 2 if shuffle_seed is None
              else verl_make_iterator(32, 8, 2, shuffle_seed))
    for step, rows in enumerate(estimator.batches):
        calls = loss.calls[step * 8:(step + 1) * 8]
        assert [sorted(c) for c in calls] == [sorted(rows[i] for i in order) for order in orders]
        contiguous = [sorted(rows[k * 8:(k + 1) * 8]) for k in range(4)] * 2
        assert ([sorted(c) for c in calls] == contiguous) == (shuffle_seed is None)
