"""One generation engine for several training processes: rank 0 runs it, every rank trains on whole groups.

With ``torch.distributed`` initialised over more than one process, :class:`~rlflow.rollout.FullyAsyncRollout`
starts its engine on rank 0 only. Rank 0 draws the loader's whole prompt batches (``PromptStream.whole``), keeps
the staleness bound over all of them, and hands each step's complete groups out: rank ``r`` gets the ``r``-th
contiguous share of whole groups (a group's samples stay together, so group-relative advantages stay local),
laid out as a batch of its own, with rank 0's ``stats`` (every rank logs the same). Weights reach the engine from
rank 0 after each step; the others' pushes move nothing (DDP: every rank holds the same weights). FSDP2-sharded
weights are first gathered, by every rank, into a full copy (:func:`full_twin`), which rank 0's engine starts
from and every rank validates with.

The hand-out is one ``scatter_object_list`` per step on the default group (gloo on CPU). A failure of the
generation on rank 0 is handed out too, so every rank stops naming it instead of waiting.

With DAPO's dynamic sampling (``FilterGroups``) rank 0 also scores and filters: the experience stream
(``rlflow.rollout.stream``) takes each whole batch from the rollout (``stream(..., split=False)``), scores it,
tops it up until the step's groups are kept, and hands out only kept whole groups (:func:`group_shares`) with
its metrics (``dapo/*`` among them), so every rank trains on its share and logs the same values.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from tensordict import TensorDict
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from rlflow.data import keys as K
from rlflow.data.nontensor import to_device
from rlflow.models.policy import lora_module
from rlflow.rollout.engines.process import EngineProcessError
from rlflow.rollout.weight_sync import sync_weights


def ranks() -> tuple[int, int]:
    """(this process's rank, the number of processes); (0, 1) without a process group."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def full_twin(model: nn.Module, who: str) -> nn.Module | None:
    """For a model FSDP2 shards: a full, unsharded copy (every rank takes part in the gather), which rank 0's
    engine starts from and every rank validates with, kept current by :func:`refresh`. ``None`` for replicated
    weights (DDP): the model itself serves."""
    if getattr(model, "weight_buckets", None) is not None or lora_module(model) is not None:
        raise NotImplementedError(f"{who} with several training processes: replicated (DDP) or FSDP2-sharded "
                                  "transformers models for now, not Megatron's shards or a LoRA policy")
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return None
    twin = AutoModelForCausalLM.from_config(model.config).to(next(model.parameters()).dtype)
    refresh(model, twin)
    return twin


def refresh(trained: nn.Module, twin: nn.Module) -> None:
    """Gather ``trained``'s shards into ``twin`` (collective: every rank calls it)."""
    sync_weights(trained, twin)


def shares(groups: list, world: int) -> list[list]:
    """``groups`` split into ``world`` contiguous shares of whole groups, rank by rank."""
    if len(groups) % world:
        raise ValueError(f"{len(groups)} prompt groups per step do not split evenly over {world} processes")
    per = len(groups) // world
    return [groups[r * per:(r + 1) * per] for r in range(world)]


def row_shares(prompts: TensorDict, samples: TensorDict, world: int, n: int) -> list[tuple[TensorDict, TensorDict]]:
    """A batch of prompts and their ``n`` samples each (rows prompt by prompt) split into ``world`` contiguous
    shares of whole groups, each numbered from 0 as a synchronous shard."""
    per = len(shares(list(range(prompts.batch_size[0])), world)[0])
    out = []
    for r in range(world):
        mine = samples[r * per * n:(r + 1) * per * n]
        mine.set(K.GROUP, mine[K.GROUP] - r * per)
        out.append((prompts[r * per:(r + 1) * per], mine))
    return out


def lead(steps: Iterator[tuple[list, dict]], world: int) -> Iterator[tuple[TensorDict, TensorDict]]:
    """Rank 0: for every step's shares (``[(prompts, samples)]``, one per rank) and stats from ``steps``, hand the
    other ranks theirs and yield its own; the end of ``steps``, or its failure, is handed out too."""
    try:
        for parts, stats in steps:
            if world > 1:
                hand_out([("batch", *part, stats) for part in parts[1:]])
            yield parts[0]
        if world > 1:
            hand_out([("end",)] * (world - 1))
    except Exception as e:
        if world > 1:  # the other ranks wait for this step's groups: they stop too, naming it
            hand_out([("error", f"{type(e).__name__}: {e}")] * (world - 1))
        raise
    finally:
        steps.close()


def follow(rollout, pairs: bool) -> Iterator:
    """A rank > 0: the share of every step that rank 0 hands out (``rollout.stats`` set to rank 0's)."""
    for (prompts, samples), rollout.stats in received(rollout.device, type(rollout).__name__):
        yield (prompts, samples) if pairs else samples


def received(device, who: str) -> Iterator[tuple[tuple, dict]]:
    """A rank > 0: (its part, rank 0's stats) of every step that rank 0 hands out with :func:`lead`, until the end;
    a failure on rank 0 raised here, naming ``who``."""
    while True:
        kind, *rest = receive(device)
        if kind == "end":
            return
        if kind == "error":
            raise EngineProcessError(f"{who}: the generation on rank 0 failed: {rest[0]}")
        *part, stats = rest
        yield tuple(part), stats


def group_shares(samples: TensorDict, world: int) -> list[TensorDict]:
    """A scored batch of groups numbered ``0..P-1`` (rows contiguous per group) split into ``world`` contiguous
    shares of whole groups, each numbered from 0 as a synchronous shard."""
    per = len(shares(list(range(int(samples[K.GROUP].max()) + 1)), world)[0])
    out = []
    for r in range(world):
        mine = samples[(samples[K.GROUP] >= r * per) & (samples[K.GROUP] < (r + 1) * per)]
        mine.set(K.GROUP, mine[K.GROUP] - r * per)
        out.append(mine)
    return out


def whole(prompts, who: str) -> Iterator[TensorDict]:
    """The loader's whole batches from the Trainer's ``PromptStream`` (rank 0 draws every rank's prompts)."""
    if not hasattr(prompts, "whole"):
        raise TypeError(f"{who} with several processes reads the loader's whole batches from the Trainer's "
                        f"PromptStream (its whole()); got {type(prompts).__name__}")
    return prompts.whole()


def hand_out(parts: list) -> None:
    """Rank 0: send ``parts[r]`` to rank ``r`` (``r >= 1``); each part is a message (see :func:`receive`)."""
    torch.distributed.scatter_object_list([None], [None] + [_cpu(p) for p in parts], src=0)


def receive(device) -> tuple:
    """A rank ``> 0``: the message rank 0 handed out, tensors on ``device``: ``("batch", *part, stats)`` (part:
    prompts and samples, or a scored batch), ``("end",)`` (the prompts ran out) or ``("error", text)`` (rank 0's
    generation failed)."""
    out = [None]
    torch.distributed.scatter_object_list(out, None, src=0)
    return tuple(to_device(x, device) if isinstance(x, TensorDict) else x for x in out[0])


def _cpu(message: tuple) -> tuple:
    return tuple(to_device(x, "cpu") if isinstance(x, TensorDict) else x for x in message)


__all__ = ["follow", "full_twin", "group_shares", "hand_out", "lead", "ranks", "receive", "received", "refresh",
           "row_shares", "shares", "whole"]
