import json
import math

import pytest
import torch
from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.trainer.loggers import JSONLLogger, make_loggers
from rlflow.trainer.metrics import MeanAccumulator, Timer, batch_metrics, sum_micro_batches
from rlflow.trainer.schedule import lr_lambda


def test_batch_metrics_by_hand():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    batch = TensorDict({
        K.RESPONSE_MASK: mask, K.RESPONSE_IDS: torch.zeros(3, 4, dtype=torch.long),
        K.PROMPT_MASK: torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]]),
        K.SCORES: torch.tensor([1.0, 0.0, 0.5]),
        K.TOKEN_REWARDS: torch.tensor([[0, 0, 1.0, 0], [0, 0, 0, 0.0], [0.5, 0, 0, 0]]),
        K.ADVANTAGES: torch.tensor([[1.0, 1, 1, 9], [-2, -2, -2, -2], [3, 9, 9, 9]]),
    }, batch_size=[3])
    m = batch_metrics(batch, max_response_length=4)
    assert m["critic/score/mean"] == pytest.approx(0.5) and m["critic/score/max"] == 1.0
    assert m["critic/rewards/min"] == 0.0
    # masked entries (the 9s) never count
    assert m["critic/advantages/max"] == 3.0 and m["critic/advantages/min"] == -2.0
    assert m["critic/advantages/mean"] == pytest.approx((3 * 1 - 2 * 4 + 3) / 8)
    assert (m["response_length/mean"], m["response_length/max"], m["response_length/min"]) == (pytest.approx(8 / 3), 4, 1)
    assert m["response_length/clip_ratio"] == pytest.approx(1 / 3)  # one response hit the limit
    assert m["prompt_length/mean"] == pytest.approx(2.0)


def test_micro_batch_stats_sum_loss_terms_and_average_fractions():
    stats = [{"actor/pg_loss": 0.25, "actor/pg_clipfrac": 0.1}, {"actor/pg_loss": 0.5, "actor/pg_clipfrac": 0.3}]
    out = sum_micro_batches(stats, frozenset({"actor/pg_loss"}))
    assert out == {"actor/pg_loss": 0.75, "actor/pg_clipfrac": pytest.approx(0.2)}
    acc = MeanAccumulator()
    acc.add({"a": 1.0})
    acc.add({"a": 3.0, "b": 2.0})
    assert acc.means() == {"a": 2.0, "b": 2.0}


def test_timer_accumulates_named_phases():
    timer = Timer()
    for _ in range(2):
        with timer("gen"):
            pass
    assert list(timer.metrics()) == ["timing_s/gen"] and timer.metrics()["timing_s/gen"] >= 0


def test_lr_schedules():
    warm_const = lr_lambda("constant", warmup_steps=4, total_steps=10)
    assert [warm_const(s) for s in (0, 3, 4, 9)] == [0.0, 0.75, 1.0, 1.0]  # verl's step / warmup (test_schedule*)
    cosine = lr_lambda("cosine", warmup_steps=0, total_steps=10)
    assert cosine(0) == 1.0 and cosine(5) == pytest.approx(0.5) and cosine(10) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="unknown lr_schedule 'linear'"):
        lr_lambda("linear", 0, 10)


def test_jsonl_logger_writes_one_line_per_step_and_nulls_non_finite(tmp_path):
    logger = JSONLLogger(tmp_path)
    logger.log_metrics({"a": 1.0, "b": math.nan}, step=1)
    logger.log_metrics({"a": 2.0}, step=2)
    logger.finalize("success")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "a": 1.0, "b": None}, {"step": 2, "a": 2.0}]


def test_unknown_logger_is_named(tmp_path):
    with pytest.raises(ValueError, match="unknown logger 'mlflw'"):
        make_loggers(["mlflw"], tmp_path)
