"""The verl-compatible command: ``python -m rlflow.trainer.main_ppo [--config-path P --config-name N]
[--dry-run] key=value ...`` (and ``rlflow train`` with overrides).

Loads and validates the config, makes the plan, then either prints the dry-run report or builds the
Trainer and trains: validation before training when ``trainer.val_before_train``, ``fit``, and the
checkpoints of ``trainer.save_freq`` under ``trainer.default_local_dir``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from pathlib import Path

from typing import TYPE_CHECKING

from rlflow.config import components, components_run
from rlflow.config.verl.devices import check_launcher, resolve_devices
from rlflow.config.verl.key_notes import unused_notes  # also importable from here, as before
from rlflow.config.verl.loading import ConfigError, VerlConfig, load_config, raise_problems
from rlflow.config.verl.native import NATIVE, load_native
from rlflow.config.verl.validate import validate
from rlflow.config.verl.configs import bundled_name
from rlflow.launch import rollout_pool
from rlflow.launch.ray import RayLaunchError, run_workers  # light: Ray itself is imported where used
from rlflow.logs import quiet_other_ranks
from rlflow.trainer import training_state as ckpt
from rlflow.trainer.training_state import CheckpointError  # light: the checkpoint module imports torch where used
from rlflow.trainer.determinism import full_determinism  # light too

if TYPE_CHECKING:
    from rlflow.config.verl.plan import Plan

USAGE = ("python -m rlflow.trainer.main_ppo [--config-path DIR --config-name NAME] [--dry-run [--show-config]] "
         "key=value ...")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rlflow.trainer.main_ppo", usage=USAGE,
                                     description="Train with verl's config keys (Hydra override syntax).")
    parser.add_argument("--config-path", "-cp", default=None, help="folder of the YAML file (relative to the cwd)")
    parser.add_argument("--config-name", "-cn", default=None, help="YAML file name, with or without .yaml")
    parser.add_argument("--config", "-c", default=None, help="an rlflow native recipe file (see docs)")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate config and data, print what would be built, batch arithmetic and cost, stop")
    parser.add_argument("--show-config", action="store_true",
                        help="with --dry-run: also print the full resolved config")
    parser.add_argument("overrides", nargs="*", help="key=value, +key=value, key=[a,b]")
    args = parser.parse_intermixed_args(argv)  # overrides before and after the flags
    if args.config_name is None and args.config_path is not None:
        parser.error("--config-path needs --config-name")
    if args.show_config and not args.dry_run:
        parser.error("--show-config goes with --dry-run (a run writes the resolved config to <run dir>/config.yaml)")
    if args.config and args.config_name:
        parser.error("use either --config (rlflow native) or --config-path/--config-name (verl), not both")
    return args


def config_file(config_path: str | None, config_name: str) -> Path:
    """``--config-path``/``--config-name`` -> a YAML path (relative paths are taken from the cwd)."""
    name = config_name if config_name.endswith((".yaml", ".yml")) else f"{config_name}.yaml"
    path = Path(config_path or ".").expanduser() / name
    if not path.is_file():
        raise ConfigError(f"--config-path {config_path} --config-name {config_name}: no such file {path}")
    return path


def load(args: argparse.Namespace, problems: list[ConfigError] | None = None) -> VerlConfig:
    """The config of the command line; with ``problems``, its key and type problems are collected there."""
    if args.config:
        return load_native(args.config, args.overrides, problems)
    bundled = bundled_name(args.config_name) if args.config_name else None
    if bundled and not (Path(args.config_path or ".").expanduser() / f"{bundled}.yaml").is_file():
        return load_config(args.overrides, bundled=bundled, problems=problems)  # verl's own, as verl reads it
    file = config_file(args.config_path, args.config_name) if args.config_name else None
    return load_config(args.overrides, config_file=file, problems=problems)


def load_and_check(args: argparse.Namespace) -> VerlConfig:
    """Load and validate the whole config (files and model folders too) without importing torch;
    every problem is raised at once, in one :class:`ConfigError`."""
    problems: list[ConfigError] = []
    cfg = load(args, problems)
    problems += validate(cfg, environment=True, dry_run=args.dry_run)
    raise_problems(recipe_names(problems) if args.config else problems)
    cfg.validated = True
    return cfg


def recipe_names(problems: list[ConfigError]) -> list[ConfigError]:
    """A recipe's values are checked under the verl keys they stand for; a message about one also starts
    with the key the recipe wrote (``rollout.n: actor_rollout_ref.rollout.n=0: must be >= 1``)."""
    verl_to_native = {verl: native for native, verl in NATIVE.items()}
    for problem in problems:
        text = str(problem)
        key = re.match(r"[\w.]+", text)
        native = verl_to_native.get(key.group(0)) if key else None
        if native and native != key.group(0):
            problem.args = (f"{native}: {text}",)
    return problems


def print_notes(notes: list[str]) -> None:
    for note in notes:
        print(f"[rlflow] note: {note}", flush=True)


def train(plan: Plan, started: float | None = None) -> list[dict]:
    """Build the Trainer from the plan and run it the way verl's main_ppo does; the summary line's setup
    time counts from ``started`` (a ``time.perf_counter()``; default: now). With a ``full_determinism`` key on,
    from building to the end of fit (:mod:`rlflow.trainer.determinism`)."""
    with full_determinism(**plan.determinism) if plan.determinism else contextlib.nullcontext():
        return _train(plan, started)


def _train(plan: Plan, started: float | None) -> list[dict]:
    started = time.perf_counter() if started is None else started
    from rlflow.config.verl.build import build_trainer, run_notes

    run_dir = Path(plan.trainer_kwargs["run_dir"]).expanduser()
    try:  # before the model loads
        ckpt.check_run_dir(run_dir)
    except ckpt.CheckpointError as e:
        raise ConfigError(f"trainer.default_local_dir: {e}") from None
    trainer, data = build_trainer(plan)
    print_notes(run_notes(plan, data, trainer))
    (run_dir / "config.yaml").write_text(plan.cfg.to_yaml())
    for logger in trainer.fabric.loggers:  # the config as params where a logger keeps them (MLflow's, as verl's)
        if getattr(logger, "logs_config", False):
            logger.log_hyperparams(plan.cfg.tree)
    before, t0 = {}, time.perf_counter()
    setup_s = t0 - started  # config checks, imports, model and data loading
    if data.val and (plan.val_before_train or plan.val_only):
        resume = trainer.resume
        start = ckpt.latest_checkpoint(trainer.checkpoint_dir) if resume == "auto" else resume
        if start is not None:  # validate the weights training resumes from, as verl does
            trainer.load(start)
        before = trainer.validate(data)
        trainer.fabric.log_dict(before, step=trainer.global_step)
        if plan.val_only:
            return [before]
    elif plan.val_only:
        raise ConfigError("trainer.val_only=True needs data.val_files")
    validation_s, t0 = time.perf_counter() - t0, time.perf_counter()
    history = trainer.fit(data)
    trainer.fabric.print(summary_line(plan, history, before, time.perf_counter() - t0, validation_s, run_dir,
                                     setup_s))
    return history


def summary_line(plan: Plan, history: list[dict], before: dict, fit_s: float, validation_s: float,
                 run_dir: Path, setup_s: float = 0.0) -> str:
    """The line a config run ends with, as the default job's: steps and time (RL apart from setup and
    validation), held-out metrics before -> after, and where the metrics are."""
    in_fit = sum(m.get("timing_s/testing", 0.0) for m in history)
    parts = [f"[rlflow] {len(history)} RL step{'' if len(history) == 1 else 's'} ({plan.estimator_cls.__name__}) in {fit_s - in_fit:.0f} s "
             f"(+ setup {setup_s:.0f} s, validation {validation_s + in_fit:.0f} s)"]
    last = next((m for m in reversed(history) if any(k.startswith("val-core/") for k in m)), {})
    for key in sorted(k for k in {**before, **last} if k.startswith("val-core/")):
        parts.append(f"{key}: {before[key]:.2f} -> {last[key]:.2f}" if key in before and key in last else
                     f"{key}: {last[key]:.2f}" if key in last else f"{key}: {before[key]:.2f} (before training)")
    where = run_dir / "metrics.jsonl" if "jsonl" in plan.loggers else run_dir
    return "; ".join(parts) + f"; metrics in {where}"


def launch(plan: Plan, argv: list[str]) -> int:
    """Re-run this command under torchrun with one process per device (CPU processes use gloo).

    One node is launched from here; for several nodes, start ``torchrun`` on each node yourself
    (:func:`rlflow.config.verl.devices.check_launcher` says so; docs/multi-node.md) and this command runs as one of
    its workers, or run this command with a Ray cluster running (:func:`launch_on_ray`).
    """
    from torch.distributed.run import main as torchrun

    print(f"[rlflow] launching {plan.devices.processes} processes with torchrun", flush=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per process (torchrun's choice, without its banner)
    try:
        torchrun(["--nproc_per_node", str(plan.devices.processes), "-m", "rlflow.trainer.main_ppo", *argv])
    except Exception as e:  # torchrun raises ChildFailedError after every worker has been stopped
        print(f"rlflow: a training process failed: {e}", file=sys.stderr)
        return 1
    return 0


def launch_on_ray(cfg: VerlConfig, argv: list[str], address: str) -> int:
    """``trainer.nnodes>1`` with a Ray cluster: this command's workers placed on it (:mod:`rlflow.launch.ray`).

    The config was validated; the plan is made by each worker (as under torchrun), not here too."""
    devices = resolve_devices(cfg, [], with_critic=False, record=False)
    use_gpu = devices.accelerator == "cuda"
    try:
        pool = rollout_pool.pool_from_config(cfg.flat, use_gpu)  # rollout.nnodes>0: vLLM servers of their own
    except ValueError as e:
        print(f"rlflow: config error: {e}", file=sys.stderr)
        return 2
    try:
        return run_workers(address, devices.nnodes, devices.per_node, argv, use_gpu=use_gpu, pool=pool)
    except RayLaunchError as e:
        print(f"rlflow: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code. Config errors print one clear message and return 2."""
    started = time.perf_counter()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.config and components.is_tree_file(args.config):  # a component tree (_target_ nodes): its own path
        return components_run.main(args.config, args.overrides, args.dry_run, args.show_config, started)
    quiet_other_ranks()  # under torchrun: each warning and bar once (rank 0), not once per process
    try:
        cfg = load_and_check(args)  # before anything heavy: a config error comes back in about a second
        cluster = None
        if not args.dry_run:  # several nodes: torchrun on each, or a Ray cluster; a torchrun job must match the config
            cluster = check_launcher(cfg.flat.get("trainer.n_gpus_per_node"), cfg.flat.get("trainer.nnodes"),
                                     ray_address=cfg.flat.get("ray_kwargs.ray_init.address"),
                                     rollout_nodes=cfg.flat.get("actor_rollout_ref.rollout.nnodes") or 0)
        if cluster is not None:  # the driver of a Ray job: its workers make the plan (a torch import saved here)
            return launch_on_ray(cfg, sys.argv[1:] if argv is None else argv, cluster)
        from rlflow.config.verl.plan import make_plan

        plan = make_plan(cfg)
        if args.dry_run:
            from rlflow.config.verl.dryrun import dry_run

            report, problems = dry_run(plan, show_config=args.show_config)
            print(report)
            return 1 if problems else 0
        if plan.devices.processes > 1 and "LOCAL_RANK" not in os.environ:
            return launch(plan, sys.argv[1:] if argv is None else argv)
        train(plan, started)
    except ConfigError as e:
        print(f"rlflow: config error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:  # a checkpoint that cannot be read or written: the message names it
        print(f"rlflow: checkpoint error: {e}", file=sys.stderr)
        return 1
    return 0
