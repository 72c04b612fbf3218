"""How the dry run writes a number: ``gib`` (bytes in a readable unit) and ``line`` (label, formula, value).

A leaf, so that every section of the dry run (:mod:`rlflow.config.verl.dryrun`, the Megatron one in
:mod:`rlflow.config.verl.megatron`) formats alike without importing the dry run itself.
"""

from __future__ import annotations


def gib(n_bytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= size:
            return f"{n_bytes / size:.2f} {unit}"
    return f"{n_bytes:.0f} B"


def line(label: str, formula: str, value: str) -> str:
    """One row of the dry run's arithmetic: label, how the value was computed, the value."""
    return f"  {label:<29}{formula:<61} = {value}"
