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
    return gsm8k.main(argv, description=__doc__.split("\n\n")[0], default_dir="~/data/gsm8k_tool", transform=with_tools)


if __name__ == "__main__":
    sys.exit(main())
