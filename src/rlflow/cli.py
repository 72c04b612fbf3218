"""The ``rlflow`` command. ``rlflow train`` with no arguments runs the default job."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlflow", description="Reinforcement-learning post-training for language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train; with no arguments, GRPO on the built-in addition task (CPU, minutes)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--steps", type=int, default=500, help="RL steps (default 500)")
    train.add_argument("--run-dir", default=None, help="where metrics, checkpoints and the reward curve go")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    if args.command == "train":
        from rlflow.tasks.default_job import run

        run(seed=args.seed, steps=args.steps, run_dir=args.run_dir or f"runs/default-seed{args.seed}",
            progress=not args.no_progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
