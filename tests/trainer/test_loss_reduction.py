"""The loss, not the Trainer, says how its statistics reduce over micro-batches (``LossOutput.summed``)."""

import pytest

from rlflow import LossOutput, PPOLoss

from .helpers import make_trainer


class CountingLoss(PPOLoss):
    """PPOLoss with two stats of its own: ``actor/calls`` (1 per call, declared summed: a share) and
    ``actor/one`` (1 per call, a mean)."""

    def __call__(self, batch, aggregation=None):
        out = super().__call__(batch, aggregation)
        stats = out.stats | {"actor/calls": 1.0, "actor/one": 1.0}
        return LossOutput(out.loss, stats, out.summed | {"actor/calls"})


def test_summed_stats_add_up_over_micro_batches_and_the_others_average(model, tokenizer, addition_rows, tmp_path):
    # 8 prompts x 4 samples = 32 rows in micro-batches of 8: 4 calls per optimizer step
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=1, micro_batch_size=8,
                                 loss=CountingLoss(), loggers=())
    metrics = trainer.fit(data)[0]
    assert metrics["actor/calls"] == pytest.approx(4.0)  # summed, as the loss declared
    assert metrics["actor/one"] == pytest.approx(1.0)  # averaged
    assert metrics["actor/pg_loss"] != 0.0
