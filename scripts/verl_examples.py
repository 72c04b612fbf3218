"""verl's own example scripts through rlflow's verl entry point: what a verl user gets after `s/verl/rlflow/`.

    python scripts/verl_examples.py extract [--repo DIR] [--commit 1dda039]   # developer, once: needs verl's git
    python scripts/verl_examples.py check [--markdown] [--only SUBSTR] [-v]   # CI: no verl needed

``extract`` (``scripts/verl_examples_extract.py``) runs every ``examples/**/*.sh`` of a verl commit with ``bash``
and shims, and records each ``verl.trainer.main_ppo`` command, as bash expanded it, in
``tests/config/verl_examples/commands.json``.

``check`` rewrites each recorded command only for paths (model, data, stand-in files, output folders) and device
counts (one CPU, every parallel size 1), runs ``rlflow.config.verl.run.main([... '--dry-run'])`` in this process for
each, and reports accepted / refused with the problems rlflow printed, and a tally of the blocking keys.
``tests/config/verl_examples/README.md`` says exactly what is rewritten; ``tests/config/test_verl_examples.py``
runs it in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
for _folder in (REPO, SCRIPTS):  # the suite's tiny-fixture builders (tests/config/conftest.py, tests/vlm.py); extract
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

from verl_examples_extract import COMMANDS, ENTRY, MIRROR, extract  # noqa: E402  (beside this file)

# ------------------------------------------------------------------------------------------------- check

# Rewritten keys (a key is the dotted name without its +/++/~ prefix). Everything else stays as verl wrote it.
MODEL_KEYS = re.compile(r"(^|\.)(model\.path|model_path|tokenizer_path)$")
REWARD_MODEL_KEYS = ("reward_model.model.path", "reward.reward_model.model_path")  # a scoring head, not an LM
DATA_KEYS = ("data.train_files", "data.val_files")
REWARD_FILE_KEYS = ("custom_reward_function.path", "reward.custom_reward_function.path")
DATASET_CLASS_KEY = "data.custom_cls.path"
OUTPUT_KEYS = re.compile(r"^trainer\.default_local_dir$|_data_dir$|^global_profiler\.save_path$")
ONE = re.compile(r"(^|\.)(n_gpus_per_node|nnodes|num_replicas|\w*parallel_size|tp|pp|ep|cp|etp)$")
NULL = re.compile(r"(^|\.)(virtual_pipeline_model_parallel_size|vpp)$")
ALL_DEVICES = re.compile(r"(^|\.)fsdp_size$")  # verl's -1: every device (8 of one device cannot be)
MTP_MODEL = re.compile(r"MiMo-7B")  # a checkpoint with multi-token prediction layers (rlflow.models.mimo)
VISION_MODEL = re.compile(r"-VL|_vl|vl-|GLM-4\.1V|MiniCPM-o|MiniCPM-V", re.IGNORECASE)
# data file name -> (data_source its verl preprocessing script writes, kind); the first match wins
DATASETS = [("geo3k", "hiyouga/geometry3k", "image"),
            ("openr1mm", "lmms-lab/multimodal-open-r1-8k-verified", "image"), ("video", "tinyllava-video-r1", "video"),
            ("gsm8k", "openai/gsm8k", "text"),
            ("math/", "DigitalLearningGmbH/MATH-lighteval", "text"), ("dapo", "math_dapo", "text"),
            ("aime", "math_dapo", "text"), ("hh_rlhf", "Dahoas/full-hh-rlhf", "text"), ("rlla", "rlla", "text")]
DEFAULT_DATASET = ("openai/gsm8k", "text")
VERL_TRAIN_BATCH = 1024  # verl's data.train_batch_size default: the training file needs that many rows
# The stand-in models' context: the longest prompt + response of the scripts is 257 k tokens (rotary positions:
# no weights grow with it, it is a number in config.json)
CONTEXT = 1 << 20
SIZES = {"hidden_size": 32, "num_heads": 2, "num_kv_heads": 1, "max_positions": CONTEXT, "seed": 0}


class Fixtures:
    """The tiny stand-ins, each made when first asked for, in ``root`` (kept there for the next check)."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _once(self, name, make):
        path = self.root / name
        return path if path.exists() else make(path)

    def model(self, kind: str) -> Path:
        makers = {"text": text_model, "image": vision_model, "reward": reward_model, "dist": dist_checkpoint_folder,
                  "adapter": lambda p: lora_adapter(p, self.model("text")), "mimo": lambda p: text_model(p, 1)}
        return self._once(kind, makers[kind])

    def data(self, source: str, kind: str, split: str, rows: int) -> Path:
        name = "{}-{}-{}-{}.parquet".format(re.sub(r"\W+", "_", source), kind, split, rows)
        return self._once(name, lambda p: write_rows(p, source, kind, split, rows, self.root))

    def dataset_file(self, name: str) -> Path:
        """A dataset class ``name`` with verl's contract (``RLHFDataset``'s arguments; items are the rows)."""
        return self._once(f"dataset_{name}.py", lambda p: (p.write_text(
            "import pandas as pd\nfrom torch.utils.data import Dataset\n\n\n"
            f"class {name}(Dataset):\n"
            "    def __init__(self, data_files, tokenizer, processor, config, max_samples=-1):\n"
            "        self.rows = pd.concat([pd.read_parquet(f) for f in data_files]).to_dict('records')\n\n"
            "    def __len__(self):\n        return len(self.rows)\n\n"
            "    def __getitem__(self, i):\n        return dict(self.rows[i])\n"), p)[1])

    def reward_file(self, name: str) -> Path:
        return self._once(f"reward_{name}.py", lambda p: (p.write_text(
            f"def {name}(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
            "    return float(ground_truth in solution_str)\n"), p)[1])


def text_model(folder: Path, mtp_layers: int = 0) -> Path:
    """The test suite's tiny model (tests/config/conftest.py), with a long context; MiMo-shaped with ``mtp_layers``."""
    from rlflow.models.mimo import save_tiny_mimo
    from rlflow.models.tiny import char_tokenizer, tiny_qwen2
    from tests.config.conftest import CHAT_TEMPLATE

    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    model = tiny_qwen2(len(tok), num_layers=1, intermediate_size=64, **SIZES)
    save_tiny_mimo(folder, model, mtp_layers) if mtp_layers else model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def vision_model(folder: Path) -> Path:
    from rlflow.models.tiny_vlm import save_model_folder, tiny_processor, tiny_qwen2_5_vl

    processor = tiny_processor()
    model = tiny_qwen2_5_vl(processor.tokenizer, **SIZES)
    return save_model_folder(model, processor, folder)


def reward_model(folder: Path) -> Path:
    from rlflow.models.tiny import char_tokenizer, tiny_qwen2_reward_model

    tok = char_tokenizer()
    tiny_qwen2_reward_model(len(tok), num_layers=1, intermediate_size=64, **SIZES).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def dist_checkpoint_folder(folder: Path) -> Path:
    """A stand-in for a Megatron dist checkpoint folder: megatron-core's ``metadata.json`` only (as its
    ``dist_checkpointing.save`` writes it). A dry run checks the folder and reads no weights; writing real ones
    would need megatron-core and a process group (``tests/megatron/test_megatron.py`` loads real ones)."""
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1, '
                                          '"common_backend": "torch", "common_backend_version": 1}')
    return folder


def lora_adapter(folder: Path, base: Path) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(folder)
    return folder


def write_rows(path: Path, source: str, kind: str, split: str, n: int, root: Path) -> Path:
    """``n`` rows in verl's layout: the suite's digit sums, with an image (or a video entry) for vision data."""
    import pandas as pd

    from tests.config.conftest import verl_rows

    rows = verl_rows(n, split, seed=0 if split == "train" else 1, source=source)
    if kind == "image":
        from tests.vlm import png

        picture = {"bytes": png(56, 56)}
        for row in rows:
            row["prompt"][0]["content"] = "<image>" + row["prompt"][0]["content"]
            row["images"] = [picture]
    elif kind == "video":  # verl's tinyllava_video_r1 layout: a path per row
        (root / "clip.mp4").write_bytes(b"")
        for row in rows:
            row["prompt"][0]["content"] = "<video>" + row["prompt"][0]["content"]
            row["videos"] = [{"video": str(root / "clip.mp4")}]
    pd.DataFrame(rows).to_parquet(path)
    return path


def dataset(path: str) -> tuple[str, str]:
    low = path.lower()
    return next(((source, kind) for part, source, kind in DATASETS if part in low), DEFAULT_DATASET)


def split_list(value: str) -> tuple[list[str], bool]:
    """``"['a', 'b']"`` -> (["a", "b"], True); ``"a"`` -> (["a"], False)."""
    if value.startswith("[") and value.endswith("]"):
        return [v.strip().strip("'\"") for v in value[1:-1].split(",") if v.strip()], True
    return [value.strip("'\"")], False


def rewrite(argv: list[str], fx: Fixtures, out: Path) -> list[str]:
    """The command with only its paths and device counts changed (module docstring, README)."""
    pairs = [a.split("=", 1) if "=" in a and not a.startswith("-") else [a, None] for a in argv]
    values = {k.lstrip("+~"): v for k, v in pairs if v is not None}
    sizes = [int(values[k]) for k in ("data.train_batch_size", "data.gen_batch_size") if str(values.get(k)).isdigit()]
    rows = max(sizes, default=VERL_TRAIN_BATCH)
    files = [dataset(f) for k in DATA_KEYS for f in split_list(values.get(k, ""))[0]]
    vision = any(kind != "text" for _, kind in files) or values.get("data.image_key") not in (None, "null") \
        or any(VISION_MODEL.search(v or "") for k, v in values.items() if MODEL_KEYS.search(k))
    result = []
    for key, value in pairs:
        name = key.lstrip("+~")
        if value is None:
            result.append(key)
            continue
        if name in REWARD_MODEL_KEYS:
            value = str(fx.model("reward"))
        elif MODEL_KEYS.search(name):
            value = str(fx.model("image" if vision else "mimo" if MTP_MODEL.search(value) else "text"))
        elif name.endswith("lora_adapter_path") and value not in ("", "null"):
            value = str(fx.model("adapter"))
        elif name.endswith("megatron.dist_checkpointing_path") and value not in ("", "null"):
            value = str(fx.model("dist"))
        elif name in DATA_KEYS:
            items, is_list = split_list(value)
            split = "train" if name == "data.train_files" else "test"
            made = []
            for item in items:
                source, kind = dataset(item)  # text data stays text with a vision model, as verl's gsm8k files do
                made.append(str(fx.data(source, kind, split, rows if split == "train" else 4)))
            value = f"[{','.join(made)}]" if is_list else made[0]
        elif name in REWARD_FILE_KEYS and value not in ("", "null") and (
                "{VERL}" in value or not value.startswith(("/", "{HOME}", "~"))):  # a file of verl's repository
            value = str(fx.reward_file(values.get(name.rsplit(".", 1)[0] + ".name") or "compute_score"))
        elif name == DATASET_CLASS_KEY and value not in ("", "null") and (
                "{VERL}" in value or not value.startswith(("/", "{HOME}", "~"))):  # a file of verl's repository
            value = str(fx.dataset_file(values.get("data.custom_cls.name") or "RLHFDataset"))
        elif name == "trainer.device":
            value = "cpu"
        elif OUTPUT_KEYS.search(name):
            value = str(out / name.rsplit(".", 1)[-1])
        elif NULL.search(name):
            value = "null"
        elif ONE.search(name):
            value = "1"
        elif ALL_DEVICES.search(name):
            value = "-1"
        result.append(f"{key}={value}")
    return result + [k for k in ("trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.device=cpu")
                     if k.split("=")[0] not in values]


def problems_of(code: int, out: str, err: str) -> list[str]:
    """The problems rlflow printed: its config error (one, or a list), or the dry run's PROBLEMS section."""
    if code == 0:
        return []
    text = err.split("rlflow: config error: ", 1)[1] if "rlflow: config error: " in err else ""
    if text:
        listed = re.split(r"\n  - ", text.strip())
        return [p.strip() for p in (listed[1:] if re.match(r"\d+ problems in the config:", listed[0]) else listed)]
    if "\nPROBLEMS\n" in out:
        section = out.split("\nPROBLEMS\n", 1)[1].split("\n\n", 1)[0]
        return [p.strip() for p in re.split(r"^  - ", section, flags=re.MULTILINE) if p.strip()]
    last = [line for line in (err or out).strip().splitlines() if line.strip()]
    return [f"exit status {code}: {last[-1] if last else 'no message'}"]


def blocking_key(problem: str) -> str:
    """The key a problem names first (``a.b.c=1: ...``, ``unknown config key 'a.b'``, ``override 'a.b=...'``
    -> ``a.b.c`` / ``a.b``); for a data file's problem its first sentence; else its first words."""
    found = re.match(r"(?:unknown config key |override )'[+~]*([^'=]+)", problem) or \
        re.match(r"[+~]*([A-Za-z_][\w@-]*(?:\.[\w@-]+)+|--[\w-]+)", problem)
    if found:
        return found.group(1)
    if problem.startswith(("/", "<")) and ": " in problem:  # about a data file: what it says, not which file
        return re.split(r"\. |; ", problem.split(": ", 1)[1])[0]
    return " ".join(problem.split(":", 1)[0].split()[:8])


# Problems of the machine the check runs on, not of rlflow: an optional package a script names is not installed
# here (issue 23 counts wandb's install hint this way). They are listed apart and do not count as blocking.
ENVIRONMENT = {"wandb is not installed": r"wandb, which is not installed: pip install wandb",
               "vLLM is not installed": r"pip install -e \"\.\[vllm\]\""}


def environment(problem: str) -> str | None:
    return next((name for name, pattern in ENVIRONMENT.items() if re.search(pattern, problem)), None)


def run_one(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """``rlflow.config.verl.run.main(argv)`` in this process, in ``cwd``: (exit code, stdout, stderr)."""
    from rlflow.config.verl.run import main as rlflow_main

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    cwd.mkdir(parents=True, exist_ok=True)
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = rlflow_main(argv)
            except SystemExit as e:  # argparse
                code = e.code if isinstance(e.code, int) else 2
            except Exception as e:  # noqa: BLE001 - a crash is a finding too: the message says where
                code = 3
                print(f"rlflow crashed: {type(e).__name__}: {e}", file=sys.stderr)
                if os.environ.get("VERL_EXAMPLES_TRACEBACK"):
                    import traceback

                    traceback.print_exc(file=sys.__stderr__)
    finally:
        os.chdir(here)
    return code, out.getvalue(), err.getvalue()


def without_refused(argv: list[str], problems: list[str]) -> list[str]:
    """``argv`` less the overrides (and flags) the problems name (ENVIRONMENT's too): what is left once rlflow's
    gaps are dropped."""
    keys = {blocking_key(p) for p in problems}
    flags = {k.split("=")[0] for k in keys if k.startswith("--")} and {"--config-path", "--config-name"}
    def named(arg: str) -> bool:
        key = arg.split("=", 1)[0].lstrip("+~")
        return key in flags or any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in keys)
    return [a for a in argv if not named(a)]


def run_dropping(argv: list[str], cwd: Path) -> tuple[int, str, str, list[str]]:
    """Run, drop what was refused, run again, until accepted or nothing more to drop; also the dropped args."""
    dropped: list[str] = []
    while True:
        code, out, err = run_one(argv, cwd)
        rest = without_refused(argv, problems_of(code, out, err))
        if code == 0 or rest == argv:
            return code, out, err, dropped
        dropped += [a for a in argv if a not in rest]
        argv = rest


def check(only: str = "", fixtures: Path | None = None, commands: Path = COMMANDS, drop: bool = False) -> dict:
    """Every recorded command, rewritten, through rlflow's dry run: {"scripts": {script: [result, ...]},
    "no_command": {...}, "seconds": ...}; a result is {"argv", "code", "problems", "output", "seconds"}.
    ``fixtures``: a folder for the tiny stand-ins, to share them between checks (default: made each time).
    ``drop``: run each again without what rlflow refused, until it is accepted (a result has "dropped")."""
    recorded = json.loads(commands.read_text())
    started, results = time.perf_counter(), {}
    with tempfile.TemporaryDirectory(prefix="verl-examples-check-") as tmp:
        tmp = Path(tmp)
        fx = Fixtures(fixtures or tmp / "fixtures")
        for i, (script, argvs) in enumerate(recorded["commands"].items()):
            if only not in script or not argvs:  # no command: listed in "no_command"
                continue
            results[script] = []
            for j, argv in enumerate(argvs):
                where = tmp / f"run{i}_{j}"
                new = [a.replace("{HOME}", str(where / "home")).replace("{VERL}", str(where / "verl"))
                       for a in rewrite(argv, fx, where / "out")] + ["--dry-run"]
                cwd = where / "verl" / recorded["cwd"].get(script, ["."] * len(argvs))[j]
                t0 = time.perf_counter()
                code, out, err, dropped = run_dropping(new, cwd) if drop else (*run_one(new, cwd), None)
                problems = [p.replace(str(fx.root), "<stand-ins>").replace(str(tmp), "<tmp>")
                            for p in problems_of(code, out, err)]
                results[script].append({"argv": new, "code": code, "problems": problems,
                                        "output": out + err, "seconds": time.perf_counter() - t0, "dropped": dropped})
    return {"scripts": results, "no_command": {k: v for k, v in recorded["no_command"].items() if only in k},
            "seconds": time.perf_counter() - started, "commit": recorded["commit"]}


def tally(report: dict) -> tuple[list[tuple[str, int, int]], Counter]:
    """(blocking key, scripts it blocks, scripts it alone blocks), most frequent first; and the environment
    problems (ENVIRONMENT) by the number of scripts they hit, which are not counted as blocking. Three or more
    keys under one parent that block the same scripts are one row, ``parent.* (N keys)``."""
    per_script, env = [], Counter()
    for runs in report["scripts"].values():
        problems = [p for r in runs for p in r["problems"]]
        env.update({environment(p) for p in problems} - {None})
        per_script.append({blocking_key(p) for p in problems if not environment(p)})
    hits = {k: frozenset(i for i, keys in enumerate(per_script) if k in keys) for k in set().union(*per_script)}
    family = Counter((k.rsplit(".", 1)[0], hits[k]) for k in hits if "." in k)  # siblings blocking the same scripts
    group = {}
    for k in hits:
        n = family.get((k.rsplit(".", 1)[0], hits[k]), 0) if "." in k else 0
        group[k] = f"{k.rsplit('.', 1)[0]}.* ({n} keys)" if n >= 3 else k
    blocks, alone = Counter(), Counter()
    for keys in per_script:
        groups = {group[k] for k in keys}
        blocks.update(groups)
        if len(groups) == 1:
            alone.update(groups)
    return [(k, n, alone[k]) for k, n in sorted(blocks.items(), key=lambda kv: (-kv[1], kv[0]))], env


def accepted(report: dict, but_environment: bool = False) -> list[str]:
    """Scripts whose every command the dry run accepts (``but_environment``: or refuses only for ENVIRONMENT)."""
    return [s for s, runs in report["scripts"].items() if runs and all(
        r["code"] == 0 or but_environment and r["problems"] and all(map(environment, r["problems"])) for r in runs)]


def markdown(report: dict, top: int = 40) -> str:
    n, ok, ok_env = len(report["scripts"]), len(accepted(report)), len(accepted(report, but_environment=True))
    rows, env = tally(report)
    lines = [f"Of the {n} example scripts of verl {report['commit'][:7]} that run `{ENTRY}` (each rewritten only "
             "for paths and device counts: `tests/config/verl_examples/README.md`), **{ok} are accepted** by "
             f"`--dry-run`"
             + (f" ({ok_env - ok} more refused only because {', '.join(env)} here)" if ok_env > ok else "")
             + f"; {len(report['no_command'])} more name it but run no `{ENTRY}` command "
             f"({'; '.join(f'`{k}`: {v}' for k, v in report['no_command'].items())}). "
             "Not counted as blocking: " + (", ".join(f"{k} ({v} scripts)" for k, v in env.items()) or "nothing")
             + ". The keys that block the others, by the number of scripts they block (and those they alone "
             "block); `python scripts/verl_examples.py check --markdown` remakes this table:", "",
             "| blocking key (or message) | scripts | only blocker |", "| --- | --- | --- |"]
    lines[0] = lines[0].replace("{ok}", str(ok))
    # <code>, not backticks: tests/config/test_loading.py finds a key's row of "Every verl key" by `key`
    lines += [f"| <code>{k}</code> | {b} | {a} |" for k, b, a in rows[:top]]
    if len(rows) > top:
        lines.append(f"| {len(rows) - top} more keys | {sum(b for _, b, _ in rows[top:])} | "
                     f"{sum(a for _, _, a in rows[top:])} |")
    return "\n".join(lines)


def print_report(report: dict, verbose: bool) -> None:
    for script, runs in report["scripts"].items():
        for r in runs:
            print(f"{'ACCEPTED' if r['code'] == 0 else 'REFUSED '} {script} ({r['seconds']:.1f} s)")
            for p in r["problems"]:
                print(f"    - {p.splitlines()[0][:300]}")
            if r["dropped"] is not None:
                print(f"    ({len(r['dropped'])} overrides dropped: {' '.join(a.split('=')[0] for a in r['dropped'])})")
            if verbose:
                print("    $ python -m rlflow.trainer.main_ppo " + " ".join(r["argv"]))
                print("\n".join("    | " + line for line in r["output"].splitlines()))
    for script, reason in report["no_command"].items():
        print(f"NO COMMAND {script}: {reason}")
    rows, env = tally(report)
    print(f"\n{len(accepted(report))} of {len(report['scripts'])} scripts accepted, "
          f"{len(accepted(report, but_environment=True))} but for the environment ({dict(env)}), "
          f"in {report['seconds']:.1f} s")
    print("\nblocking key: scripts it blocks (only blocker of)")
    for key, n, alone in rows:
        print(f"  {n:3d} ({alone:2d})  {key}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    ex = sub.add_parser("extract", help="record the main_ppo commands of verl's example scripts (needs verl's git)")
    ex.add_argument("--repo", default=str(MIRROR), help="a clone (bare is fine) of verl's repository")
    ex.add_argument("--commit", default="1dda039")
    ex.add_argument("--timeout", type=float, default=30.0, help="seconds per script")
    ch = sub.add_parser("check", help="the dry run of every recorded command, rewritten for paths and devices")
    ch.add_argument("--markdown", action="store_true", help="print the tally table for docs/verl-compat.md")
    ch.add_argument("--only", default="", metavar="SUBSTR", help="only scripts whose path contains SUBSTR")
    ch.add_argument("-v", "--verbose", action="store_true", help="also each rewritten command and rlflow's output")
    ch.add_argument("--drop-refused", action="store_true",
                    help="diagnosis: rerun each without the overrides rlflow refused, until accepted (slower)")
    args = parser.parse_args(argv)
    if args.what == "extract":
        return extract(args)
    report = check(args.only, drop=args.drop_refused)
    print(markdown(report)) if args.markdown else print_report(report, args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
