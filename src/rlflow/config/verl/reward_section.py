"""verl 0.9's ``reward.*`` section, read through rlflow's reward keys (``reward_model.*``,
``custom_reward_function.*``).

verl 0.9.1 moved the reward settings under ``reward:`` (``trainer/config/reward/reward.yaml``). Its ``main_ppo``
reads only those; the older keys stay in its tree (``legacy_reward_impl.yaml``, all null) and only its
fully-async entry point carries them over (``migrate_legacy_reward_impl``: a legacy key that is set
overwrites the new one). rlflow takes both spellings: each new key the user sets is copied, at load time,
onto the key rlflow's reward code reads (:data:`ALIASES`), so the two behave the same; the new key counts as
read when its legacy key is. Both set to different values is an error naming both (verl's two entry points
disagree on which would win). Problems found under the legacy name are reported under the user's name too
(:func:`user_names`).

Keys of the section with no legacy counterpart: ``reward_manager.source=importlib`` with ``reward_manager.module.path``
(a reward class from a file) is read by :mod:`rlflow.config.verl.reward_class`; the reward model's
resource pool and its inference-server settings (``reward.reward_model.rollout.*``) change nothing here (the
reward model is a sequence-classification model scored in the training processes, ``ModelReward``).

Nothing here imports torch or omegaconf: :mod:`rlflow.config.verl.loading` calls :func:`fold`.
"""

from __future__ import annotations

import re
from typing import Any

# verl 0.9 key (or open node) -> the rlflow key that carries it; a key under an open node maps below its legacy node
ALIASES = {
    "reward.num_workers": "reward_model.num_workers",
    "reward.custom_reward_function.path": "custom_reward_function.path",
    "reward.custom_reward_function.name": "custom_reward_function.name",
    "reward.custom_reward_function.reward_kwargs": "custom_reward_function.reward_kwargs",
    "reward.reward_manager.name": "reward_model.reward_manager",
    "reward.reward_kwargs": "reward_model.reward_kwargs",
    "reward.reward_model.enable": "reward_model.enable",
    "reward.reward_model.model_path": "reward_model.model.path",
    "reward.sandbox_fusion.url": "reward_model.sandbox_fusion.url",
    "reward.sandbox_fusion.max_concurrent": "reward_model.sandbox_fusion.max_concurrent",
    "reward.sandbox_fusion.memory_limit_mb": "reward_model.sandbox_fusion.memory_limit_mb",
}
_LEGACY = {legacy: new for new, legacy in ALIASES.items()}


def _mapped(key: str, table: dict[str, str]) -> str | None:
    for src, dst in table.items():
        if key == src or key.startswith(src + "."):
            return dst + key[len(src):]
    return None


def legacy_name(key: str) -> str | None:
    """``reward.reward_kwargs.max_resp_len`` -> ``reward_model.reward_kwargs.max_resp_len``; None if not aliased."""
    return _mapped(key, ALIASES)


def verl09_name(key: str) -> str | None:
    """The inverse of :func:`legacy_name`: ``reward_model.num_workers`` -> ``reward.num_workers``."""
    return _mapped(key, _LEGACY)


def _get(tree: dict, key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(tree: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[leaf] = value


def fold(tree: dict, provided: set[str]) -> tuple[dict[str, str], list[str]]:
    """Copy each provided ``reward.*`` key onto its legacy key in ``tree`` (the resolved config, changed in
    place). Returns ``{legacy key: the user's key}`` and the conflicts (messages naming both keys)."""
    aliased, problems = {}, []
    for key in sorted(provided):
        legacy = legacy_name(key)
        if legacy is None:
            continue
        value = _get(tree, key)
        clash = [k for k in provided if k == legacy or k.startswith(legacy + ".") or legacy.startswith(k + ".")]
        if clash and _get(tree, legacy) is None:  # the older key written as null (verl 0.9.1's file does): unset
            clash = []
        if clash:
            other = _get(tree, legacy)
            if other != value:
                problems.append(
                    f"{key}={value!r} and {clash[0]}={_get(tree, clash[0])!r} set one thing (verl 0.9's name and "
                    f"the older one) to different values; set only {key} (verl 0.9.1's main_ppo reads only the "
                    "reward.* section; its fully-async entry point lets the older key win)")
            continue
        _set(tree, legacy, value)
        aliased[legacy] = key
    return aliased, problems


def user_names(problems: list, aliased: dict[str, str]) -> list:
    """A problem reported under a legacy key the user set through ``reward.*`` also names the user's key:
    ``reward.num_workers (verl 0.9's reward_model.num_workers): reward_model.num_workers=0: must be >= 1``."""
    for problem in problems:
        text = str(problem)
        found = re.match(r"[\w.]+", text)
        if not found:
            continue
        user = aliased.get(found.group(0)) or next(
            (new for legacy, new in aliased.items() if legacy.startswith(found.group(0) + ".")), None)
        if user and not text.startswith(user):
            problem.args = (f"{user} (read as {found.group(0)}): {text}",)
    return problems
