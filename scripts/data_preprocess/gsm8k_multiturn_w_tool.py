"""GSM8K for multi-turn tool use, like verl's ``examples/data_preprocess/gsm8k_multiturn_w_tool.py``.

The rows of ``gsm8k.py`` (same sources, nothing downloaded), with verl's system prompt asking the model to use
the tools, and per-row tool and interaction arguments::

    prompt       [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question + instruction}]
    extra_info   {..., "need_tools_kwargs": True,
                  "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": N}}},
                  "interaction_kwargs": {"name": "gsm8k", "query": question, "ground_truth": N}}

    python scripts/data_preprocess/gsm8k_multiturn_w_tool.py --local_dataset_path ~/gsm8k --local_save_dir ~/data/gsm8k_tool
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gsm8k  # noqa: E402  (the single-turn converter next to this file)

SYSTEM = ("You are a math expert. You are given a question and you need to solve it step by step. "
          "Use the `calculator` tool for arithmetic. You should use the `calc_gsm8k_reward` tool after step by step "
          "solving the question, before generating the final answer at least once, and refine your answer if "
          "necessary. Put your final answer in the format of `#### <answer>`.")


def with_tools(row: dict) -> dict:
    """A ``gsm8k.convert`` row made multi-turn: verl's system prompt and the per-row tool/interaction arguments."""
    truth, question = row["reward_model"]["ground_truth"], row["extra_info"]["question"]
    return {**row, "prompt": [{"role": "system", "content": SYSTEM}, *row["prompt"]],
            "extra_info": {**row["extra_info"], "need_tools_kwargs": True,
                           "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}},
                           "interaction_kwargs": {"name": "gsm8k", "query": question, "ground_truth": truth}}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local_dataset_path", default=None, help="folder holding a local copy of GSM8K")
    parser.add_argument("--train_file", default=None, help="the train split (jsonl or parquet)")
    parser.add_argument("--test_file", default=None, help="the test split (jsonl or parquet)")
    parser.add_argument("--local_save_dir", "--local_dir", default="~/data/gsm8k_tool", help="where the parquet files go")
    args = parser.parse_args(argv)
    if args.local_dataset_path is None and not (args.train_file and args.test_file):
        parser.error("rlflow never downloads: pass --local_dataset_path (or --train_file and --test_file)")
    root = Path(args.local_dataset_path).expanduser() if args.local_dataset_path else None
    out_dir = Path(args.local_save_dir).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    import pandas as pd

    for split in ("train", "test"):
        given = getattr(args, f"{split}_file")
        source = Path(given).expanduser() if given else gsm8k.find_split(root, split)
        rows = [with_tools(r) for r in gsm8k.convert(source, split)]
        pd.DataFrame(rows).to_parquet(out_dir / f"{split}.parquet")
        print(f"{split}: {len(rows)} rows from {source} -> {out_dir / f'{split}.parquet'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
