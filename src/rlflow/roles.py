"""The roles a Trainer is built from, written down: ``typing.Protocol`` classes with the members the Trainer, the
experience stream (``rlflow.rollout.stream``) and validation read, checked when the Trainer is built.

Every role is a :class:`~rlflow.module.BatchModule` at heart (``in_keys``, ``out_keys``, ``__call__(batch)``); the
Protocols add what each role is asked beyond that. A class need not inherit from them: having the members is
enough (structural typing, as ``typing.Protocol`` means). :func:`check_roles` names the object, the role and the
first missing member before anything runs, as :func:`rlflow.module.check_chain` does for the batch keys.

Some members are optional: a role may leave them out and gets the default written in :data:`OPTIONAL` (a
reward's ``stats``, a rollout's ``close``). They are read through :func:`optional`, so what a role may offer is
written here once instead of as a ``getattr(x, "name", default)`` at each place that reads it.

The engine under a single-turn rollout (:class:`Engine`) is bound late, inside ``rollout.bind``; its Protocol is
written here for engine authors, who subclass :class:`rlflow.rollout.engines.Engine` (a single-turn rollout
refuses anything else when it is built: the base class gives the optional members their defaults).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

EMPTY = MappingProxyType({})  # a read-only {} as a default: a role that fills stats assigns its own dict


@runtime_checkable
class Role(Protocol):
    """What every role is: a module over the batch that says which keys it reads and writes."""

    in_keys: tuple[str, ...]
    out_keys: tuple[str, ...]

    def __call__(self, batch): ...


@runtime_checkable
class Rollout(Role, Protocol):
    """Turns prompt rows into ``n`` sampled responses each (``rlflow.rollout``: ``HFRollout``, ``VLLMRollout``,
    ``ServerRollout``, ``AgentLoop``, ``AsyncRollout``...).

    ``bind(model, tokenizer)`` is called once by the Trainer with the model to sample from; ``sync_weights(trained)``
    after every update (returns metrics or ``None``); ``with_options(**overrides)`` is a copy with other sampling
    options (validation). ``holds_own_weights``: the engine keeps a copy of the weights of its own (vLLM, a server),
    so the Trainer sends updates instead of sampling with the trained module. ``max_new_tokens``: the response
    budget (``None``: no fixed one), for the clip-ratio metrics. Optional: ``stream``, ``in_flight``, ``stats``,
    ``close``, and ``want(groups)`` (a stream of groups: the next batch holds that many, for dynamic sampling).
    """

    n: int
    temperature: float
    max_new_tokens: int | None
    holds_own_weights: bool
    tokenizer: Any

    def bind(self, model, tokenizer) -> None: ...

    def sync_weights(self, trained) -> dict | None: ...

    def with_options(self, **overrides) -> "Rollout": ...


@runtime_checkable
class Reward(Role, Protocol):
    """Scores the samples (``rlflow.rewards``); optional ``stats`` (metrics of the last call) and ``extras``
    (per-row values by name, e.g. ``acc``) as :class:`rlflow.rewards.Reward` keeps them."""


@runtime_checkable
class AdvantageEstimator(Role, Protocol):
    """Writes advantages and returns (``rlflow.algorithms``); ``needs_critic``: the Trainer computes ``values``
    first. Optional ``stats``: metrics of the last call (``actor/reward_kl``...)."""

    needs_critic: bool


@runtime_checkable
class Loss(Protocol):
    """``loss(batch, aggregation) -> LossOutput`` (``rlflow.algorithms.aggregate.call_loss``); ``in_keys``: what
    it reads, checked against what the run writes."""

    in_keys: tuple[str, ...]

    def __call__(self, batch, aggregation): ...


@runtime_checkable
class Policy(Role, Protocol):
    """The model being trained (:class:`rlflow.models.policy.Policy`): ``model`` (the transformers model the rollout
    samples from), ``module`` (what Fabric wraps and the optimizer steps), ``log_probs(batch)`` for the update,
    ``reference()`` a frozen copy for the KL term, ``engine_copy()`` a full copy for an engine under a sharded
    strategy."""

    model: Any
    module: Any
    tokenizer: Any
    temperature: float

    def log_probs(self, batch): ...

    def reference(self): ...

    def engine_copy(self): ...


@runtime_checkable
class Engine(Protocol):
    """What a single-turn rollout samples with (``rlflow.rollout.engines``: HF, vLLM, a server, or your own): built
    without a model, ``bind(model, tokenizer)`` by the rollout's ``bind``; ``generate`` the completions of prompt
    token ids; ``load_weights`` after an update when it ``holds_own_weights``. Subclassing
    :class:`rlflow.rollout.engines.Engine` gives every other member the rollout reads a default (``stats``,
    ``loaded_from``, ``module``, ``accepts_images``, ``supports_ignore_eos``, ``remote``, ``generate_tensors``)."""

    holds_own_weights: bool

    def bind(self, model, tokenizer) -> None: ...

    def generate(self, prompts, params): ...

    def load_weights(self, weights) -> None: ...


# role -> {member: default} of the members a role may leave out
OPTIONAL: dict[type, dict[str, Any]] = {
    Rollout: {"stats": EMPTY, "close": None, "stream": None, "in_flight": (), "want": None},
    Reward: {"stats": EMPTY, "extras": EMPTY},
    AdvantageEstimator: {"stats": EMPTY},
}


def optional(obj, role: type, name: str):
    """``obj``'s optional member ``name`` of ``role``, or the default :data:`OPTIONAL` writes for it."""
    return getattr(obj, name, OPTIONAL[role][name])


def members(role: type) -> dict[str, bool]:
    """The members ``role`` asks for, in the order its classes write them: name -> whether it is a method."""
    out: dict[str, bool] = {}
    for cls in reversed(role.__mro__):
        if cls is Protocol or not vars(cls).get("_is_protocol"):
            continue
        out |= {name: False for name in vars(cls).get("__annotations__", {})}
        out |= {name: True for name, v in vars(cls).items()
                if callable(v) and (name == "__call__" or not name.startswith("_"))}
    return out


def missing(obj, role: type) -> list[str]:
    """The members of ``role`` that ``obj`` lacks (a method must be callable)."""
    return [name for name, method in members(role).items()
            if not hasattr(obj, name) or (method and not callable(getattr(obj, name)))]


def article(role: type) -> str:
    return ("an " if role.__name__[0] in "AEIOU" else "a ") + role.__name__


def check_roles(roles) -> None:
    """``roles``: ``(name, object, Protocol)`` triples. Raises ``TypeError`` naming the first object that is
    ``None`` or lacks a member of its role, the role and every member it lacks."""
    for name, obj, role in roles:
        asks = ", ".join(members(role))
        if obj is None:
            raise TypeError(f"{name} is None: the Trainer needs {article(role)} (rlflow.roles.{role.__name__} "
                            f"asks for {asks})")
        lacks = missing(obj, role)
        if lacks:
            raise TypeError(f"{name} ({type(obj).__name__}) is not {article(role)}: it has no "
                            f"{', '.join(repr(m) for m in lacks)} (rlflow.roles.{role.__name__} asks for {asks})")
