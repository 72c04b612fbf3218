"""The ``extract`` step of ``scripts/verl_examples.py`` (developer, once: needs verl's git):

    python scripts/verl_examples.py extract [--repo DIR] [--commit 1dda039]

runs every ``examples/**/*.sh`` of a verl commit with ``bash`` in a scratch copy of the repository, with a PATH of
shims, so that bash itself does all the variable expansion: ``python``/``python3`` record their argv when it runs
``-m verl.trainer.main_ppo`` (and exit 0), ``uv run``/``ray job submit --``/``torchrun`` hand the wrapped command
on, ``python3 -c`` probes fail (no ``torch_npu``: the GPU branch of each script), and downloads, ``mkdir``, ``git``,
``nvidia-smi`` and any other command are no-ops. It writes ``tests/config/verl_examples/commands.json``, which the
``check`` step (``scripts/verl_examples.py``) reads.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "tests" / "config" / "verl_examples"
COMMANDS = HERE / "commands.json"
MIRROR = Path("/work/.mirror/verl-project+verl/repo")
ENTRY = "verl.trainer.main_ppo"

RECORDER = """import json, os, sys
with open(os.environ["VERL_EXAMPLES_LOG"], "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd()}) + "\\n")
"""

# name -> bash body; "$REC" is the recorder, "$SHIMS" this folder.
SHIMS = {
    # python: record `-m verl.trainer.main_ppo ...`; `-c` import probes fail (torch_npu is not installed)
    "python": """for ((i = 1; i < $#; i++)); do
  if [ "${!i}" = -m ]; then j=$((i + 1)); [ "${!j}" = verl.trainer.main_ppo ] && exec "$REALPY" "$REC" "$@"; fi
done
[ "${1:-}" = -c ] && exit 1
echo "python $*" >> "$VERL_EXAMPLES_STUBS"; exit 0""",
    # uv run [flags] python3 ...: the wrapped python
    "uv": """while [ $# -gt 0 ] && [[ "$1" != python* ]]; do shift; done
[ $# -gt 0 ] && exec "$SHIMS/$@"; exit 0""",
    # ray job submit [flags] -- CMD: the wrapped command; any other ray command: nothing
    "ray": """while [ $# -gt 0 ] && [ "$1" != -- ]; do shift; done
[ $# -gt 1 ] && { shift; exec "$@"; }; exit 0""",
    # torchrun [flags] -m MODULE ...: python -m MODULE ...
    "torchrun": """while [ $# -gt 0 ] && [ "$1" != -m ]; do shift; done
[ $# -gt 0 ] && exec "$SHIMS/python" "$@"; exit 0""",
    "date": """exec /bin/date -d '2026-08-22 00:00:00' "$@\"""",  # a fixed date: experiment names stay the same
    "tee": "exec cat",
}
NO_OPS = ("mkdir", "git", "wget", "curl", "pip", "pip3", "hf", "huggingface-cli", "modelscope", "nvidia-smi",
          "npu-smi", "sleep", "rm", "cp", "ln")
# any other command is a no-op too; `ulimit -n 65535` may be refused here (not on a GPU node): not fatal
BASH_ENV = """command_not_found_handle() { echo "$*" >> "$VERL_EXAMPLES_STUBS"; return 0; }
ulimit() { builtin ulimit "$@" 2>/dev/null || true; }
"""
# Variables a few scripts need from the user (they stop with `VAR: unbound variable` / `${VAR:?...}`): set only
# when the script asks for one, then it is run again; commands.json's "env" says which script got which.
ENV_NEEDED = {"HDFS_ROOT": "{HOME}/hdfs", "DATA_ROOT": "{HOME}/data", "RAY_DATA_HOME": "{HOME}/verl",
              "LORA_ADAPTER_PATH": "{HOME}/lora_adapter", "MODEL_PATH": "{HOME}/models/model",
              "INFER_BACKEND": "vllm"}  # vllm: the default the script itself sets one line too late


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def make_shims(folder: Path) -> None:
    folder.mkdir()
    (folder / "record.py").write_text(RECORDER)
    bodies = {**{name: 'echo "$(basename "$0") $*" >> "$VERL_EXAMPLES_STUBS"; exit 0' for name in NO_OPS}, **SHIMS}
    bodies["python3"] = bodies["python"]
    for name, body in bodies.items():
        (folder / name).write_text(f'#!/bin/bash\nREC="{folder}/record.py"; SHIMS="{folder}"\n{body}\n')
        (folder / name).chmod(0o755)


def run_script(root: Path, home: Path, shims: Path, script: str, timeout: float) -> tuple[list[dict], str, dict]:
    """``run_once`` again with each variable of ENV_NEEDED that the script stops for; also the variables set."""
    extra: dict[str, str] = {}
    while True:
        calls, reason, err = run_once(root, home, shims, script, timeout, extra)
        needed = re.search(r"line \d+: (\w+): (unbound variable|set |must set)", err)
        if calls or not needed or needed.group(1) not in ENV_NEEDED or needed.group(1) in extra:
            return calls, reason, extra
        extra[needed.group(1)] = ENV_NEEDED[needed.group(1)]


def run_once(root: Path, home: Path, shims: Path, script: str, timeout: float,
             extra: dict[str, str]) -> tuple[list[dict], str, str]:
    """The main_ppo calls of one script (argv with the scratch paths as ``{VERL}``/``{HOME}``, and the cwd
    relative to the repository root), why there are none (empty when there are), and its stderr."""
    log, stubs = root.parent / "calls.jsonl", root.parent / "stubs.log"
    log.write_text(""), stubs.write_text("")
    env = {**{k: v.replace("{HOME}", str(home)) for k, v in extra.items()}, "PATH": f"{shims}:/usr/bin:/bin",
           "HOME": str(home), "LANG": "C.UTF-8", "REALPY": sys.executable, "BASH_ENV": str(root.parent / "bash_env"),
           "VERL_EXAMPLES_LOG": str(log), "VERL_EXAMPLES_STUBS": str(stubs), "TMPDIR": str(root.parent / "tmp")}
    try:
        proc = subprocess.run(["bash", script], cwd=root, env=env, capture_output=True, text=True, timeout=timeout,
                              check=False)
        status = f"exit status {proc.returncode}" if proc.returncode else ""
    except subprocess.TimeoutExpired as e:
        proc, status = e, f"timed out after {timeout:.0f} s"
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    for call in calls:
        call["argv"] = [placeholders(a, root, home) for a in call["argv"][call["argv"].index(ENTRY) + 1:]]
        call["cwd"] = placeholders(call["cwd"], root, home).replace("{VERL}", ".").lstrip("/") or "."
    err = proc.stderr or ""
    err = err.decode(errors="replace") if isinstance(err, bytes) else err
    if calls:
        return calls, "", err
    other = [c for c in stubs.read_text().splitlines() if c.startswith("python") and " -m verl." in c]
    if other:
        module = re.search(r" -m (verl\.\S+)", other[0]).group(1)
        return [], f"runs {module}, not {ENTRY}", err
    last = [line for line in err.splitlines() if line and not line.startswith("+")][-2:]
    return [], f"no {ENTRY} command ran ({status or 'exit status 0'}): " + (" | ".join(last) or "no message"), err


def placeholders(text: str, root: Path, home: Path) -> str:
    return text.replace(str(home), "{HOME}").replace(str(root), "{VERL}")


def extract(args: argparse.Namespace) -> int:
    repo, commit = Path(args.repo), git(Path(args.repo), "rev-parse", args.commit).strip()
    date = git(repo, "show", "-s", "--format=%cI", commit).strip()
    scripts = sorted(p for p in git(repo, "ls-tree", "-r", "--name-only", commit, "examples").splitlines()
                     if p.endswith(".sh"))
    result = {"verl_repo": "https://github.com/verl-project/verl", "commit": commit, "commit_date": date,
              "made": f"python scripts/verl_examples.py extract --commit {commit[:7]}: every examples/**/*.sh that "
                      f"names {ENTRY}, run by bash in a scratch checkout with shims (see the script's docstring); "
                      "{VERL} is the repository root, {HOME} the home folder",
              "made_on": time.strftime("%Y-%m-%d"), "commands": {}, "cwd": {}, "env": {}, "no_command": {}}
    with tempfile.TemporaryDirectory(prefix="verl-examples-") as tmp:
        tmp = Path(tmp)
        root, home = tmp / "verl", tmp / "home"
        for folder in (root, home, tmp / "tmp"):
            folder.mkdir()
        archive = subprocess.run(["git", "-C", str(repo), "archive", commit], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
        make_shims(tmp / "bin")
        (tmp / "bash_env").write_text(BASH_ENV)
        for script in scripts:
            if ENTRY not in (root / script).read_text(errors="replace"):
                continue
            calls, reason, extra = run_script(root, home, tmp / "bin", script, args.timeout)
            if extra:
                result["env"][script] = extra
            if reason:
                result["no_command"][script] = reason
            result["commands"][script] = [c["argv"] for c in calls]
            if any(c["cwd"] != "." for c in calls):
                result["cwd"][script] = [c["cwd"] for c in calls]
            print(f"{script}: {len(calls)} command(s){' - ' + reason if reason else ''}", file=sys.stderr)
    HERE.mkdir(parents=True, exist_ok=True)
    (HERE / "LICENSE").write_text(git(repo, "show", f"{commit}:LICENSE"))
    COMMANDS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{len(result['commands'])} scripts, {sum(map(len, result['commands'].values()))} commands, "
          f"{len(result['no_command'])} without one -> {COMMANDS}")
    return 0
