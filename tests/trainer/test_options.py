"""The Trainer's grouped arguments (rlflow.trainer.options): the same Trainer as the keyword arguments, and a
value set both ways is refused, naming it."""

import pytest

from rlflow.trainer.options import Batching, RunDir

from .helpers import make_trainer

ATTRS = ("batch_size", "mini_batch_size", "micro_batch_size", "max_tokens_per_micro_batch", "ppo_epochs",
         "shuffle_seed", "balance_batch", "run_dir", "save_every", "resume", "keep_checkpoints")


def test_grouped_arguments_make_the_same_trainer_as_keywords(model, tokenizer, addition_rows, tmp_path):
    flat, _ = make_trainer(model, tokenizer, addition_rows, tmp_path, batch_size=8, mini_batch_size=4,
                           micro_batch_size=2, ppo_epochs=2, shuffle_seed=3, save_every=2, keep_checkpoints=1,
                           resume="auto", loggers=("jsonl",))
    # the helper's batch_size and run_dir set back to the Trainer's defaults: only the groups set them
    grouped, _ = make_trainer(model, tokenizer, addition_rows, "runs/rlflow", batch_size=32,
                              batching=Batching(batch_size=8, mini_batch_size=4, micro_batch_size=2, ppo_epochs=2,
                                                shuffle_seed=3),
                              run=RunDir(tmp_path, save_every=2, keep_checkpoints=1, resume="auto", loggers=("jsonl",)))
    assert {a: getattr(grouped, a) for a in ATTRS} == {a: getattr(flat, a) for a in ATTRS}
    assert grouped.needs_old_log_probs and [type(lg).__name__ for lg in grouped.fabric.loggers] == \
        [type(lg).__name__ for lg in flat.fabric.loggers]


def test_a_value_set_both_ways_is_refused(model, tokenizer, addition_rows, tmp_path):
    with pytest.raises(ValueError, match=r"micro_batch_size=2 is set twice: pass it in Batching\(micro_batch_size="):
        make_trainer(model, tokenizer, addition_rows, tmp_path, batch_size=32, micro_batch_size=2,
                     batching=Batching(batch_size=8))
    with pytest.raises(ValueError, match="save_every=1 is set twice"):
        make_trainer(model, tokenizer, addition_rows, "runs/rlflow", save_every=1, run=RunDir(tmp_path))
    with pytest.raises(TypeError, match=r"expected a RunDir\(...\), got str"):
        make_trainer(model, tokenizer, addition_rows, "runs/rlflow", run=str(tmp_path))
