"""Validation: sample the validation prompts, score them, and report verl's metric names.

``Trainer.validate`` calls :func:`validate`; it lives here so the Trainer reads like the data flow.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch

from rlflow.data import keys as K
from rlflow.data.nontensor import column, to_device
from rlflow.data.prompts import PromptData
from rlflow.roles import Reward, optional
from rlflow.trainer.distributed import gather_objects
from rlflow.trainer.generations import batch_columns, concat, wants


@torch.no_grad()
def validate(trainer, data: PromptData) -> dict[str, float]:
    """Validation metrics per data source, under verl's names.

    Sampling: ``trainer.val_sampling`` when set (``Loop(val_sampling=...)``: the rollout's options with ``n``;
    the verl entry point passes ``rollout.val_kwargs``), else one greedy sample per prompt when ``val_n == 1`` and ``val_n``
    samples at the rollout's temperature otherwise.

    Scoring: the run's reward (``trainer.reward``, the experience's).

    Variables: ``reward`` (the score) and ``acc`` (the scorer's ``acc`` extra, when it returns one). The
    core variable is ``acc`` when present, else ``reward``; for it ``val-core/<source>/<var>/mean@N`` and,
    when N > 1, ``best@N/mean`` and ``maj@N/mean`` (majority vote over the scorer's ``pred`` extra).
    Everything else (``worst@N/mean``, ``std@N``, the other variable) goes under ``val-aux/``.

    With several processes each rank generates for every ``world``-th prompt and the scores are
    gathered before the metrics, which every rank then holds.

    When a callback has ``on_validation_generations`` (``rlflow.trainer.generations``), it is called with
    every sample's text columns (input, output, gts, score, ``reward`` and the scorer's extras), gathered
    from all ranks, before ``on_validation_end``.
    """
    opts = trainer.val_sampling or {
        "n": trainer.val_n, "do_sample": trainer.val_n > 1,
        "temperature": trainer.rollout.temperature if trainer.val_n > 1 else 1.0}
    n = opts["n"]
    rollout = trainer.rollout.with_options(**opts)
    values: dict[str, dict[str, list]] = {}   # source -> variable -> one list of n values per prompt
    votes: dict[str, list] = {}               # source -> one list of n predictions (or None) per prompt
    reward = trainer.reward
    rank, world = trainer.fabric.global_rank, trainer.fabric.world_size
    samples = [] if wants(trainer, "on_validation_generations") else None  # per batch: verl's dump columns
    for prompts in data.val_batches(trainer.policy.tokenizer):
        prompts = prompts[rank::world] if world > 1 else prompts
        if prompts.batch_size[0] == 0:
            continue
        with getattr(trainer, "generation_precision", contextlib.nullcontext)():  # the training precision
            batch = rollout(to_device(prompts, trainer.fabric.device))
        batch = reward(batch)
        extras, scores = optional(reward, Reward, "extras"), batch[K.SCORES].tolist()
        accs, preds, sources = extras.get("acc"), extras.get("pred"), column(batch, K.DATA_SOURCE)
        if samples is not None:
            samples.append(batch_columns(batch, trainer.policy.tokenizer, {"reward": scores, **extras}))
        for i in range(0, len(sources), n):  # one prompt's n samples are contiguous
            per = values.setdefault(sources[i], {})
            per.setdefault("reward", []).append(scores[i : i + n])
            acc, pred = (accs or [None] * len(sources))[i : i + n], (preds or [None] * len(sources))[i : i + n]
            if all(a is not None for a in acc):
                per.setdefault("acc", []).append([float(a) for a in acc])
            votes.setdefault(sources[i], []).append(
                [str(p) for p in pred] if all(p is not None for p in pred) else None)
    shards = gather_objects(trainer.fabric, (values, votes, samples))
    values, votes = _merge_shards([shard[:2] for shard in shards])
    if samples is not None:
        trainer.fabric.call("on_validation_generations", trainer=trainer,
                            samples=concat([part for shard in shards for part in shard[2]]))
    metrics = {}
    for src, per in values.items():
        core = "acc" if len(per.get("acc", ())) == len(per["reward"]) else "reward"
        for var, rows in per.items():
            s, tier = torch.tensor(rows, dtype=torch.float64), ("val-core" if var == core else "val-aux")
            metrics[f"{tier}/{src}/{var}/mean@{n}"] = s.mean().item()
            if n == 1:
                continue
            metrics[f"{tier}/{src}/{var}/best@{n}/mean"] = s.max(-1).values.mean().item()
            metrics[f"val-aux/{src}/{var}/worst@{n}/mean"] = s.min(-1).values.mean().item()
            metrics[f"val-aux/{src}/{var}/std@{n}"] = s.std(-1, correction=0).mean().item()
            if all(v is not None for v in votes[src]):  # the value of the first sample with the top answer
                maj = [row[p.index(Counter(p).most_common(1)[0][0])] for row, p in zip(rows, votes[src])]
                metrics[f"{tier}/{src}/{var}/maj@{n}/mean"] = sum(maj) / len(maj)
    trainer.fabric.call("on_validation_end", trainer=trainer, metrics=metrics)
    return metrics


def _merge_shards(shards: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """Validation lists of every rank, concatenated in rank order (values and votes stay aligned)."""
    values: dict[str, dict[str, list]] = {}
    votes: dict[str, list] = {}
    for shard_values, shard_votes in shards:
        for src, per in shard_values.items():
            for var, rows in per.items():
                values.setdefault(src, {}).setdefault(var, []).extend(rows)
        for src, rows in shard_votes.items():
            votes.setdefault(src, []).extend(rows)
    return values, votes
