"""``rlflow train TREE.yaml [key=value ...] [--dry-run [--show-config]]`` for a component-tree recipe
(:mod:`rlflow.config.components`); ``--config TREE.yaml`` and ``python -m rlflow.trainer.main_ppo --config`` come
here too when the file is a tree.

The tree is loaded and checked first (every problem in one message, before any model or data is loaded). The dry
run prints the Python the tree is (:mod:`rlflow.config.components_python`); a run builds the Trainer and the data
from it, writes the resolved tree to ``<run dir>/config.yaml``, trains with ``fit`` and ends with one summary line.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import yaml
from hydra.errors import InstantiationException

from rlflow.config import components
from rlflow.config.components_python import python
from rlflow.config.errors import ConfigError, raise_problems
from rlflow.roles import Rollout, optional


def dry_run(path: str | Path, overrides: list[str], show_config: bool = False) -> str:
    """The dry run's report: the (resolved) tree on request, then the Python it builds."""
    tree = components.load(path, overrides)
    base_dir = Path(path).expanduser().parent
    raise_problems(components.check(tree, base_dir))
    shown = [f"Component tree {path}:", yaml.safe_dump(tree, sort_keys=False).rstrip(), ""] if show_config else []
    return "\n".join([*shown, f"Dry run: the component tree {path} is valid. The Python it builds "
                               "(nothing was built):", "", python(tree, base_dir)])


def train(path: str | Path, overrides: list[str], started: float | None = None) -> list[dict]:
    """Build the tree's Trainer and data, train, print the summary line; returns ``fit``'s history."""
    started = time.perf_counter() if started is None else started
    tree = components.load(path, overrides)
    trainer, data = components.build(tree, Path(path).expanduser().parent)
    try:
        trainer.run_dir.mkdir(parents=True, exist_ok=True)
        (trainer.run_dir / "config.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
        t0 = time.perf_counter()
        history = trainer.fit(data)
    finally:
        close = optional(trainer.rollout, Rollout, "close")
        if close is not None:  # an asynchronous rollout's engine process
            close()
    fit_s = time.perf_counter() - t0
    trainer.fabric.print(f"[rlflow] {len(history)} RL step{'' if len(history) == 1 else 's'} "
                         f"({type(trainer.estimator).__name__}) in {fit_s:.0f} s (+ setup {t0 - started:.0f} s); "
                         f"metrics in {trainer.run_dir}")
    return history


def main(path: str | Path, overrides: list[str], dry: bool = False, show_config: bool = False,
         started: float | None = None) -> int:
    """The command; returns its exit code (2 and one message on stderr for a config error)."""
    try:
        if dry:
            print(dry_run(path, overrides, show_config))
        else:
            train(path, overrides, started)
    except ConfigError as e:
        print(f"rlflow: config error: {e}", file=sys.stderr)
        return 2
    except InstantiationException as e:  # a constructor refused its arguments: Hydra's message names the node
        print(f"rlflow: building the component tree failed: {e}", file=sys.stderr)
        return 2
    return 0
