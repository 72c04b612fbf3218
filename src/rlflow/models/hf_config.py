"""A model's transformers config with overrides applied before the model is built (verl's
``model.override_config``), and the ``from_pretrained`` arguments that go with it.

``override_config`` follows verl's ``update_model_config``: each entry sets the config attribute of that
name; a dict entry goes into a sub-config (``text_config``) or updates a dict attribute
(``rope_parameters``). verl's special entries: ``attn_implementation`` is an argument of ``from_pretrained``,
not an attribute; a ``model_config`` entry (verl's Megatron layout) holds the overrides instead of the whole
dict. Unlike verl, an entry the config does not have is an error (transformers would keep it and no layer
would read it): transformers 5 keeps ``rope_theta`` inside ``rope_parameters``, for example.

``trust_remote_code`` is transformers' own switch, off by default: a folder whose ``config.json`` maps its
classes to Python files in the folder (``auto_map``) loads only with it.
"""

from __future__ import annotations

import difflib
from typing import Any

from rlflow.models import mimo

ATTN = "attn_implementation"


class OverrideError(ValueError):
    """An override the model's config cannot take; the message names the entry."""


def effective_overrides(override_config: dict | None) -> dict:
    """verl's rule: the ``model_config`` entry when there is one, else the whole dict (a copy)."""
    overrides = dict(override_config or {})
    return dict(overrides["model_config"] or {}) if "model_config" in overrides else overrides


def apply_overrides(config, overrides: dict, where: str = "override_config", top: bool = True):
    """Set ``overrides`` on ``config`` (in place; returned); a top-level ``attn_implementation`` is skipped (it
    is a :func:`model_kwargs` argument). An entry the config has no attribute for raises :class:`OverrideError`."""
    from transformers import PreTrainedConfig

    for key, value in overrides.items():
        if top and key == ATTN:
            continue
        if not hasattr(config, key):
            raise OverrideError(f"{where}.{key}={value!r}: {type(config).__name__} has no attribute {key!r}"
                                f"{_hint(config, key)}")
        current = getattr(config, key)
        if isinstance(value, dict) and isinstance(current, PreTrainedConfig):
            apply_overrides(current, value, f"{where}.{key}", top=False)
        elif isinstance(value, dict) and isinstance(current, dict):
            setattr(config, key, {**current, **value})
        else:
            setattr(config, key, value)
    return config


def _hint(config, key: str) -> str:
    for name, attr in vars(config).items():  # transformers 5 nests rope_theta & co. in rope_parameters
        if isinstance(attr, dict) and key in attr:
            return f"; it is in {name}: set {name}.{key}"
    close = difflib.get_close_matches(key, [k for k in vars(config) if not k.startswith("_")], n=3)
    return f" (did you mean {', '.join(close)}?)" if close else " (the override would change nothing)"


def model_kwargs(override_config: dict | None, trust_remote_code: bool = False) -> dict[str, Any]:
    """The ``from_pretrained`` arguments besides ``config``: ``trust_remote_code`` and, when overridden,
    ``attn_implementation``."""
    kwargs: dict[str, Any] = {"trust_remote_code": bool(trust_remote_code)}
    attn = effective_overrides(override_config).get(ATTN)
    if attn is not None:
        kwargs[ATTN] = attn
    return kwargs


def load_config(path, override_config: dict | None = None, trust_remote_code: bool = False,
                where: str = "override_config"):
    """``AutoConfig.from_pretrained(path)`` with the overrides applied (:func:`apply_overrides`)."""
    from transformers import AutoConfig

    mimo.register()  # MiMo's Qwen2 body loads without its remote code (rlflow.models.mimo)
    config = AutoConfig.from_pretrained(path, **model_kwargs(override_config, trust_remote_code))
    return apply_overrides(config, effective_overrides(override_config), where)
