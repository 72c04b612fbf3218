"""Gradients of a Megatron model before the optimizer step: reduced over replicas, measured over all shards.

**Reduction.** The Trainer normalises each rank's loss so that averaging the gradients over all
``W`` processes gives the gradient of the whole batch (``rlflow.trainer.trainer._minibatches``: a
group of ranks that trains on one batch — here the ranks of one model replica — counts its samples
once per rank). With Megatron, the ranks of a replica each hold the *whole* gradient of their own
shard (not a share of it), and the replicas of a shard are the data-parallel group (experts: the
expert-data-parallel group). So each gradient is summed over the ranks holding a replica of it and
divided by ``W``. Before that, as Megatron's ``finalize_model_grads`` does, the two copies of a tied
embedding (first and last pipeline stage) add up their gradients, and so do the tensor-parallel copies
of parameters whose ranks each see part of the input (query/key norms see their rank's heads only;
norms under sequence parallelism their rank's tokens).

A parameter without a gradient on one replica but with one on another (an expert no token reached on
one rank) gets zeros first, so that the collectives line up; parameters without a gradient anywhere
keep ``None`` (the optimizer skips them, as it would on one process).

**Norm.** ``||g||_2`` over every element of the model once: each rank adds the squares of the
gradients it "owns" (data-parallel rank 0 of each replica group; for a parameter replicated over the
tensor-parallel ranks, tensor rank 0; the tied embedding on the first stage) and one all-reduce over
all ranks sums them. Clipping scales every gradient by ``min(1, max_norm / (norm + 1e-6))``, as
``torch.nn.utils.clip_grad_norm_`` does.

A parameter's gradient is ``param.main_grad`` where the precision-aware optimizer accumulates it in its own dtype
(:mod:`.precision_aware`), else ``param.grad``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from rlflow.strategies.megatron.precision_aware import main_grad, zero_main_grad


def _is_expert(p: nn.Parameter) -> bool:
    return not getattr(p, "allreduce", True)  # Megatron marks expert parameters allreduce=False


def _sum_over(grads: list[Tensor], group) -> None:
    if not grads or dist.get_world_size(group) == 1:
        return
    for dtype in {g.dtype for g in grads}:
        same = [g for g in grads if g.dtype == dtype]
        flat = _flatten_dense_tensors(same)
        dist.all_reduce(flat, group=group)
        for g, reduced in zip(same, _unflatten_dense_tensors(flat, same)):
            g.copy_(reduced)


def _fill_missing(params: list[nn.Parameter], group) -> None:
    """Zeros for the parameters that have a gradient on another rank of ``group`` but not here."""
    if dist.get_world_size(group) == 1 or not params:
        return
    device = params[0].device
    has = torch.tensor([main_grad(p) is not None for p in params], dtype=torch.int32, device=device)
    dist.all_reduce(has, op=dist.ReduceOp.MAX, group=group)
    for p, anywhere in zip(params, has.tolist()):
        if anywhere and main_grad(p) is None:
            zero_main_grad(p)


@torch.no_grad()
def reduce_gradients(params: list[nn.Parameter]) -> None:
    """Sum each gradient over the ranks that hold a replica of its parameter, divide by the world size."""
    from megatron.core import parallel_state as ps

    dense = [p for p in params if not _is_expert(p)]
    experts = [p for p in params if _is_expert(p)]
    dp_group = ps.get_data_parallel_group(with_context_parallel=True)
    expert_group = ps.get_expert_data_parallel_group()
    _fill_missing(dense, dp_group)
    _fill_missing(experts, expert_group)
    partial = [main_grad(p) for p in params if getattr(p, "partial_over_tensor_parallel", False)
               and main_grad(p) is not None]
    _sum_over(partial, ps.get_tensor_model_parallel_group())
    tied = [p for p in dense if getattr(p, "shared_embedding", False)]  # one on the first and one on the last stage
    if tied and ps.get_pipeline_model_parallel_world_size() > 1:
        _fill_missing(tied, ps.get_embedding_group())  # a critic does not use the last stage's copy
        _sum_over([main_grad(p) for p in tied if main_grad(p) is not None], ps.get_embedding_group())
    _sum_over([main_grad(p) for p in dense if main_grad(p) is not None], dp_group)
    _sum_over([main_grad(p) for p in experts if main_grad(p) is not None], expert_group)
    scale = 1.0 / dist.get_world_size()
    for grad in map(main_grad, params):
        if grad is not None:
            grad.mul_(scale)


def _owned(p: nn.Parameter) -> bool:
    """Whether this rank counts ``p`` in the global norm (see the module docstring)."""
    from megatron.core import parallel_state as ps

    if _is_expert(p):
        replica = ps.get_expert_data_parallel_rank() == 0
        tensor_rank = ps.get_expert_tensor_parallel_rank()
    else:
        replica = ps.get_data_parallel_rank(with_context_parallel=True) == 0
        tensor_rank = ps.get_tensor_model_parallel_rank()
    tied_copy = getattr(p, "shared_embedding", False) and not ps.is_pipeline_first_stage()
    return replica and (tensor_rank == 0 or getattr(p, "split_over_tensor_parallel", False)) and not tied_copy


@torch.no_grad()
def global_grad_norm(params: list[nn.Parameter], norm_type: float = 2.0) -> Tensor:
    """The norm of the whole model's gradient (after :func:`reduce_gradients`), the same on every rank."""
    grads = [main_grad(p) for p in params if main_grad(p) is not None and _owned(p)]
    device = params[0].device if params else torch.device("cpu")
    if norm_type == float("inf"):
        local = torch.stack([g.abs().max().float() for g in grads]).max() if grads else torch.zeros((), device=device)
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        return local
    if norm_type != 2.0:
        raise ValueError(f"norm_type={norm_type}: the Megatron strategy clips by the 2-norm or the inf-norm")
    local = torch.stack([g.float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros((), device=device)
    dist.all_reduce(local)
    return local.sqrt()


@torch.no_grad()
def clip_(params: list[nn.Parameter], max_norm: float, norm: Tensor) -> None:
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for grad in map(main_grad, params):
        if grad is not None:
            grad.mul_(coef.to(grad.dtype))
