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


class Chain(BatchModule):
    """Modules run in order as one: ``Chain(KLInReward(...), GRPO())`` fills the Trainer's estimator slot.

    ``in_keys`` are the keys the chain needs from outside (those no earlier member
    writes); ``out_keys`` everything the members write. ``needs_critic`` holds if any
    member needs one. Members with ``state_dict``/``load_state_dict`` (e.g. an adaptive
    KL controller) are saved in checkpoints through the chain's.
    """

    def __init__(self, *modules: BatchModule):
        if not modules:
            raise ValueError("Chain needs at least one module")
        self.modules = modules
        needed, written = [], set()
        for m in modules:
            needed += [k for k in m.in_keys if k not in written and k not in needed]
            written |= set(m.out_keys)
        self.in_keys, self.out_keys = tuple(needed), tuple(written)
        self.needs_critic = any(getattr(m, "needs_critic", False) for m in modules)

    def forward(self, batch: TensorDict) -> TensorDict:
        for m in self.modules:
            batch = m(batch)
        return batch

    @property
    def stats(self) -> dict[str, float]:
        """The members' metrics of the last call, merged (the Trainer logs them)."""
        out: dict[str, float] = {}
        for m in self.modules:
            out |= getattr(m, "stats", {})
        return out

    def state_dict(self) -> dict:
        return {str(i): m.state_dict() for i, m in enumerate(self.modules) if hasattr(m, "state_dict")}

    def load_state_dict(self, state: dict) -> None:
        for i, m in enumerate(self.modules):
            if str(i) in state:
                m.load_state_dict(state[str(i)])

    def __repr__(self) -> str:
        return f"Chain({', '.join(type(m).__name__ for m in self.modules)})"
