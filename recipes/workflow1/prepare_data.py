"""Step 1 of the seed's Workflow 1 (GRPO for math reasoning), sized for SmolLM2-135M-Instruct on a CPU.

Writes ``train.parquet`` and ``val.parquet`` in verl's layout, as the seed's step 1 does: ``prompt`` is a list
of chat messages and ``reward_model.ground_truth`` the answer (plus ``data_source``, ``ability``,
``extra_info``). The task is single-digit addition with the seed's instruction, "What is 6 + 7? Put your final
answer within \\boxed{}.", after one worked example turn (``2 + 3 = \\boxed{5}``, as an assistant message):
without it this model boxes the right sum in about 1 sample in 60; with it, in about 1 in 4
(docs/workflow1.md). Held-out rows are whole unordered pairs ({a, b}: neither ``a + b`` nor ``b + a`` is
trained on); the example's pair is in neither split.

    python recipes/workflow1/prepare_data.py --out runs/workflow1/data
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pandas as pd

QUESTION = "What is {a} + {b}? Put your final answer within \\boxed{{}}."
EXAMPLE = (2, 3)
DATA_SOURCE = "workflow1/addition"


def messages(a: int, b: int) -> list[dict]:
    """The question after one worked example turn in the format the reward checks."""
    x, y = EXAMPLE
    return [{"role": "user", "content": QUESTION.format(a=x, b=y)},
            {"role": "assistant", "content": f"{x} + {y} = \\boxed{{{x + y}}}"},
            {"role": "user", "content": QUESTION.format(a=a, b=b)}]


def row(a: int, b: int, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": messages(a, b),
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index, "question": f"{a} + {b}"},
    }


def splits(max_operand: int = 9, val_pairs: int = 14, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train rows, val rows): every ``a + b`` with ``0 <= a, b <= max_operand`` but the example's; ``val_pairs``
    unordered pairs held out (both orders)."""
    example = tuple(sorted(EXAMPLE))
    pairs = sorted({(min(a, b), max(a, b)) for a in range(max_operand + 1) for b in range(max_operand + 1)} - {example})
    held = set(random.Random(seed).sample(pairs, val_pairs))
    train, val = [], []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            pair = (min(a, b), max(a, b))
            if pair == example:
                continue
            split, rows = ("val", val) if pair in held else ("train", train)
            rows.append(row(a, b, split, len(rows)))
    return train, val


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/workflow1/data", help="folder for train.parquet and val.parquet")
    parser.add_argument("--max-operand", type=int, default=9)
    parser.add_argument("--val-pairs", type=int, default=14, help="unordered pairs held out for validation")
    parser.add_argument("--seed", type=int, default=0, help="which pairs are held out")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, val = splits(args.max_operand, args.val_pairs, args.seed)
    pd.DataFrame(train).to_parquet(out / "train.parquet")
    pd.DataFrame(val).to_parquet(out / "val.parquet")
    print(f"wrote {len(train)} train and {len(val)} val prompts to {out}/")
    return out


if __name__ == "__main__":
    main()
