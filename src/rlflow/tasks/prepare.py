"""Write the built-in addition task as the files a config run reads.

    rlflow prepare-task addition runs/task
    python -m rlflow.tasks.prepare runs/task

``OUT/model``: the warm-started tiny Qwen2 (the default job's starting point) and its character
tokenizer, with a chat template that renders the user's message as is, so the prompt ``37+45=``
encodes exactly as in the default job. ``OUT/train.parquet`` and ``OUT/test.parquet``: the task's
training and held-out splits in verl's layout (``prompt`` as chat messages,
``reward_model.ground_truth``, ``data_source: rlflow/addition``), which verl's default reward
dispatch scores with the task's exact match. The recipes in ``recipes/tree`` and ``recipes/yaml`` point at these files.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rlflow.tasks.addition import AdditionTask, warm_started_model

# The messages' contents, concatenated; no generation prompt (the prompt already ends with "=").
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
TASKS = ("addition",)


def verl_rows(rows: list[dict], split: str) -> list[dict]:
    """The task's rows in verl's parquet layout (as verl's data preprocessing scripts write them)."""
    return [{"data_source": r["data_source"], "prompt": [{"role": "user", "content": r["prompt"]}],
             "ability": "arithmetic", "reward_model": {"style": "rule", "ground_truth": r["ground_truth"]},
             "extra_info": {"split": split, "index": i}} for i, r in enumerate(rows)]


def export_task(out_dir: str | Path, seed: int = 0, task: AdditionTask | None = None, progress: bool = False) -> Path:
    """Write ``model/``, ``train.parquet`` and ``test.parquet`` under ``out_dir``; returns ``out_dir``.

    The model is the warm start of ``seed`` (made once, then read from the cache; see
    :func:`~rlflow.tasks.addition.warm_started_model`; ``progress`` shows a bar while it is made).
    The held-out split is the default job's.
    """
    import pandas as pd

    task = task or AdditionTask()
    out = Path(out_dir).expanduser()
    model, tokenizer = warm_started_model(task, seed, progress=progress)
    tokenizer.chat_template = CHAT_TEMPLATE
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    train, _, test = task.splits()
    pd.DataFrame(verl_rows(train, "train")).to_parquet(out / "train.parquet")
    pd.DataFrame(verl_rows(test, "test")).to_parquet(out / "test.parquet")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlflow.tasks.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="where model/, train.parquet and test.parquet go")
    parser.add_argument("--seed", type=int, default=0, help="the warm start's seed (default 0, the default job's)")
    args = parser.parse_args(argv)
    out = export_task(args.out_dir, seed=args.seed, progress=True)  # a first warm start takes minutes
    print(f"wrote {out / 'model'}, {out / 'train.parquet'} and {out / 'test.parquet'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
