"""The Trainer's grouped arguments (rlflow.trainer.options): the flat keywords of old still make the same Trainer,
with one DeprecationWarning naming the groups; a value set both ways, an unknown keyword and a wrong group type are
refused, naming them."""

import copy
import warnings

import pytest

from rlflow import GRPO, FunctionReward, HFRollout, Policy, PPOLoss, Trainer
from rlflow.trainer.options import Batching, Hardware, Loop, Optim, RunDir, groups, with_groups

from .helpers import starts_with_digit

ATTRS = ("batch_size", "mini_batch_size", "micro_batch_size", "max_tokens_per_micro_batch", "ppo_epochs",
         "shuffle_seed", "balance_batch", "run_dir", "save_every", "resume", "keep_checkpoints", "max_grad_norm",
         "max_steps", "epochs", "val_every", "val_n", "val_sampling", "critic_warmup_steps", "seed", "progress",
         "lr_schedule", "warmup_steps", "sp_size")


def trainer(model, tokenizer, **kwargs):
    return Trainer(Policy(copy.deepcopy(model), tokenizer), HFRollout(n=2, max_new_tokens=2),
                   FunctionReward(starts_with_digit), GRPO(), PPOLoss(), **kwargs)


def test_flat_keywords_make_the_same_trainer_as_groups_with_one_warning(model, tokenizer, tmp_path):
    flat = dict(lr=1e-3, weight_decay=0.0, lr_schedule="cosine", warmup_steps=1, max_grad_norm=0.5,
                batch_size=8, mini_batch_size=4, micro_batch_size=2, ppo_epochs=2, shuffle_seed=3,
                max_steps=3, val_every=2, val_n=2, val_sampling={"n": 2}, seed=5, progress=False,
                run_dir=tmp_path, save_every=2, keep_checkpoints=1, resume="auto", loggers=("jsonl",),
                accelerator="cpu", devices=1, precision="32-true")
    with pytest.warns(DeprecationWarning) as caught:
        old = trainer(model, tokenizer, **flat)
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    for spelled in ("optim=Optim(lr=..., weight_decay=...", "batching=Batching(batch_size=...", "loop=Loop(max_steps=",
                    "run=RunDir(path=...", "hardware=Hardware(accelerator=..."):
        assert spelled in message, message
    assert caught[0].filename == __file__  # it points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the grouped call warns of nothing
        new = trainer(model, tokenizer,
                      optim=Optim(lr=1e-3, weight_decay=0.0, lr_schedule="cosine", warmup_steps=1, max_grad_norm=0.5),
                      batching=Batching(batch_size=8, mini_batch_size=4, micro_batch_size=2, ppo_epochs=2,
                                        shuffle_seed=3),
                      loop=Loop(max_steps=3, val_every=2, val_n=2, val_sampling={"n": 2}, seed=5, progress=False),
                      run=RunDir(tmp_path, save_every=2, keep_checkpoints=1, resume="auto", loggers=("jsonl",)),
                      hardware=Hardware(accelerator="cpu", devices=1, precision="32-true"))
    assert {a: getattr(new, a) for a in ATTRS} == {a: getattr(old, a) for a in ATTRS}
    assert new.optimizer.param_groups[0]["weight_decay"] == old.optimizer.param_groups[0]["weight_decay"] == 0.0
    assert new.needs_old_log_probs
    assert [type(lg).__name__ for lg in new.fabric.loggers] == [type(lg).__name__ for lg in old.fabric.loggers]
    assert groups(**flat) == {"optim": new.optim, "batching": new.batching, "loop": new.loop, "run": new.run,
                              "hardware": new.hardware}


def test_a_value_set_both_ways_an_unknown_keyword_and_a_wrong_group_are_refused(model, tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"micro_batch_size=2 is set twice: pass it in Batching\(micro_batch_size="):
        trainer(model, tokenizer, micro_batch_size=2, batching=Batching(batch_size=8))
    with pytest.raises(ValueError, match=r"run_dir=.* is set twice: pass it in RunDir\(path="):
        trainer(model, tokenizer, run_dir=tmp_path, run=RunDir(tmp_path))
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'batch_sise'"):
        trainer(model, tokenizer, batch_sise=8)
    with pytest.raises(TypeError, match=r"run: expected a RunDir\(...\), got str"):
        trainer(model, tokenizer, run=str(tmp_path))
    # a job that takes the Trainer's settings as keywords sorts them the same way
    assert with_groups(lr=1e-3, run_dir="r", callbacks=[]) == {"callbacks": [], "optim": Optim(lr=1e-3),
                                                               "run": RunDir("r")}
    with pytest.raises(ValueError, match=r"val_every=2 is set twice: pass it in Loop\(val_every="):
        with_groups(val_every=2, loop=Loop())
