"""Checkpoint rotation, critic warm-up, and samples written out (rollout / validation dumps, the
validation-generations table): each on a tiny model for a few steps, checked on the files and weights."""

import json

import numpy as np
import pytest
import torch

from rlflow.trainer import training_state as ckpt
from rlflow.trainer.generations import DumpGenerations, LogValidationGenerations, pick_samples

from .helpers import make_trainer, params


def test_rotation_keeps_the_newest_checkpoints(model, tokenizer, addition_rows, tmp_path):
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=4, save_every=1,
                                 keep_checkpoints=2, loggers=("jsonl",))
    trainer.fit(data)
    assert ckpt.complete_steps(tmp_path) == [3, 4]
    assert (tmp_path / ckpt.TRACKER).read_text() == "4"
    assert not list(tmp_path.glob(".global_step_*"))
    # resuming and saving again keeps counting the folder's checkpoints, not only this launch's
    again, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=5, save_every=1,
                               keep_checkpoints=2, resume="auto", loggers=("jsonl",))
    again.fit(data)
    assert ckpt.complete_steps(tmp_path) == [4, 5]


@pytest.mark.parametrize("keep", [None, 0, -1])
def test_rotation_off_keeps_every_checkpoint(model, tokenizer, addition_rows, tmp_path, keep):
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=3, save_every=1,
                                 keep_checkpoints=keep, loggers=("jsonl",))
    trainer.fit(data)
    assert ckpt.complete_steps(tmp_path) == [1, 2, 3]


def test_rotate_never_deletes_the_latest_nor_later_steps(tmp_path):
    for s in (1, 2, 3, 5):
        ckpt.step_dir(tmp_path, s).mkdir()
    (tmp_path / ".global_step_2.old").mkdir()  # left by a run killed while deleting
    assert ckpt.rotate(tmp_path, 1, 3) == [1, 2]  # step 5: of a run resumed from earlier, replaced when reached
    assert ckpt.complete_steps(tmp_path) == [3, 5]
    assert not list(tmp_path.glob(".global_step_*"))
    assert ckpt.rotate(tmp_path, 1, 3) == []


def test_critic_warmup_trains_only_the_critic_first(model, tokenizer, addition_rows, tmp_path):
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, ppo=True, max_steps=4,
                                 critic_warmup_steps=2, loggers=("jsonl",), warmup_steps=3)
    policy0, critic0 = params(trainer.policy.model), params(trainer.critic.module)
    lrs = []

    class Watch:
        def on_step_end(self, trainer, step, metrics):
            lrs.append(trainer.optimizer.param_groups[0]["lr"])
            changed = any(not torch.equal(a, b) for a, b in zip(policy0, params(trainer.policy.model)))
            # the policy's first update (step 3) runs at its schedule's first lr, 0 in verl's warm-up, as in verl
            assert changed == (step > 3), step
            # verl's warm-up runs its first step at lr 0 (step / warmup_steps, from step 0): the critic moves from step 2
            critic_moved = any(not torch.equal(a, b) for a, b in zip(critic0, params(trainer.critic.module)))
            assert critic_moved == (step > 1), step

    trainer.fabric._callbacks.append(Watch())
    history = trainer.fit(data)
    assert [m["actor/critic_warmup"] for m in history] == [1.0, 1.0, 0.0, 0.0]
    assert "actor/pg_loss" not in history[0] and "actor/pg_loss" in history[2]
    assert "critic/vf_loss" in history[0]
    assert lrs == pytest.approx([0.0, 0.0, 1e-3 / 3, 2e-3 / 3])  # the policy's warm-up schedule waits with it
    assert trainer.critic_optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)  # the critic's does not (4 steps)


def test_critic_warmup_without_a_critic_is_refused(model, tokenizer, addition_rows, tmp_path):
    with pytest.raises(ValueError, match="critic_warmup_steps=2 needs a critic"):
        make_trainer(model, tokenizer, addition_rows, tmp_path, critic_warmup_steps=2)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rollout_and_validation_dumps_in_verls_layout(model, tokenizer, addition_rows, tmp_path):
    dump = DumpGenerations(rollout_dir=tmp_path / "rollouts", validation_dir=tmp_path / "val")
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path / "run", max_steps=2, val_every=1,
                                 callbacks=[dump], loggers=("jsonl",))
    history = trainer.fit(data)
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["1.jsonl", "2.jsonl"]
    rows = read_jsonl(tmp_path / "rollouts" / "2.jsonl")
    assert len(rows) == 8 * 4  # batch_size prompts x n samples
    assert list(rows[0])[:5] == ["input", "output", "gts", "score", "step"]
    assert {r["step"] for r in rows} == {2}
    mean = sum(r["score"] for r in rows) / len(rows)
    assert mean == pytest.approx(history[1]["critic/score/mean"])
    assert all(r["score"] == float(r["output"][:1].isdigit()) for r in rows)  # the helpers' reward, on the text
    train_prompts = {r["prompt"] for r in addition_rows[0]}
    assert all(r["input"] in train_prompts for r in rows)
    val = read_jsonl(tmp_path / "val" / "1.jsonl")
    assert len(val) == len(addition_rows[1]) and {r["step"] for r in val} == {1}
    assert [r["reward"] for r in val] == [r["score"] for r in val]  # verl's validation extras start with reward
    assert {str(r["gts"]) for r in val} == {str(row["ground_truth"]) for row in addition_rows[1]}
    assert sum(r["score"] for r in val) / len(val) == pytest.approx(history[0]["val-core/rlflow/addition/reward/mean@1"])


def test_validation_generations_are_logged_as_verl_picks_them(model, tokenizer, addition_rows, tmp_path, capsys):
    from rlflow.trainer.loggers import ConsoleLogger

    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=2, val_every=1,
                                 callbacks=[LogValidationGenerations(3), DumpGenerations(validation_dir=tmp_path / "v")],
                                 loggers=("jsonl", "tensorboard", ConsoleLogger()))
    trainer.fit(data)
    logged = read_jsonl(tmp_path / "val_generations.jsonl")
    assert [r["step"] for r in logged] == [1, 1, 1, 2, 2, 2]
    every = read_jsonl(tmp_path / "v" / "1.jsonl")
    # verl 0.9.1's _maybe_log_val_generations, step by step: sort by input, shuffle with seed 42, take n
    verl_order = sorted([(r["input"], r["output"], r["score"]) for r in every], key=lambda s: s[0])
    np.random.RandomState(42).shuffle(verl_order)
    expected = verl_order[:3]
    assert pick_samples([r["input"] for r in every], [r["output"] for r in every], [r["score"] for r in every],
                        3) == expected
    assert [(r["input"], r["output"], r["score"]) for r in logged[:3]] == expected
    # the same prompts every validation (verl's fixed seed), not the first three
    assert [r["input"] for r in logged[:3]] == [r["input"] for r in logged[3:]]
    assert [r["input"] for r in logged[:3]] != [r["input"] for r in every[:3]]
    assert capsys.readouterr().out.count("[val/generations step:2") == 3
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("val/generations/text_summary")
    assert [t.step for t in texts] == [1, 2] and expected[0][0].encode() in texts[0].tensor_proto.string_val[0]
