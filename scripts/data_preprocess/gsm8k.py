"""Turn a local copy of GSM8K into rlflow/verl parquet files, like verl's ``examples/data_preprocess/gsm8k.py``.

Nothing is downloaded. Point ``--local_dataset_path`` at either layout of the data set:

- the original release: ``train.jsonl`` and ``test.jsonl`` (``grade_school_math/data/``), or
- the Hugging Face layout: ``main/train-00000-of-00001.parquet`` and ``main/test-...parquet``,

(or name the files with ``--train_file`` / ``--test_file``). Each row ``{question, answer}`` becomes::

    data_source  "openai/gsm8k"
    prompt       [{"role": "user", "content": question + ' Let\\'s think step by step and output the final answer after "####".'}]
    ability      "math"
    reward_model {"style": "rule", "ground_truth": the number after "#### " (commas removed)}
    extra_info   {"split", "index", "answer", "question"}

and ``train.parquet`` / ``test.parquet`` are written to ``--local_save_dir``:

    python scripts/data_preprocess/gsm8k.py --local_dataset_path ~/gsm8k --local_save_dir ~/data/gsm8k
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_solution(answer: str) -> str | None:
    """verl's rule: the first ``#### N`` of the answer, commas removed."""
    match = ANSWER.search(answer)
    return match.group(1).replace(",", "") if match else None


def find_split(root: Path, split: str) -> Path:
    """``<split>.jsonl`` or ``<split>-*.parquet`` under ``root`` (the ``main`` config before ``socratic``)."""
    candidates = sorted(root.rglob(f"{split}*.jsonl")) + sorted(root.rglob(f"{split}*.parquet"))
    candidates = [p for p in candidates if "socratic" not in p.name and "socratic" not in p.parent.name] or candidates
    if not candidates:
        raise SystemExit(f"no {split}.jsonl or {split}-*.parquet under {root}; pass --{split}_file")
    return candidates[0]


def convert(path: Path, split: str) -> list[dict]:
    import datasets

    kind = "parquet" if path.suffix == ".parquet" else "json"
    rows = datasets.load_dataset(kind, data_files=str(path), split="train").to_list()
    out = []
    for index, row in enumerate(rows):
        if "question" not in row or "answer" not in row:
            raise SystemExit(f"{path}, row {index}: expected 'question' and 'answer' columns, got {sorted(row)}")
        solution = extract_solution(row["answer"])
        if solution is None:
            raise SystemExit(f"{path}, row {index}: the answer has no '#### <number>' line: {row['answer'][-80:]!r}")
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": solution},
            "extra_info": {"split": split, "index": index, "answer": row["answer"], "question": row["question"]},
        })
    return out


def main(argv: list[str] | None = None, *, description: str | None = None, default_dir: str = "~/data/gsm8k",
         transform=None) -> int:
    """The command line; ``transform`` maps each converted row (the multi-turn script adds its tools)."""
    parser = argparse.ArgumentParser(description=description or __doc__.split("\n\n")[0])
    parser.add_argument("--local_dataset_path", default=None, help="folder holding a local copy of GSM8K")
    parser.add_argument("--train_file", default=None, help="the train split (jsonl or parquet)")
    parser.add_argument("--test_file", default=None, help="the test split (jsonl or parquet)")
    parser.add_argument("--local_save_dir", "--local_dir", default=default_dir, help="where the parquet files go")
    args = parser.parse_args(argv)
    if args.local_dataset_path is None and not (args.train_file and args.test_file):
        parser.error("rlflow never downloads: pass --local_dataset_path (or --train_file and --test_file)")
    root = Path(args.local_dataset_path).expanduser() if args.local_dataset_path else None
    out_dir = Path(args.local_save_dir).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    import pandas as pd

    for split in ("train", "test"):
        given = getattr(args, f"{split}_file")
        source = Path(given).expanduser() if given else find_split(root, split)
        rows = [transform(r) for r in convert(source, split)] if transform else convert(source, split)
        pd.DataFrame(rows).to_parquet(out_dir / f"{split}.parquet")
        print(f"{split}: {len(rows)} rows from {source} -> {out_dir / f'{split}.parquet'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
