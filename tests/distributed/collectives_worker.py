"""Run by torchrun from test_parallelism.py: token balancing and token-budget micro-batches on skewed ranks.

    python -m torch.distributed.run --nproc_per_node 2 collectives_worker.py OUT

(test_parallelism.py runs it as a job of worker.py's launch: ``worker.py collectives_worker OUT + ...``.)

Rank 0 holds long rows, rank 1 short ones (and shorter responses); then a tiny FSDP2 model's
weights are gathered for the engine in buckets. Each rank writes
OUT/rank{r}.pt: the row ids it holds after balancing, the statistics, and its
micro-batches' row counts and token counts under a budget.
"""

import sys

import lightning_fabric as L
import torch
from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.trainer.batching import micro_batches, row_tokens
from rlflow.trainer.distributed import balance_tokens, gather_in_group


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


def sharded_weight_sync() -> dict:
    """FSDP2-shard a tiny model (2 layers, odd row counts: uneven shards), gather its weights in buckets."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from rlflow.models.tiny import tiny_qwen2
    from rlflow.rollout.weight_sync import full_weight_buckets, sync_weights

    model = tiny_qwen2(21, hidden_size=24, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=37, seed=3)
    engine = tiny_qwen2(21, hidden_size=24, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=37, seed=4)
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    expected = {n: p.full_tensor() for n, p in model.named_parameters()}
    calls = []
    gather = dist.all_gather_into_tensor

    def counted(*args, **kwargs):  # the real collective, counted
        calls.append(1)
        return gather(*args, **kwargs)

    dist.all_gather_into_tensor = counted
    try:
        buckets = list(full_weight_buckets(model, bucket_bytes=4096))
        stats = sync_weights(model, engine, bucket_bytes=4096)
    finally:
        dist.all_gather_into_tensor = gather
    got = {n: t for b in buckets for n, t in b}
    return {
        "sync_max_diff": max((got[n] - t).abs().max().item() for n, t in expected.items()),
        "sync_same_names": list(got) == list(expected),
        "engine_max_diff": max((p - expected[n]).abs().max().item() for n, p in engine.named_parameters()),
        "sync_buckets": len(buckets), "sync_stats": stats, "sync_gathers": len(calls),
        "sync_bucket_bytes": [sum(t.numel() * t.element_size() for _, t in b) for b in buckets],
        "sync_largest_tensor": max(t.numel() * t.element_size() for t in expected.values()),
        "sync_params": len(expected), "sync_all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
    }


def main(out):
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    rank = fabric.global_rank
    batch = skewed_batch(rank)
    balanced, stats = balance_tokens(batch, fabric, rank, 2, mini_batches=2)
    budget = micro_batches(skewed_batch(rank), None, max_tokens=28, fabric=fabric)  # unbalanced on purpose
    sync = sharded_weight_sync()
    shard = skewed_batch(rank)
    shard[K.GROUP] = torch.arange(8) // 2  # 4 prompts x 2 samples on each rank
    union = gather_in_group(shard, torch.distributed.new_group([0, 1]))
    torch.save({
        **sync, "union_row_ids": union["row_id"].tolist(), "union_groups": union[K.GROUP].tolist(),
        "union_response_len": union[K.RESPONSE_IDS].shape[1], "union_sources": list(union[K.DATA_SOURCE]),
        "union_mask_rows": union[K.RESPONSE_MASK].sum(-1).tolist(),
        "row_ids": balanced["row_id"].tolist(), "stats": stats, "keys": sorted(balanced.keys()),
        "response_len": balanced[K.RESPONSE_IDS].shape[1], "tokens": int(row_tokens(balanced).sum()),
        "cov_dtype": str(balanced[K.COV_SELECTED].dtype),
        "micro_rows": [m.batch_size[0] for m in budget], "micro_tokens": [int(row_tokens(m).sum()) for m in budget],
    }, f"{out}/rank{rank}.pt")
    fabric.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
