"""Plain nested-dict config trees: dotted keys, and verl's ``_target_`` hints dropped."""

from __future__ import annotations

from typing import Any


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; an empty dict stays a leaf."""
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out |= flatten(v, f"{prefix}{k}.")
        return out
    return {prefix[:-1]: tree}


def strip_targets(tree: Any) -> Any:
    """Drop verl's ``_target_`` entries (dataclass hints with no meaning here)."""
    if isinstance(tree, dict):
        return {k: strip_targets(v) for k, v in tree.items() if k != "_target_"}
    return tree


def changed_leaves(tree: dict, base: dict) -> dict:
    """The nested dict of the leaves of ``tree`` whose value differs from ``base``'s (or that it lacks)."""
    flat_base, out = flatten(base), {}
    for key, value in flatten(tree).items():
        if key in flat_base and flat_base[key] == value:
            continue
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out
