"""The reward function of a verl config: ``custom_reward_function.{path,name,reward_kwargs}`` or
verl's ``default_compute_score`` (dispatch by ``data_source``).

Where the function comes from: ``path`` a Python file and ``name`` the function in it (verl); or, with
``path`` null, ``name="file.py:fn"`` or ``name="package.module:fn"`` (the ``path.py:Name`` spelling rlflow
uses for estimators and losses too); ``path`` may also be an importable module (``my_pkg.rewards``).
A file is imported once however many functions come from it (:func:`rlflow.registry.load_object`).

A custom function may take any form :class:`~rlflow.rewards.FunctionReward` understands, including
the batch form ``compute_reward(responses, ground_truths)``. With ``reward_model.reward_manager=batch``
it is called as verl's batch manager calls it:
``fn(data_sources=, solution_strs=, ground_truths=, extra_infos=, **reward_kwargs)``; with ``gdpo`` as verl's
GDPO manager calls it: by keyword, ``extra_info`` carrying ``experiment_name`` (``trainer.experiment_name``).

Nothing here imports torch at import time: :func:`reward_file_problem` checks the keys before anything
heavy loads (``rlflow.config.verl.validate``).
"""

from __future__ import annotations

import difflib
import functools
from pathlib import Path
from typing import Any, Callable

from rlflow.config.verl.loading import ConfigError, NotSupportedError
from rlflow.config.verl.tables import REWARD_MANAGERS
from rlflow.registry import defined_names, is_file_location, load_object, object_problem, top_level_names

__all__ = ["REWARD_MANAGERS", "split_reward_spec", "reward_file_problem", "load_function", "reward_function",
           "check_data_sources"]


def split_reward_spec(path: str | None, name: str) -> tuple[str | None, str]:
    """``path`` null and ``name="file.py:fn"`` (or ``"package.module:fn"``) -> ``("file.py", "fn")``."""
    if not path and ":" in str(name):
        path, name = str(name).rsplit(":", 1)
    return path, name


def reward_file_problem(path: str, name: str) -> str | None:
    """Why ``custom_reward_function.path``/``.name`` select no function, found without running the file.

    ``path`` is a Python file (verl) or an importable module (``my_pkg.rewards``).
    """
    if not is_file_location(path):
        return object_problem(path, name, f"custom_reward_function.path={path!r}")
    file = Path(path).expanduser()
    if not file.is_file():
        return f"custom_reward_function.path={path!r}: no such file {file.resolve()}"
    try:
        names, open_ended = top_level_names(file)
    except SyntaxError as e:
        return f"custom_reward_function.path={path!r}: {file} is not valid Python: {e.msg} (line {e.lineno})"
    if name in names or open_ended:
        return None
    public = [n for n in sorted(names) if not n.startswith("_")]
    close = difflib.get_close_matches(name, public, n=1) or public[:1]
    hint = f" Set custom_reward_function.name={close[0]}." if close else ""
    return (f"custom_reward_function.name={name!r}: {file} defines no function '{name}' "
            f"(it defines {defined_names(file)}).{hint}")


def load_function(path: str, name: str) -> Callable[..., Any]:
    """Import ``name`` from the Python file (or module) at ``path``; errors name the key, file and functions in it."""
    problem = reward_file_problem(path, name)
    if problem:
        raise ConfigError(problem)
    try:
        fn = load_object(path, name, where=f"custom_reward_function.path={path!r}")
    except LookupError as e:
        raise ConfigError(str(e)) from None
    if not callable(fn):
        raise ConfigError(f"custom_reward_function.name={name!r}: {path} defines '{name}', but it is not callable")
    return fn


def verl_batch_adapter(fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
    """verl's BatchRewardManager call convention, as a FunctionReward batch-form function."""

    def batch_reward(solution_strs, ground_truths, data_sources=None, extra_infos=None):
        return fn(data_sources=data_sources, solution_strs=solution_strs, ground_truths=ground_truths,
                  extra_infos=extra_infos, **kwargs)

    batch_reward.__name__ = getattr(fn, "__name__", "compute_score")
    return batch_reward


def gdpo_adapter(fn: Callable[..., Any], experiment_name: str, **kwargs: Any) -> Callable[..., Any]:
    """verl's GDPO reward manager's call: ``extra_info`` gains ``experiment_name`` (``trainer.experiment_name``;
    verl's GDPO scorer ``rlla.compute_score`` picks the chat format by it), the rest by keyword as verl calls it."""

    def gdpo_score(data_source, solution_str, ground_truth, extra_info=None):
        info = {**(extra_info if isinstance(extra_info, dict) else {}), "experiment_name": experiment_name}
        return fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=info,
                  **kwargs)

    gdpo_score.__name__ = getattr(fn, "__name__", "compute_score")
    return gdpo_score


def reward_function(path: str | None, name: str, reward_kwargs: dict, manager: str,
                    experiment_name: str = "", sandbox_fusion: dict | None = None) -> Callable[..., Any]:
    """The function to wrap in ``FunctionReward`` for these config values (``experiment_name``: gdpo's;
    ``sandbox_fusion``: ``SandboxFusion`` arguments, with which the built-in scorers run code on that server)."""
    from rlflow.rewards import SandboxFusion, default_compute_score

    if manager not in REWARD_MANAGERS:  # validation reports this first
        raise ConfigError(f"reward_model.reward_manager={manager!r}: unknown; choose from {REWARD_MANAGERS}")
    if manager == "dapo" and (reward_kwargs.get("overlong_buffer_cfg") or {}).get("enable"):
        raise NotSupportedError("reward_model.reward_kwargs.overlong_buffer_cfg.enable", True,
                                "DAPO overlong reward shaping")
    path, name = split_reward_spec(path, name)
    fn = load_function(path, name) if path else default_compute_score
    if not path and sandbox_fusion:  # verl: default_compute_score with sandbox_fusion_url (a custom function: not)
        try:
            fn = functools.partial(default_compute_score, sandbox=SandboxFusion(**sandbox_fusion))
        except ValueError as e:  # a url that is not http(s)
            raise ConfigError(f"reward_model.{e}") from None
    if manager == "batch":
        if not path:
            raise ConfigError("reward_model.reward_manager=batch needs custom_reward_function.path: "
                              "the built-in scorers score one sample at a time")
        return verl_batch_adapter(fn, **reward_kwargs)
    if manager == "gdpo":
        return gdpo_adapter(fn, experiment_name, **reward_kwargs)
    return functools.partial(fn, **reward_kwargs) if reward_kwargs else fn


def check_data_sources(sources: set[str], where: str) -> None:
    """With the built-in scorers, every data_source of the data must have one (fail before training)."""
    from rlflow.rewards import default_compute_score
    from rlflow.rewards.dispatch import supports

    from rlflow.rewards import geo3k
    from rlflow.rewards.dispatch import GEO3K_SOURCES

    if set(GEO3K_SOURCES) & sources and not geo3k.available():  # fail now, not at the first reward call
        raise ConfigError(f"{where}: data_source hiyouga/geometry3k is scored with mathruler's grader, as in verl, "
                          f"which is not installed: {geo3k.INSTALL}")
    for source in sorted(sources):
        if not supports(source):
            try:
                default_compute_score(source, "", "0")  # raises, naming the supported sources
            except NotImplementedError as e:
                raise ConfigError(f"{where}: {e} Or set custom_reward_function.path=your_reward.py "
                                  "(custom_reward_function.name=compute_score).") from None
