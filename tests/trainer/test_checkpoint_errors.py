"""Bad checkpoints and run folders: each fails with a message naming the path, before training where it can."""

import multiprocessing
import os
import resource
import shutil
import signal
from collections import namedtuple

import pytest
import torch

from rlflow.cli import main as cli_main
from rlflow.models.tiny import tiny_qwen2
from rlflow.trainer import training_state as ckpt

from .helpers import make_trainer, params


@pytest.fixture
def saved(model, tokenizer, addition_rows, tmp_path):
    """A run of 2 steps with a checkpoint after each."""
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path / "run", save_every=1, loggers=())
    trainer.fit(data)
    return tmp_path / "run"


def resume_from(model, tokenizer, rows, run_dir, resume, **kw):
    trainer, data = make_trainer(model, tokenizer, rows, run_dir, max_steps=3, resume=resume, loggers=(), **kw)
    return trainer, data


@pytest.mark.parametrize("target, message", [
    (lambda run: run / "global_step_9", r"checkpoint folder .*global_step_9 does not exist"),
    (lambda run: run / "global_step_1" / "state.ckpt", r"state\.ckpt is a file; pass the global_step_N folder"),
    (lambda run: run, r"run is not an rlflow checkpoint: no state\.ckpt \(found \['global_step_1'"),
])
def test_resume_from_a_wrong_path(saved, model, tokenizer, addition_rows, tmp_path, target, message):
    trainer, data = resume_from(model, tokenizer, addition_rows, tmp_path / "again", target(saved))
    with pytest.raises(ckpt.CheckpointError, match=message):
        trainer.fit(data)


def test_resume_from_a_truncated_checkpoint(saved, model, tokenizer, addition_rows, tmp_path):
    state = saved / "global_step_2" / "state.ckpt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    trainer, data = resume_from(model, tokenizer, addition_rows, tmp_path / "again", saved / "global_step_2")
    with pytest.raises(ckpt.CheckpointError, match=r"cannot load .*global_step_2/state\.ckpt: it may be incomplete "
                                                   r"or damaged: resume from an earlier global_step_N"):
        trainer.fit(data)


def test_resume_with_another_model(saved, tokenizer, addition_rows, tmp_path):
    wider = tiny_qwen2(len(tokenizer), hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                       intermediate_size=64, seed=0)
    trainer, data = resume_from(wider, tokenizer, addition_rows, tmp_path / "again", saved / "global_step_2")
    with pytest.raises(ckpt.CheckpointError, match=r"cannot load .*state\.ckpt: the model does not match the one "
                                                   r"that wrote it .*size mismatch"):
        trainer.fit(data)


def test_resume_ppo_from_a_checkpoint_without_critic(saved, model, tokenizer, addition_rows, tmp_path):
    trainer, data = resume_from(model, tokenizer, addition_rows, tmp_path / "again", saved / "global_step_2", ppo=True)
    with pytest.raises(ckpt.CheckpointError, match=r"global_step_2 is not an rlflow checkpoint: no critic\.ckpt"):
        trainer.fit(data)


def test_damaged_tracker_and_leftover_partial_folder(saved, model, tokenizer, addition_rows):
    (saved / ckpt.TRACKER).write_text("garbage")
    shutil.copytree(saved / "global_step_2", saved / ".global_step_3.partial")  # a save that was killed
    assert ckpt.latest_checkpoint(saved) == saved / "global_step_2"  # the newest complete folder
    trainer, data = resume_from(model, tokenizer, addition_rows, saved, "auto", save_every=1)
    assert [m["training/global_step"] for m in trainer.fit(data)] == [3]
    assert (saved / ckpt.TRACKER).read_text() == "3" and not list(saved.glob(".global_step_*"))


def test_run_folder_that_cannot_be_created(model, tokenizer, addition_rows, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path / "file" / "run", loggers=())
    before = params(trainer.policy.model)
    with pytest.raises(ckpt.CheckpointError, match=r"run folder .*file/run is not writable .*choose another run_dir"):
        trainer.fit(data)
    assert trainer.global_step == 0 and all(torch.equal(a, b) for a, b in zip(before, params(trainer.policy.model)))


def test_disk_without_room_for_a_checkpoint(model, tokenizer, addition_rows, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * 2**20, 10 * 2**20 - 1000, 1000))  # a full disk
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path / "run", save_every=1, loggers=())
    with pytest.raises(ckpt.CheckpointError, match=r"run folder .*run: 0 MiB free, a checkpoint needs about 0 MiB"):
        trainer.fit(data)
    assert trainer.global_step == 0
    trainer.save_every = 0  # without checkpoints only write access matters
    assert len(trainer.fit(data)) == 2


def test_a_failing_write_leaves_the_previous_checkpoint(saved, model, tokenizer, addition_rows):
    """A real write error (the file-size limit, as a full disk would) while saving step 3."""
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)

    def child():
        trainer, data = resume_from(model, tokenizer, addition_rows, saved, "auto")
        trainer.fit(data)  # resumes at 2, trains step 3 (no save_every)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
        try:
            trainer.save()
            send.send("saved")
        except ckpt.CheckpointError as e:
            send.send(str(e))
        os._exit(0)

    proc = ctx.Process(target=child)
    proc.start()
    message = receive.recv()
    proc.join(60)
    assert "could not write checkpoint" in message and "global_step_3" in message
    assert f"{saved / 'global_step_2'} is still complete" in message
    assert (saved / ckpt.TRACKER).read_text() == "2" and not (saved / "global_step_3").exists()
    assert ckpt.latest_checkpoint(saved) == saved / "global_step_2"


@pytest.mark.parametrize("target, message", [
    (lambda run: run / "global_step_7", r"checkpoint folder .*global_step_7 does not exist"),
    (lambda run: run / ckpt.TRACKER, r"latest_checkpointed_iteration\.txt is a file, not a checkpoint folder"),
    (lambda run: run, r"run is not an rlflow checkpoint: no state\.ckpt; this looks like a run folder: its latest "
                      r"checkpoint is .*global_step_2"),
])
def test_export_names_the_wrong_folder(saved, tmp_path, capsys, target, message):
    assert cli_main(["export", str(target(saved)), str(tmp_path / "out")]) == 2
    assert __import__("re").search(message, capsys.readouterr().err)


def test_export_without_huggingface_metadata(saved, tmp_path, capsys):
    shutil.rmtree(saved / "global_step_2" / "huggingface")
    assert cli_main(["export", str(saved / "global_step_2"), str(tmp_path / "out")]) == 2
    assert "global_step_2 has no huggingface/ folder" in capsys.readouterr().err
