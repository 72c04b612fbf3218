"""Which finished groups form the next step's batch in :class:`~rlflow.rollout.FullyAsyncRollout` (verl's custom
replay-buffer sampler, ``trainer.v1.sampler.custom_sampler``).

Finished groups wait in a buffer until the trainer takes a batch. :class:`GroupSampler` chooses which: its
``choose(groups, k, step)`` gets the waiting groups (:class:`WaitingGroup`, oldest admitted first), the number to
take and the trainer's version, and returns ``k`` distinct indices into ``groups``. The default takes the first
``k`` (first admitted, first trained). Subclass it and override ``choose``, e.g. to train the groups with the
longest responses first, or the most varied rewards once scored elsewhere.

The staleness bound holds whatever the choice: groups already over ``max_off_policy_threshold`` are dropped
(strategy ``drop``) before the choice, and a group that would be over it at the next version (age >= threshold)
is taken before the sampler chooses the rest, so that a sampler passing it over never makes it wait past the bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensordict import TensorDict


@dataclass(frozen=True)
class WaitingGroup:
    """One finished prompt's group as the sampler sees it: its admission order, its prompt row (``[1]``), the
    token ids of its ``n`` responses (an agent loop's: the model's and the tools' tokens), and its age if trained now (versions from admission: ``1`` is the current)."""

    seq: int
    prompt: TensorDict
    responses: list[list[int]]
    age: int


class GroupSampler:
    """First admitted, first trained: the rule :class:`~rlflow.rollout.FullyAsyncRollout` uses unless given another
    sampler (a subclass overriding :meth:`choose`)."""

    def choose(self, groups: list[WaitingGroup], k: int, step: int) -> list[int]:
        """``k`` distinct indices into ``groups`` (oldest admitted first; ``len(groups) >= k``): the groups trained at
        the trainer's version ``step``."""
        return list(range(k))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def choose_groups(sampler: GroupSampler, ready: list, k: int, version: int, threshold: int | None) -> list[int]:
    """Indices into ``ready`` (FullyAsyncRollout's finished groups, sorted by admission) of the ``k`` to train:
    the ones at the bound first, then the sampler's choice among the others, checked."""
    ages = [version - g.admitted + 1 for g in ready]
    forced = [i for i, age in enumerate(ages) if threshold is not None and age >= threshold][:k]
    others = [i for i in range(len(ready)) if i not in forced]
    wanted = k - len(forced)
    if wanted == 0:
        return forced
    views = [WaitingGroup(ready[i].seq, ready[i].row, [_response(s) for s in ready[i].samples], ages[i])
             for i in others]
    chosen = sampler.choose(views, wanted, version)
    if not isinstance(chosen, (list, tuple)) or len(chosen) != wanted or len(set(chosen)) != wanted or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(views) for i in chosen):
        raise ValueError(f"{type(sampler).__name__}.choose(groups, k={wanted}, step={version}) returned {chosen!r}: "
                         f"it must return {wanted} distinct indices into groups (0 to {len(views) - 1})")
    return forced + [others[i] for i in chosen]


def _response(sample) -> list[int]:
    """A sample's response token ids: a single-turn ``Sample``'s tokens, an agent ``Trajectory``'s response."""
    return list(sample.response_ids if hasattr(sample, "response_ids") else sample.tokens)
