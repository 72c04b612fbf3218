"""The one contract every rlflow role follows: TensorDict in, TensorDict out.

A module declares the keys it reads (``in_keys``) and writes (``out_keys``).
The Trainer walks the chain Rollout -> Reward -> Policy -> Estimator -> Loss
when it is built, so a missing key fails at once, naming the key and the
module, never after the first expensive rollout.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tensordict import TensorDict


class BatchModule:
    """Base of every role. Subclasses set ``in_keys`` / ``out_keys`` and implement ``forward``."""

    in_keys: tuple[str, ...] = ()
    out_keys: tuple[str, ...] = ()

    def forward(self, batch: TensorDict) -> TensorDict:  # pragma: no cover - interface
        raise NotImplementedError

    def __call__(self, batch: TensorDict) -> TensorDict:
        missing = [k for k in self.in_keys if k not in batch.keys()]
        if missing:
            raise KeyError(
                f"{type(self).__name__} needs batch key(s) {missing}; the batch has {sorted(batch.keys())}"
            )
        return self.forward(batch)


class MissingKeyError(KeyError):
    """Raised when a chain of modules cannot be satisfied."""


def check_chain(provided: Iterable[str], modules: Sequence[tuple[str, object]]) -> set[str]:
    """Check that each module's ``in_keys`` are written by the data or an earlier module.

    Args:
        provided: keys available before the first module (the data's keys).
        modules: ``(role, module)`` pairs in the order they run; ``None`` modules are skipped.

    Returns:
        Every key available after the last module.

    Raises:
        MissingKeyError: naming the first missing key, the module that needs it and
            what was available at that point.
    """
    available = set(provided)
    for role, module in modules:
        if module is None:
            continue
        for key in getattr(module, "in_keys", ()):
            if key not in available:
                raise MissingKeyError(
                    f"{role} ({type(module).__name__}) reads '{key}', but nothing before it writes it. "
                    f"Available at that point: {sorted(available)}"
                )
        available |= set(getattr(module, "out_keys", ()))
    return available
