"""The reward function of a verl config: ``custom_reward_function.{path,name,reward_kwargs}`` or
verl's ``default_compute_score`` (dispatch by ``data_source``).

Where the function comes from: ``path`` a Python file and ``name`` the function in it (verl); or, with
``path`` null, ``name="file.py:fn"`` or ``name="package.module:fn"`` (the ``path.py:Name`` spelling rlflow
uses for estimators and losses too); ``path`` may also be an importable module (``my_pkg.rewards``).

A custom function may take any form :class:`~rlflow.rewards.FunctionReward` understands, including
the batch form ``compute_reward(responses, ground_truths)``. With ``reward_model.reward_manager=batch``
it is called as verl's batch manager calls it:
``fn(data_sources=, solution_strs=, ground_truths=, extra_infos=, **reward_kwargs)``.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable

from rlflow.config.loading import ConfigError
from rlflow.rewards import default_compute_score

REWARD_MANAGERS = ("naive", "batch", "prime", "dapo")


def load_function(path: str, name: str) -> Callable[..., Any]:
    """Import ``name`` from the Python file at ``path``; errors name the key, file and functions in it."""
    file = Path(path).expanduser()
    if not file.is_file() and not path.endswith(".py") and "/" not in path:  # an importable module's name
        try:
            module, module_name, file = importlib.import_module(path), path, path
        except ImportError as e:
            raise ConfigError(f"custom_reward_function.path={path!r}: no such file, and importing it as a module "
                              f"failed ({e})") from None
    elif not file.is_file():
        raise ConfigError(f"custom_reward_function.path={path!r}: no such file")
    else:
        module_name = f"rlflow_custom_reward_{abs(hash(str(file.resolve())))}"
        module = sys.modules.get(module_name)  # several functions from one file: import it once
        if module is None:
            spec = importlib.util.spec_from_file_location(module_name, file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as e:  # noqa: BLE001 - the user's file: report, naming it
                del sys.modules[module_name]
                raise ConfigError(f"custom_reward_function.path={path!r}: importing the file raised {e!r}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = [k for k, v in vars(module).items()
                   if inspect.isfunction(v) and v.__module__ == module_name and not k.startswith("_")]
        close = difflib.get_close_matches(name, defined, n=1) or defined[:1]
        hint = f" Set custom_reward_function.name={close[0]}." if close else ""
        raise ConfigError(f"custom_reward_function.name={name!r}: {file} defines no function '{name}' "
                          f"(it defines: {', '.join(defined) or 'none'}).{hint}")
    return fn


def verl_batch_adapter(fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
    """verl's BatchRewardManager call convention, as a FunctionReward batch-form function."""

    def batch_reward(solution_strs, ground_truths, data_sources=None, extra_infos=None):
        return fn(data_sources=data_sources, solution_strs=solution_strs, ground_truths=ground_truths,
                  extra_infos=extra_infos, **kwargs)

    batch_reward.__name__ = getattr(fn, "__name__", "compute_score")
    return batch_reward


def reward_function(path: str | None, name: str, reward_kwargs: dict, manager: str) -> Callable[..., Any]:
    """The function to wrap in ``FunctionReward`` for these config values."""
    if manager not in REWARD_MANAGERS:
        raise ConfigError(f"reward_model.reward_manager={manager!r}: unknown; choose from {REWARD_MANAGERS}")
    if manager == "dapo" and (reward_kwargs.get("overlong_buffer_cfg") or {}).get("enable"):
        from rlflow.config.loading import NotSupportedError

        raise NotSupportedError("reward_model.reward_kwargs.overlong_buffer_cfg.enable", True,
                                "DAPO overlong reward shaping")
    if not path and ":" in name:  # name="file.py:fn" or "package.module:fn"
        path, name = name.rsplit(":", 1)
    fn = load_function(path, name) if path else default_compute_score
    if manager == "batch":
        if not path:
            raise ConfigError("reward_model.reward_manager=batch needs custom_reward_function.path: "
                              "the built-in scorers score one sample at a time")
        return verl_batch_adapter(fn, **reward_kwargs)
    return functools.partial(fn, **reward_kwargs) if reward_kwargs else fn


def check_data_sources(sources: set[str], where: str) -> None:
    """With the built-in scorers, every data_source of the data must have one (fail before training)."""
    from rlflow.rewards.dispatch import supports

    for source in sorted(sources):
        if not supports(source):
            try:
                default_compute_score(source, "", "0")  # raises, naming the supported sources
            except NotImplementedError as e:
                raise ConfigError(f"{where}: {e} Or set custom_reward_function.path=your_reward.py "
                                  "(custom_reward_function.name=compute_score).") from None
