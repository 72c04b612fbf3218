"""Kill anywhere, lose nothing: a run killed with SIGKILL at random points (in a step, in every phase of
a save, while deleting a rotated-out checkpoint, while resuming) and resumed with ``resume="auto"`` ends
with the logged metrics and the weights of an uninterrupted run, and the newest ``keep_checkpoints``.

Each run is a child forked from this (already warm) process, so no case pays for a fresh interpreter.
Points inside a save are reached by making the child SIGKILL itself when it gets there (the process dies
exactly as under ``kill -9``); the others are SIGKILLs from this process after a random delay.
"""

import io
import json
import multiprocessing
import os
import random
import shutil
import signal
import time

import pytest
import torch

from rlflow.trainer import training_state as ckpt
from rlflow.trainer.hf_export import load_policy_state

from .helpers import comparable, make_trainer

STEPS = 4
KEEP = 2  # the killed and resumed runs rotate checkpoints (keep_checkpoints); the uninterrupted one keeps all
CTX = multiprocessing.get_context("fork")


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def kill_on_call(owner, name, occurrence, after=False):
    """Replace ``owner.name`` so that its ``occurrence``-th call dies (before it runs, or after it returned)."""
    real, calls = getattr(owner, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == occurrence and not after:
            die()
        out = real(*args, **kwargs)
        if calls[0] == occurrence:
            die()
        return out

    setattr(owner, name, wrapper)


def half_written_state(occurrence):
    """The ``occurrence``-th ``state.ckpt`` gets half its bytes on disk, then the process dies."""
    import lightning_fabric.plugins.io.torch_io as torch_io

    calls = [0]
    real = torch_io._atomic_save

    def torn(checkpoint, path):
        calls[0] += 1
        if calls[0] < occurrence:
            return real(checkpoint, path)
        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        with open(path, "wb") as f:
            f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        die()

    torch_io._atomic_save = torn


def dies_while_rotating(occurrence):
    """The ``occurrence``-th deletion of a rotated-out checkpoint (keep_checkpoints) removes one file, then dies."""
    from pathlib import Path

    real, calls = shutil.rmtree, [0]

    def rmtree(path, *args, **kwargs):
        p = Path(path)
        if p.name.endswith(".old") and p.exists():
            calls[0] += 1
            if calls[0] == occurrence:
                next(f for f in sorted(p.rglob("*")) if f.is_file()).unlink()
                die()
        return real(path, *args, **kwargs)

    shutil.rmtree = rmtree


def inside_save_points(rng):
    """(description, installer) pairs: each installer, run in the child, makes it die at that point."""
    from rlflow.trainer.trainer import Trainer

    o = rng.randint(1, 2)
    return [
        (f"state.ckpt half written (save {o})", lambda: half_written_state(o)),
        (f"state.ckpt written, huggingface/ not (save {o})", lambda: kill_on_call(ckpt, "save_hf_metadata", o)),
        (f"flushing the finished folder (fsync {3 * o})", lambda: kill_on_call(ckpt, "_fsync", 3 * o)),
        (f"folder published, tracker not updated (save {o})", lambda: kill_on_call(ckpt, "mark_latest", o)),
        (f"tracker written, next step not started (save {o})", lambda: kill_on_call(ckpt, "mark_latest", o, after=True)),
        (f"rename {2 * o} (publish or tracker)", lambda: kill_on_call(os, "replace", 2 * o)),
        (f"in the policy update (step {o})", lambda: kill_on_call(Trainer, "update_actor", o)),
        ("while loading the checkpoint", lambda: kill_on_call(ckpt, "set_rng_state", 1)),
        (f"deleting an old checkpoint (rotation {o})", lambda: dies_while_rotating(o)),
    ]


def run_child(model, tokenizer, rows, run_dir, install=None, keep=None):
    def target():
        if install:
            install()
        trainer, data = make_trainer(model, tokenizer, rows, run_dir, max_steps=STEPS, save_every=1, resume="auto",
                                     loggers=("jsonl",), keep_checkpoints=keep)
        trainer.fit(data)

    proc = CTX.Process(target=target)
    proc.start()
    return proc


def logged(run_dir):
    return [comparable(json.loads(line)) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from rlflow.models.tiny import char_tokenizer, tiny_qwen2
    from rlflow.tasks.addition import AdditionTask

    tok = char_tokenizer()
    model = tiny_qwen2(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=0)
    train, _, test = AdditionTask().splits()
    rows = (train[:64], test[:16])
    out = tmp_path_factory.mktemp("uninterrupted")
    start = time.perf_counter()
    proc = run_child(model, tok, rows, out)
    proc.join(120)
    assert proc.exitcode == 0
    return model, tok, rows, out, time.perf_counter() - start


def test_sigkill_at_random_points_then_resume_equals_uninterrupted(reference, tmp_path):
    model, tok, rows, ref_dir, duration = reference
    expected = logged(ref_dir)
    expected_weights = load_policy_state(ref_dir / f"global_step_{STEPS}" / "state.ckpt")
    assert [r["step"] for r in expected] == list(range(1, STEPS + 1))
    rng = random.Random(0)
    cases = [(d, i) for d, i in inside_save_points(rng)]
    cases += [(f"SIGKILL after {t:.2f} s", t) for t in (rng.uniform(0.05, 0.45) * duration for _ in range(5))]
    kills = []
    for k, (what, how) in enumerate(cases):
        run = tmp_path / f"case{k}"
        start_step = rng.randint("loading" in what, 2)  # the run already has checkpoints of steps 1..start_step
        for s in range(1, start_step + 1):
            shutil.copytree(ref_dir / f"global_step_{s}", run / f"global_step_{s}")
        if start_step:
            ckpt.mark_latest(run, start_step)
            (run / "metrics.jsonl").write_text("".join(
                line + "\n" for line in (ref_dir / "metrics.jsonl").read_text().splitlines()[:start_step]))
        if isinstance(how, float):
            proc = run_child(model, tok, rows, run, keep=KEEP)
            time.sleep(how)
            os.kill(proc.pid, signal.SIGKILL)
        else:
            proc = run_child(model, tok, rows, run, install=how, keep=KEEP)
        proc.join(120)
        kills.append(proc.exitcode == -signal.SIGKILL)
        assert proc.exitcode in (0, -signal.SIGKILL), (what, proc.exitcode)

        resumed = run_child(model, tok, rows, run, keep=KEEP)  # resume="auto", no kill
        resumed.join(120)
        assert resumed.exitcode == 0, what
        assert (run / ckpt.TRACKER).read_text() == str(STEPS), what
        assert logged(run) == expected, what
        weights = load_policy_state(run / f"global_step_{STEPS}" / "state.ckpt")
        assert all(torch.equal(weights[n], expected_weights[n]) for n in expected_weights), what
        assert not list(run.glob(".global_step_*")), what  # no partial folder survives a finished run
        assert ckpt.complete_steps(run) == list(range(STEPS - KEEP + 1, STEPS + 1)), what  # rotated as asked
    assert sum(kills) >= 10, [c for (c, _), killed in zip(cases, kills) if not killed]
