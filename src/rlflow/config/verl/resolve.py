"""Resolve config strings to classes and constructor arguments, once, at the edge.

``resolve_class`` looks a name up in a table and then in a module; ``class_kwargs`` maps config
values onto a class's constructor by parameter name, so a new class with a new argument plugs in
through the pool of candidate values without touching the builders.
"""

from __future__ import annotations

import difflib
import inspect
from types import ModuleType
from typing import Any, Callable

from rlflow.config.verl.loading import ConfigError, NotSupportedError, VerlConfig


def resolve_class(key: str, value: str, table: dict[str, str], module: ModuleType) -> type:
    """``table[value]`` looked up in ``module``; unknown names and missing classes are clear errors."""
    if value not in table:
        close = difflib.get_close_matches(str(value), list(table), n=3)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        raise ConfigError(f"{key}={value!r}: unknown value.{hint} Known: {', '.join(table)}")
    cls = getattr(module, table[value], None)
    if cls is None:
        raise NotSupportedError(key, value, f"{table[value]} ({value})",
                                f"rlflow.{module.__name__.split('.', 1)[1]} has no class {table[value]} yet.")
    return cls


def init_parameters(cls: type) -> dict[str, inspect.Parameter]:
    """Constructor parameters, following ``**kwargs`` up the MRO (a subclass forwarding to its base)."""
    params: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        sig = inspect.signature(init)
        forwards = False
        for name, p in list(sig.parameters.items())[1:]:
            if p.kind is p.VAR_KEYWORD:
                forwards = True
            elif p.kind is not p.VAR_POSITIONAL:
                params.setdefault(name, p)
        if not forwards:
            break
    return params


class Candidate:
    """A value for a constructor parameter and the config keys it comes from (read only if used).

    It is passed when the user set one of its keys, when ``always``, or when the parameter has no
    default; otherwise the class's own default stands (e.g. GSPO's clip range, SAPO's aggregation).
    """

    def __init__(self, keys: tuple[str, ...], compute: Callable[[VerlConfig], Any], always: bool = False):
        self.keys, self.compute, self.always = keys, compute, always


def key(k: str, always: bool = False) -> Candidate:
    return Candidate((k,), lambda cfg: cfg[k], always)


class Fill:
    """A placeholder for an object made at build time (the rollout, a reward, a KL controller)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


def fill(name: str) -> Candidate:
    return Candidate((), lambda cfg: Fill(name), always=True)


def class_kwargs(cls: type, pool: dict[str, Candidate], cfg: VerlConfig, fixed: dict | None = None) -> dict:
    """Keyword arguments for ``cls`` from ``pool`` (by parameter name); ``fixed`` ones always pass."""
    kwargs = dict(fixed or {})
    for name, param in init_parameters(cls).items():
        if name in kwargs:
            continue
        required = param.default is inspect.Parameter.empty
        if name in pool and (required or pool[name].always or any(map(cfg.is_provided, pool[name].keys))):
            kwargs[name] = pool[name].compute(cfg)
        elif required:
            raise ConfigError(f"{cls.__name__} needs argument '{name}', which no config key provides")
    return kwargs


def instantiate(cls: type, kwargs: dict, keys: str) -> Any:
    """``cls(**kwargs)``, turning a constructor's complaint into an error that names the config keys."""
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{keys}: {cls.__name__}({format_kwargs(kwargs)}) failed: {e}") from e


def format_value(v: Any) -> str:
    """A function or partial shows as its name, anything else as its repr."""
    import functools

    while isinstance(v, functools.partial):
        v = v.func
    return v.__name__ if inspect.isfunction(v) or inspect.isclass(v) else repr(v)


def format_kwargs(kwargs: dict) -> str:
    return ", ".join(f"{k}={format_value(v)}" for k, v in kwargs.items())
