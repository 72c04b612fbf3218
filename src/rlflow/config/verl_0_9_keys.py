"""verl 0.9.1's keys beyond the tree rlflow first mirrored: what each one does here.

Every leaf key of verl 0.9.1's tree (``config/verl/``) can be set. Those that rlflow reads are honoured
where they are read; the rest are listed here, merged into :mod:`rlflow.config.tables`:

- ``INERT``: accepted, and a note at start-up says the key changes nothing here, and why (an engine,
  placement or profiling knob of a system rlflow does not run);
- ``NOT_SUPPORTED``: accepted at verl's default; set otherwise, refused with the feature it asks for,
  because ignoring it would change what the user gets (another algorithm, another model).

Keys are dotted; ``*`` matches any run of characters (``fnmatch``), so one row covers a subtree.
"""

from __future__ import annotations

from typing import Any, Callable


def _truthy(v: Any) -> bool:
    return bool(v)


def _not(*ok: Any) -> Callable[[Any], bool]:
    return lambda v: v not in ok


# ------------------------------------------------------------------ actor_rollout_ref.* and critic.*
ROLE_INERT: dict[str, str] = {
}
ROLE_NOT_SUPPORTED: dict[str, tuple[str, Callable[[Any], bool]]] = {
}

# ------------------------------------------ data, reward_model, algorithm, trainer and the other sections
RUN_INERT: dict[str, str] = {
}
RUN_NOT_SUPPORTED: dict[str, tuple[str, Callable[[Any], bool]]] = {
}

INERT = ROLE_INERT | RUN_INERT
NOT_SUPPORTED = ROLE_NOT_SUPPORTED | RUN_NOT_SUPPORTED
