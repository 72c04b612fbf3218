"""The note for every key the user set that changes nothing here: nothing is silently ignored.

Both the run (:mod:`rlflow.config.verl.run`) and the dry run (:mod:`rlflow.config.verl.dryrun`) print these; a leaf
module, so that neither imports the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlflow.config.verl import tables

if TYPE_CHECKING:
    from rlflow.config.verl.loading import VerlConfig


def unused_notes(cfg: VerlConfig) -> list[str]:
    """A note for every key the user set that changes nothing here: nothing is silently ignored."""
    notes = list(cfg.notes)
    for key in sorted(cfg.provided):
        if key in cfg.read or any(key.startswith(r + ".") for r in cfg.read):
            continue
        if key not in cfg.typed and key in cfg.default_flat and cfg.flat.get(key) == cfg.default_flat[key]:
            continue  # a file's key at its default (verl's whole ppo_trainer.yaml, say): the run is the same without it
        value = cfg.flat.get(key)
        reason = tables.inert_reason(key)
        notes.append(f"{key}={value!r} has no effect in rlflow: {reason}" if reason
                     else f"{key}={value!r} is not used by this configuration")
    return notes
