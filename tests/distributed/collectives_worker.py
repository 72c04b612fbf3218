"""Run by torchrun from test_parallelism.py: token balancing and token-budget micro-batches on skewed ranks.

    python -m torch.distributed.run --nproc_per_node 2 collectives_worker.py OUT

Rank 0 holds long rows, rank 1 short ones (and shorter responses). Each rank writes
OUT/rank{r}.pt: the row ids it holds after balancing, the statistics, and its
micro-batches' row counts and token counts under a budget.
"""

import sys

import lightning as L
import torch
from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.trainer.batching import micro_batches, row_tokens
from rlflow.trainer.distributed import balance_tokens


def skewed_batch(rank: int, n: int = 8) -> TensorDict:
    P, R = 6, (8 if rank == 0 else 5)
    length = (R if rank == 0 else 1)  # rank 0: full responses; rank 1: one token each
    mask = (torch.arange(R)[None] < length).long().expand(n, R).clone()
    batch = TensorDict({
        K.PROMPT_IDS: torch.ones(n, P, dtype=torch.long), K.PROMPT_MASK: torch.ones(n, P, dtype=torch.long),
        K.RESPONSE_IDS: torch.full((n, R), 3), K.RESPONSE_MASK: mask,
        K.ADVANTAGES: torch.randn(n, R), K.COV_SELECTED: mask.bool(),
        "row_id": torch.arange(n) + 100 * rank,
    }, batch_size=[n])
    batch[K.DATA_SOURCE] = ["x"] * n  # a non-tensor field: not carried
    return batch


def main(out):
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    rank = fabric.global_rank
    batch = skewed_batch(rank)
    balanced, stats = balance_tokens(batch, fabric, rank, 2, mini_batches=2)
    budget = micro_batches(skewed_batch(rank), None, max_tokens=28, fabric=fabric)  # unbalanced on purpose
    torch.save({
        "row_ids": balanced["row_id"].tolist(), "stats": stats, "keys": sorted(balanced.keys()),
        "response_len": balanced[K.RESPONSE_IDS].shape[1], "tokens": int(row_tokens(balanced).sum()),
        "cov_dtype": str(balanced[K.COV_SELECTED].dtype),
        "micro_rows": [m.batch_size[0] for m in budget], "micro_tokens": [int(row_tokens(m).sum()) for m in budget],
    }, f"{out}/rank{rank}.pt")
    fabric.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
