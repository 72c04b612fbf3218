"""``rlflow launch --slurm``: an sbatch script for a multi-node job, in prime-rl's shape.

The allocation's first ``--nodes`` nodes train: one ``srun`` task per node runs ``torchrun`` (``--nproc_per_node``
= ``--gpus-per-node``), meeting at a c10d rendezvous on the first of them. ``--rollout-nodes`` more nodes each
run a vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server``); the script waits until they answer
and passes the URL to the trainer (``actor_rollout_ref.rollout.server.url``). The trainer sends new weights to
the server through a folder both can read (``rollout.server.checkpoint_dir``): on several nodes, a shared
file system. No launcher of rlflow's own: SLURM places, torchrun rendezvous, vLLM serves.

Lines marked ``FILL IN`` are the site's: the environment to activate, the partition/account, the shared folder.
``--dry-run`` writes the script and prints it; without it the script is also submitted with ``sbatch``.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

FILL_IN = "# FILL IN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--slurm", action="store_true", required=True,
                        help="write an sbatch script (the only launcher so far; Ray is planned)")
    parser.add_argument("--nodes", type=int, required=True, help="trainer nodes (trainer.nnodes)")
    parser.add_argument("--gpus-per-node", type=int, required=True, help="trainer processes per node (trainer.n_gpus_per_node)")
    parser.add_argument("--rollout-nodes", type=int, default=0,
                        help="nodes running a vLLM server each (0: the trainer generates in-process); one for now")
    parser.add_argument("--rollout-model", default=None,
                        help="the model the servers load (default: actor_rollout_ref.model.path of the overrides)")
    parser.add_argument("--rollout-args", default="",
                        help="more arguments for the vLLM server, e.g. '--max-model-len 4096 --gpu-memory-utilization 0.9'")
    parser.add_argument("--shared-dir", default=None,
                        help="a folder every node reads and writes (run dir, weights for the servers); default: a "
                             "FILL IN placeholder")
    parser.add_argument("--job-name", default="rlflow")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--account", default=None)
    parser.add_argument("--time", default="24:00:00", help="the job's time limit (sbatch --time)")
    parser.add_argument("--rdzv-port", type=int, default=29500, help="the c10d rendezvous port on the first node")
    parser.add_argument("--rollout-port", type=int, default=8000)
    parser.add_argument("--out", default="rlflow.sbatch", help="where the script goes")
    parser.add_argument("--dry-run", action="store_true", help="write and print the script; do not submit it")
    parser.add_argument("overrides", nargs="*", help="verl keys for the trainer (key=value), as for rlflow train")


class LaunchError(ValueError):
    pass


def sbatch_script(args: argparse.Namespace) -> str:
    if args.nodes < 1 or args.gpus_per_node < 1 or args.rollout_nodes < 0:
        raise LaunchError(f"--nodes {args.nodes} --gpus-per-node {args.gpus_per_node} --rollout-nodes "
                          f"{args.rollout_nodes}: the first two must be >= 1, the last >= 0")
    if args.rollout_nodes > 1:
        raise LaunchError(f"--rollout-nodes {args.rollout_nodes}: the trainer's server rollout talks to one server "
                          "(actor_rollout_ref.rollout.server.url) until it can balance over several; use 1")
    for item in args.overrides:
        if "=" not in item:
            raise LaunchError(f"{item!r}: trainer overrides are key=value")
        key = item.lstrip("+").split("=", 1)[0]
        if key in ("trainer.nnodes", "trainer.n_gpus_per_node"):
            raise LaunchError(f"{item}: the script sets {key} from --nodes/--gpus-per-node")
    keys = dict(item.lstrip("+").split("=", 1) for item in args.overrides)
    model = args.rollout_model or keys.get("actor_rollout_ref.model.path")
    if args.rollout_nodes and not model:
        raise LaunchError("--rollout-nodes needs the model the servers load: --rollout-model PATH or "
                          "actor_rollout_ref.model.path=PATH")
    total = args.nodes + args.rollout_nodes
    shared = args.shared_dir or "/path/to/shared"
    header = [f"#SBATCH --job-name={args.job_name}", f"#SBATCH --nodes={total}", "#SBATCH --ntasks-per-node=1",
              f"#SBATCH --gpus-per-node={args.gpus_per_node}", f"#SBATCH --time={args.time}",
              f"#SBATCH --output={args.job_name}-%j.out"]
    header += [f"#SBATCH --partition={args.partition}" if args.partition else
               f"{FILL_IN}: #SBATCH --partition=... (remove the '# FILL IN: ' to use it)"]
    header += [f"#SBATCH --account={args.account}"] if args.account else []
    trainer_keys = [f"trainer.nnodes={args.nodes}", f"trainer.n_gpus_per_node={args.gpus_per_node}"]
    if "trainer.default_local_dir" not in keys:
        trainer_keys.append(f"trainer.default_local_dir=$SHARED/runs/{args.job_name}")
    lines = [
        "#!/bin/bash",
        f"# rlflow launch --slurm: {args.nodes} trainer node(s) x {args.gpus_per_node} GPU(s)"
        + (f", {args.rollout_nodes} vLLM server node(s)" if args.rollout_nodes else "") + " (docs/multi-node.md)",
        *header,
        "set -euo pipefail",
        "",
        f"{FILL_IN}: the environment every node runs in (module load ..., source .venv/bin/activate)",
        f"SHARED={shlex.quote(shared)}  " + (f"{FILL_IN}: a folder every node can read and write" if not args.shared_dir
                                              else "# read and written by every node"),
        "",
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f'TRAIN_NODES=$(IFS=,; echo "${{NODES[*]:0:{args.nodes}}}")',
        'HEAD=${NODES[0]}  # the rendezvous: torchrun on every trainer node meets here',
    ]
    if args.rollout_nodes:
        server = (f"python -m vllm.entrypoints.openai.api_server --model {shlex.quote(model)} "
                  f"--host 0.0.0.0 --port {args.rollout_port} {args.rollout_args}").rstrip()
        lines += [
            "",
            "# the rollout servers: one per node after the trainer nodes (VLLM_SERVER_DEV_MODE: the endpoints",
            "# that reload weights and reset the prefix cache)",
            f'ROLLOUT=${{NODES[{args.nodes}]}}',
            f'srun --nodes=1 --ntasks=1 -w "$ROLLOUT" --export=ALL,VLLM_SERVER_DEV_MODE=1 {server} &',
            "SERVER=$!",
            f'URL=http://$ROLLOUT:{args.rollout_port}',
            'until curl -sf "$URL/health" > /dev/null; do  # until the model is loaded',
            '    kill -0 "$SERVER" 2> /dev/null || { echo "the vLLM server on $ROLLOUT exited" >&2; exit 1; }',
            "    sleep 10",
            "done",
        ]
        trainer_keys += ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.server.url=$URL",
                         "actor_rollout_ref.rollout.server.checkpoint_dir=$SHARED/weights/$SLURM_JOB_ID"]
    overrides = " ".join(shlex.quote(o) for o in args.overrides)
    lines += [
        "",
        f"# the trainer: torchrun on each of the {args.nodes} trainer node(s), {args.gpus_per_node} process(es) each",
        f'srun --nodes={args.nodes} --ntasks={args.nodes} --ntasks-per-node=1 -w "$TRAIN_NODES" \\',
        f"    torchrun --nnodes={args.nodes} --nproc_per_node={args.gpus_per_node} --rdzv-backend=c10d "
        f'--rdzv-endpoint="$HEAD:{args.rdzv_port}" --rdzv-id="$SLURM_JOB_ID" \\',
        f"    -m rlflow.trainer.main_ppo {' '.join(trainer_keys)}" + (f" \\\n    {overrides}" if overrides else ""),
    ]
    if args.rollout_nodes:
        lines.append('kill "$SERVER" 2> /dev/null || true  # the server, once training is done')
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    try:
        script = sbatch_script(args)
    except LaunchError as e:
        print(f"rlflow launch: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.write_text(script)
    out.chmod(0o755)
    if args.dry_run:
        print(script, end="")
        print(f"[rlflow] wrote {out} (not submitted: --dry-run); fill in the lines marked '{FILL_IN}'",
              file=sys.stderr)
        return 0
    if shutil.which("sbatch") is None:
        print(f"rlflow launch: wrote {out}, but sbatch is not on PATH: submit it from a SLURM login node "
              f"(sbatch {out}), or use --dry-run", file=sys.stderr)
        return 2
    return subprocess.run(["sbatch", str(out)]).returncode
