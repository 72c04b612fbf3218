"""Micro-batches by row count or by token budget (verl: ``use_dynamic_bsz`` + ``ppo_max_token_len_per_gpu``),
and verl's shuffled mini-batches (``actor.shuffle``; :func:`shuffled_mini_batches`).

The Trainer normalises each micro-batch's loss by its mini-batch's totals, so
any partition of a mini-batch into micro-batches gives the same gradient: rows
may be grouped by length freely.

Token count of a row (:func:`row_tokens`): the prompt's real tokens plus the
response up to its last token with ``response_mask == 1`` (tool/observation tokens
inside the response count: the model reads them), i.e. what a padding-free pass
runs over.

Plan with a budget (:func:`plan`): first-fit decreasing. Rows are taken longest
first and put into the first micro-batch with room (``<= max_tokens`` tokens and
``< micro_batch_size`` rows when that is given); a row longer than the budget gets
a micro-batch of its own. Each micro-batch then lists its rows in their original
order. Without a budget it is ``batch.split(micro_batch_size)``, unchanged.

Several processes: FSDP2/DDP collectives need every rank to run the same number of
forward/backward passes. With a budget, the ranks all-reduce the maximum count and a
rank with fewer micro-batches splits its largest (in tokens, with at least two rows)
in two until the counts match (splitting never breaks the budget). This needs at
least as many rows on each rank as that maximum count, which holds when ranks hold
equal row counts (as ``rank_shard`` gives); otherwise it raises.

Scoring passes (:func:`scoring_pieces`: old/ref log-probs, values; verl's ``log_prob_use_dynamic_bsz`` +
``log_prob_max_token_len_per_gpu``, ``critic.forward_max_token_len_per_gpu``) use the same plan; their outputs are
put back in the batch's row order (verl's ``restore_dynamic_batch``). There is no gradient to normalise, so any
partition gives the same numbers. Across processes the counts are made equal over ``torch.distributed``'s
default group (FSDP2's forward is collective too).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.data.nontensor import shallow_copy


def row_tokens(batch: TensorDict) -> torch.Tensor:
    """Tokens per row: prompt mask sum + response length up to its last valid token (``B``, int64)."""
    n = batch[K.PROMPT_MASK].long().sum(-1)
    if K.RESPONSE_MASK in batch.keys():
        mask = batch[K.RESPONSE_MASK]
        idx = torch.arange(1, mask.shape[1] + 1, device=mask.device)
        return n + (mask.bool() * idx).amax(-1)
    if K.RESPONSE_IDS in batch.keys():
        return n + batch[K.RESPONSE_IDS].shape[1]
    return n


def plan(lengths: list[int], micro_batch_size: int | None, max_tokens: int, min_count: int = 0) -> list[list[int]]:
    """Row indices of each micro-batch (see the module docstring); at least ``min_count`` of them if possible."""
    cap = micro_batch_size or len(lengths) or 1
    groups: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for g, members in enumerate(groups):
            if used[g] + lengths[i] <= max_tokens and len(members) < cap:
                members.append(i)
                used[g] += lengths[i]
                break
        else:
            groups.append([i])
            used.append(lengths[i])
    while len(groups) < min_count:
        splittable = [g for g in range(len(groups)) if len(groups[g]) > 1]
        if not splittable:
            raise RuntimeError(f"cannot make {min_count} micro-batches out of {len(lengths)} rows: "
                               "every rank must run the same number of micro-batches")
        g = max(splittable, key=lambda g: used[g])
        members = sorted(groups[g], key=lambda i: -lengths[i])
        a, b = members[0::2], members[1::2]  # alternate by length: two halves of similar size
        groups[g], used[g] = a, sum(lengths[i] for i in a)
        groups.append(b)
        used.append(sum(lengths[i] for i in b))
    return [sorted(g) for g in groups]


def micro_batches(batch: TensorDict, micro_batch_size: int | None, max_tokens: int | None,
                  fabric=None) -> list[TensorDict]:
    """Split a mini-batch into micro-batches: by rows (``max_tokens=None``) or by a token budget.

    Args:
        batch: the mini-batch (rows of this rank).
        micro_batch_size: at most this many rows per micro-batch (``None``: no limit on rows).
        max_tokens: at most this many tokens (:func:`row_tokens`) per micro-batch; a longer row goes alone.
        fabric: a ``lightning_fabric.Fabric``; with several processes the micro-batch count is made equal on all ranks.
    """
    size = batch.batch_size[0]
    if max_tokens is None:
        return split_rows(batch, micro_batch_size or size)
    return [batch[g] for g in token_groups(batch, micro_batch_size, max_tokens, fabric)]


def token_groups(batch: TensorDict, micro_batch_size: int | None, max_tokens: int, fabric=None) -> list[torch.Tensor]:
    """Row indices (int64 tensors on the batch's device) of each micro-batch under the budget, the count made
    equal over the processes: through ``fabric``, else ``torch.distributed``'s default group when it is set up."""
    lengths = row_tokens(batch).tolist()
    groups = plan(lengths, micro_batch_size, max_tokens)
    device = batch[K.PROMPT_MASK].device
    most = len(groups)
    if fabric is not None and fabric.world_size > 1:
        most = int(fabric.all_reduce(torch.tensor(len(groups), device=fabric.device), reduce_op="max"))
    elif fabric is None and torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        count = torch.tensor(len(groups), device=device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        most = int(count)
    if most > len(groups):
        groups = plan(lengths, micro_batch_size, max_tokens, min_count=most)
    return [torch.tensor(g, dtype=torch.long, device=device) for g in groups]


def scoring_pieces(batch: TensorDict, micro_batch_size: int | None,
                   max_tokens: int | None) -> tuple[list[TensorDict], torch.Tensor | None]:
    """The micro-batches of a no-grad scoring pass, and the index that puts the concatenated outputs back in the
    batch's row order (``torch.cat(outputs)[restore]``; ``None`` when they already are).

    Without a budget: ``batch.split(micro_batch_size)`` (one piece is ``batch`` itself, read only: no copy). With
    one: :func:`token_groups` (``micro_batch_size`` then also caps the rows of a piece).
    """
    size = batch.batch_size[0]
    if max_tokens is None:
        rows = micro_batch_size or size
        return (list(batch.split(rows)) if rows < size else [batch]), None
    groups = token_groups(batch, micro_batch_size, max_tokens)
    if not groups:  # no rows
        return [batch], None
    order = torch.cat(groups)
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel(), device=order.device)
    return [batch[g] for g in groups], restore


def split_rows(batch: TensorDict, rows: int) -> list[TensorDict]:
    """``batch.split(rows)``: new TensorDicts (keys set on a piece do not reach ``batch``); one piece holding
    every row is a shallow copy (a split rebuilds the non-tensor columns' rows: milliseconds per column)."""
    return [shallow_copy(batch)] if rows >= batch.batch_size[0] else list(batch.split(rows))


def shuffled_mini_batches(rows: int, mini: int, epochs: int, seed: int) -> list[list[torch.Tensor]]:
    """Row indices of each mini-batch of each epoch, dealt at random as verl's ``actor.shuffle=True`` does.

    verl (``verl.utils.tensordict_utils.make_iterator``) iterates ``epochs`` times over a
    ``DataLoader(range(rows), batch_size=mini, shuffle=True, generator=torch.Generator().manual_seed(seed))``
    made anew for every update, with ``seed = data_loader_seed + data-parallel rank``: each epoch is a fresh
    permutation, and every RL step repeats the same sequence of permutations (the rows are new each step).
    The same loader is used here, so the split is verl's, index for index.
    """
    from torch.utils.data import DataLoader

    loader = DataLoader(torch.arange(rows), batch_size=mini, shuffle=True, collate_fn=torch.stack,
                        generator=torch.Generator().manual_seed(seed))
    return [list(loader) for _ in range(epochs)]
