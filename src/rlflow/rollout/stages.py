"""The stages of the experience stream (:class:`~rlflow.rollout.stream.Experience`), by where they run (``where``):

- ``"engine"``: :class:`Prefetch` runs the rollout's engine beside the trainer (``AsyncRollout``);
- ``"samples"``: ``stage(prompts, samples) -> samples`` on every generated batch, before the reward
  (:class:`ReferenceResponses`);
- ``"scored"``: ``stage.stream(batches, experience)`` transforms the stream of scored batches (:class:`FilterGroups`,
  or any ``BatchModule`` as :class:`ModuleStage`).

Each is timed as ``timing_s/<stage.name>``; its ``stats`` join the batch's metrics.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.roles import Rollout, optional
from rlflow.rollout.async_rollout import AsyncRollout
from rlflow.rollout.dynamic_sampling import first_groups, group_metric, informative_rows
from rlflow.rollout.reference_responses import add_reference_rows
from rlflow.rollout.wrapper import cat_batches

if TYPE_CHECKING:
    from rlflow.rollout.stream import Experience

WHERE = ("engine", "samples", "scored")


class Stage:
    """Base of the stages: ``name`` (its timer, ``timing_s/<name>``), ``where`` (see the module docstring),
    ``stats`` (merged into the batch's metrics), ``in_keys``/``out_keys`` (the Trainer's key check)."""

    name, where = "stage", "scored"
    in_keys: tuple[str, ...] = ()
    out_keys: tuple[str, ...] = ()

    def __init__(self):
        self.stats: dict[str, float] = {}

    def bind(self, experience: "Experience") -> None:
        """Called once when the experience is made: a stage may take the run's rollout, reward or tokenizer."""

    def stream(self, batches: Iterator[TensorDict], experience: "Experience") -> Iterator[TensorDict]:
        for batch in batches:
            yield self(batch)


class ModuleStage(Stage):
    """A ``BatchModule`` (e.g. ``GreedyBaseline``) as a scored stage: applied to every batch."""

    def __init__(self, module):
        super().__init__()
        self.module, self.name = module, getattr(module, "stage_name", type(module).__name__.lower())

    @property
    def in_keys(self):
        return tuple(self.module.in_keys)

    @property
    def out_keys(self):
        return tuple(self.module.out_keys)

    def bind(self, experience):
        if getattr(self.module, "rollout", False) is None:  # GreedyBaseline(): the run's rollout and reward
            self.module.rollout = experience.rollout
        if getattr(self.module, "reward", False) is None:
            self.module.reward = experience.reward

    def __call__(self, batch):
        out = self.module(batch)
        self.stats = dict(getattr(self.module, "stats", {}))
        return out

    def __repr__(self):
        return repr(self.module)


class FilterGroups(Stage):
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476; verl ``algorithm.filter_groups``).

    Keeps the groups whose ``metric`` differs across their samples (a one-sample group is kept, as in verl);
    while fewer groups than the first batch's prompts are kept, it pulls the next scored batch from the
    stream (which draws the next prompt batch from the stream's own iterator). The first ``P`` kept groups
    go on, in order, with ``group`` renumbered ``0..P-1``.

    Args:
        metric: ``"score"``, ``"seq_reward"`` (``token_rewards`` summed) or a column of ``reward.extras``
            (e.g. ``"acc"``).
        max_gen_batches: generation rounds allowed per step (verl ``max_num_gen_batches``); reaching it
            without enough groups raises ``RuntimeError``.

    ``stats``: ``dapo/num_gen_batches``, ``dapo/kept_group_frac`` (kept / generated, before the cut) and
    ``dapo/gen_score_mean`` (over every generated sample). Timed as ``timing_s/dynamic_sampling``.

    **Over a stream of groups** (a rollout with ``want``: ``FullyAsyncRollout``) a filtered group is replaced by
    the next group to finish, one for one: the stage asks the rollout for exactly the missing groups
    (``rollout.want(k)``), which it takes for the same step, within the staleness bound, so no kept group is
    generated and then cut. ``max_gen_batches`` bounds the groups scored per step to ``max_gen_batches x P``,
    what that many synchronous rounds generate; ``dapo/num_gen_batches`` is then the groups scored / ``P``
    (batches' worth, e.g. 1.25).

    **Several processes with the engine on rank 0** (``AsyncRollout``, ``FullyAsyncRollout``): the stage runs on
    rank 0 alone, over whole batches scored there, and the experience stream hands each rank its share of the kept
    groups with rank 0's metrics (:mod:`rlflow.rollout.ranks`). With a rollout on every rank each filters its own.
    """

    name = "dynamic_sampling"

    def __init__(self, metric: str = "score", max_gen_batches: int = 10):
        if max_gen_batches < 1:
            raise ValueError(f"max_gen_batches must be >= 1, got {max_gen_batches}")
        super().__init__()
        self.metric, self.max_gen_batches = metric, max_gen_batches

    def stream(self, batches, experience):
        want = optional(experience.rollout, Rollout, "want")
        if want is not None:
            yield from self._groupwise(batches, experience, want)
            return
        pad = experience.tokenizer.pad_token_id
        for samples in batches:
            target = int(torch.unique(samples[K.GROUP]).numel())
            kept, n_kept, n_groups, offset, scores = [], 0, 0, 0, []
            for round_ in range(1, self.max_gen_batches + 1):
                if round_ > 1:
                    samples = next(batches, None)
                    if samples is None:
                        raise RuntimeError("FilterGroups (dynamic sampling) needs more prompt batches than the stream "
                                           f"has: {n_kept} of {target} groups kept after {round_ - 1} batch(es)")
                scores.append(samples[K.SCORES])
                samples.set(K.GROUP, samples[K.GROUP] + offset)  # ids unique across rounds
                offset = int(samples[K.GROUP].max()) + 1
                metric = group_metric(samples, self.metric, experience.reward)
                rows, kept_groups, groups = informative_rows(metric, samples[K.GROUP])
                kept.append(samples[rows])
                n_kept, n_groups = n_kept + kept_groups, n_groups + groups
                if n_kept >= target:
                    break
            else:
                raise RuntimeError(
                    f"DynamicSampling: {self.max_gen_batches} generation batches (max_gen_batches) gave only {n_kept} "
                    f"prompt groups with a non-constant {self.metric!r} out of {n_groups} generated; {target} are "
                    "needed. Most prompts are solved by every sample or by none: raise max_gen_batches, change n, or "
                    "the data")
            self.stats = {"dapo/num_gen_batches": float(round_), "dapo/kept_group_frac": n_kept / n_groups,
                          "dapo/gen_score_mean": float(torch.cat(scores).float().mean())}
            yield first_groups(cat_batches(kept, pad), target)

    def _groupwise(self, batches, experience, want):
        """Over a stream of groups: the filtered ones replaced one for one (see the class docstring)."""
        for samples in batches:  # several processes: on rank 0 alone, over whole batches (Experience)
            target = int(torch.unique(samples[K.GROUP]).numel())
            budget = self.max_gen_batches * target  # verl's 0 (no cap) arrives as sys.maxsize
            kept, n_kept, n_groups, offset, scores = [], 0, 0, 0, []
            while True:
                scores.append(samples[K.SCORES])
                samples.set(K.GROUP, samples[K.GROUP] + offset)  # ids unique across takes
                offset = int(samples[K.GROUP].max()) + 1
                rows, kept_groups, groups = informative_rows(group_metric(samples, self.metric, experience.reward),
                                                             samples[K.GROUP])
                kept.append(samples[rows])
                n_kept, n_groups = n_kept + kept_groups, n_groups + groups
                if n_kept >= target:
                    break
                if n_groups >= budget:
                    raise RuntimeError(
                        f"DynamicSampling: {n_groups} groups scored for one step ({self.max_gen_batches} batches' "
                        f"worth, max_gen_batches) gave only {n_kept} prompt groups with a non-constant "
                        f"{self.metric!r}; {target} are needed. Most prompts are solved by every sample or by none: "
                        "raise max_gen_batches, change n, or the data")
                want(min(target - n_kept, budget - n_groups))
                samples = next(batches, None)
                if samples is None:
                    raise RuntimeError("FilterGroups (dynamic sampling) needs more prompts than the stream has: "
                                       f"{n_kept} of {target} groups kept after {n_groups} scored")
            self.stats = {"dapo/num_gen_batches": n_groups / target, "dapo/kept_group_frac": n_kept / n_groups,
                          "dapo/gen_score_mean": float(torch.cat(scores).float().mean())}
            yield first_groups(cat_batches(kept, experience.tokenizer.pad_token_id), target)

    def __repr__(self):
        return f"FilterGroups(metric={self.metric!r}, max_gen_batches={self.max_gen_batches})"


class ReferenceResponses(Stage):
    """SPIN's real data: after generation, each prompt's reference response joins its group as one more row
    (``is_reference``), and is scored with the samples. ``text(ground_truth, extra_info) -> str`` picks the
    reference (default: the ground truth). See :class:`~rlflow.rollout.reference_responses.WithReferenceResponses`
    for the layout. Timed as ``timing_s/reference_responses``."""

    name, where = "reference_responses", "samples"
    in_keys, out_keys = (K.GROUND_TRUTH, K.EXTRA_INFO), (K.IS_REFERENCE,)

    def __init__(self, text=None):
        super().__init__()
        self.text = text or (lambda ground_truth, extra_info: str(ground_truth))

    def bind(self, experience):
        self.tokenizer = experience.tokenizer

    def __call__(self, prompts, samples):
        return add_reference_rows(prompts, samples, self.tokenizer, self.text)


class Prefetch(Stage):
    """Generation beside training, up to ``max_staleness`` batches ahead (``AsyncRollout``: its arguments).

    The experience wraps its rollout in ``AsyncRollout(rollout, max_staleness, **options)``; the engine reads
    the next ``max_staleness`` prompt batches from the stream as it goes, so what it generates ahead is what
    the trainer takes next (``0``: synchronous, ``1``: one-step-off)."""

    name, where = "prefetch", "engine"

    def __init__(self, max_staleness: int = 1, **options):
        super().__init__()
        self.max_staleness, self.options = max_staleness, options

    def wrap(self, rollout):
        return AsyncRollout(rollout, self.max_staleness, **self.options)
