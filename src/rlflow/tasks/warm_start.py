"""Warm starts made once: shipped with rlflow for the built-in tasks' usual seeds, cached on disk otherwise.

A supervised warm start trains until an accuracy criterion holds, so float rounding (another CPU's SIMD
width, another BLAS path) moves the step at which it stops and the weights it stops at: the addition
task's seed 0 warm start measured 0.22 held-out accuracy on one machine and 0.08 on another, same
packages. Every learning figure downstream moved with it. So the warm starts of the seeds the tests and
docs use are files in ``rlflow/tasks/warm_starts/`` (safetensors, float32), each holding in its metadata
the key it was made for; a task, seed or setting with no shipped file is trained here and cached in
``rlflow.cache.cache_dir()`` under a key that also names the torch and transformers versions.

``python -m rlflow.tasks.warm_start`` remakes the shipped files on this machine (the learning tests'
thresholds are measured from them: ``python scripts/learning_spread.py``).

``RLFLOW_WARM_START_JITTER=K`` (an integer, not 0) multiplies every loaded weight by ``1 + 1e-4 * z``, ``z``
standard normal from generator seed ``K``. It stands in for another machine: float rounding alone differs
by ~1e-7 and, measured here, a 1e-6 perturbation left most 40-80-step runs on the very same samples (the
0/1 rewards did not flip); 1e-4 is still far below one RL step's change (AdamW at lr 2e-4 moves weights of
size ~0.05 by ~0.4 %), and sends runs down other sampling paths, as runs on other CPUs go. It measures how
far such a difference moves a learning figure; nothing else uses it. ``RLFLOW_WARM_START_JITTER_SCALE``
replaces the 1e-4.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

from rlflow.cache import cache_dir

SHIPPED = Path(__file__).parent / "warm_starts"


def _load(module, file: Path) -> None:
    from safetensors.torch import load_model

    load_model(module, str(file), strict=True)


def _save(module, file: Path, key_text: str) -> None:
    from safetensors.torch import save_model

    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f"{file.name}.{os.getpid()}.tmp")  # one per process: several ranks may warm up at once
    save_model(module, str(tmp), metadata={"key": key_text})
    tmp.replace(file)  # atomic: a concurrent run never reads half a file


def shipped_file(name: str, key: dict) -> Path | None:
    """The shipped warm start for ``key`` (which holds ``seed``), if rlflow has one made for exactly this key."""
    from safetensors import safe_open

    file = SHIPPED / f"{name}-seed{key['seed']}.safetensors"
    if not file.is_file():
        return None
    with safe_open(str(file), "pt") as f:
        made_for = (f.metadata() or {}).get("key")
    return file if made_for == json.dumps(key, sort_keys=True) else None


JITTER = "RLFLOW_WARM_START_JITTER"


def _jitter(module) -> None:
    import torch

    k, scale = int(os.environ.get(JITTER) or 0), float(os.environ.get(f"{JITTER}_SCALE") or 1e-4)
    if k:
        gen = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for p in module.parameters():
                p.mul_(1 + scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def load_or_make(name: str, key: dict, module, make: Callable[[], str], log=print, *, ship: bool = False) -> None:
    """Fill ``module`` with the warm start ``key`` describes: shipped, cached, or made by ``make()`` (which
    trains ``module`` in place and returns a line for ``log``) and then cached. ``ship`` writes the shipped
    file instead (``python -m rlflow.tasks.warm_start``)."""
    import torch
    import transformers

    key_text = json.dumps(key, sort_keys=True)
    shipped = None if ship else shipped_file(name, key)
    if shipped is not None:
        _load(module, shipped)
        _jitter(module)
        log(f"warm start: {shipped.name}, shipped with rlflow")
        return
    versions = json.dumps({"key": key_text, "torch": torch.__version__, "transformers": transformers.__version__})
    cached = cache_dir() / f"{name}-warm-{hashlib.sha256(versions.encode()).hexdigest()[:16]}.safetensors"
    if cached.exists() and not ship:
        _load(module, cached)
        _jitter(module)
        log(f"warm start: loaded {cached}")
        return
    line = make()
    target = SHIPPED / f"{name}-seed{key['seed']}.safetensors" if ship else cached
    _save(module, target, key_text)
    _jitter(module)
    log(f"{line}; {'shipped as' if ship else 'cached at'} {target}")


if __name__ == "__main__":  # python -m rlflow.tasks.warm_start: remake the shipped warm starts (the addition
    # task's seeds 0-2, the shapes and calculator tasks' seed 0). The tasks import this module: only the script
    # imports them, so importing this module never imports a task.
    from rlflow.tasks.addition import AdditionTask, warm_started_model
    from rlflow.tasks.calculator import CalculatorTask
    from rlflow.tasks.calculator import warm_started_model as calculator_warm_start
    from rlflow.tasks.shapes import ShapesTask, warm_started_policy

    for seed in (0, 1, 2):
        warm_started_model(AdditionTask(), seed, ship=True)
    warm_started_policy(ShapesTask(), 0, ship=True)
    calculator_warm_start(CalculatorTask(), 0, ship=True)
