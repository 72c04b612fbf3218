"""verl 0.9.1's own config tree, shipped with rlflow (``config/verl/trainer_config``, unchanged, Apache-2.0).

rlflow's default tree is verl's whole tree (the FSDP and the Megatron variant) under rlflow's own
``defaults.yaml``, so every key of verl 0.9.1 can be set without a ``+``. What verl selects with
Hydra's config groups runs through Hydra's own composition over those same files:
``--config-name ppo_trainer`` / ``ppo_megatron_trainer`` (when the user's folder has no such file),
``model_engine=megatron``, package overrides such as ``actor@actor_rollout_ref.actor=megatron_actor`` and
``hydra.searchpath=[pkg://...]``. What a composition changes against the plain ``ppo_trainer`` tree
becomes a base layer of defaults, below the user's file and overrides.
"""

from __future__ import annotations

import copy
import importlib.util
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from rlflow.config.errors import ConfigError
from rlflow.config.trees import changed_leaves, flatten, strip_targets

VERL_CONFIG_DIR = Path(__file__).with_name("trainer_config")
VERL_VERSION = "0.9.1"
# verl's bundled top-level configs a --config-name may name, and the generated (composed) file of each
BUNDLED = {"ppo_trainer": "_generated_ppo_trainer.yaml", "ppo_megatron_trainer": "_generated_ppo_megatron_trainer.yaml"}
# verl's config groups that select a whole subtree (``model_engine=megatron`` picks ``megatron_actor`` ...)
GROUP_KEYS = ("model_engine",)
# verl's training engines rlflow does not have: strategy -> name
FOREIGN_STRATEGIES = {"veomni": "VeOmni", "torchtitan": "TorchTitan", "automodel": "NeMo AutoModel",
                      "fsdp_turbo": "FSDP Turbo", "mlite": "Megatron Lite (verl_mlite)"}
# backends behind verl's search paths or groups that rlflow does not have: module -> what it is
FOREIGN_PACKAGES = {"verl_mlite": "Megatron-lite (verl_mlite)", "veomni": "VeOmni", "torchtitan": "TorchTitan",
                    "mindspeed": "MindSpeed (Ascend NPU)"}


def _unset_missing(tree: Any) -> Any:
    """verl's mandatory ``???`` values (``rollout.name``) read as ``None``; rlflow's layer gives its default."""
    if isinstance(tree, dict):
        return {k: _unset_missing(v) for k, v in tree.items()}
    return None if tree == "???" else tree


@lru_cache(maxsize=None)
def _bundled(name: str) -> dict:
    with open(VERL_CONFIG_DIR / BUNDLED[name]) as f:
        return _unset_missing(strip_targets(yaml.safe_load(f)))


def verl_tree(name: str = "ppo_trainer") -> dict:
    """verl 0.9.1's composed config ``name`` as a plain nested dict (``_target_`` entries dropped)."""
    return copy.deepcopy(_bundled(name))


_ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
# Config blocks of verl's other engines (not in its FSDP/Megatron trees), open so that a script's keys under them
# reach one refusal naming the engine (rlflow.config.verl.keys_0_9) instead of an unknown-key error each
FOREIGN_BLOCKS = {**{f"{r}.veomni": "VeOmni" for r in _ROLES},
                  **{f"{r}.engine": "Megatron-lite (verl_mlite)" for r in _ROLES}}
# Blocks of verl's tree whose scripts set keys the tree does not list: open as well (their reasons: tables.INERT)
OPEN_BLOCKS = ("distillation.teacher_models", *(f"{r}.fsdp_config.turbo_config" for r in _ROLES[:2]),
               "critic.fsdp.turbo_config", *(f"{r}.fsdp_config.mixed_precision" for r in _ROLES[:2]),
               "critic.model.fsdp_config.mixed_precision", "critic.fsdp.mixed_precision")


@lru_cache(maxsize=None)
def default_container(rlflow_file: Path) -> dict:
    """The default tree as a plain nested dict, interpolations unresolved (shared: do not change it)."""
    layers = [_bundled("ppo_megatron_trainer"), _bundled("ppo_trainer"), OmegaConf.load(rlflow_file)]
    tree = OmegaConf.to_container(OmegaConf.merge(*layers), resolve=False)
    for key in (*FOREIGN_BLOCKS, *OPEN_BLOCKS):
        node = tree
        for part in key.split("."):
            node = node.setdefault(part, {})
    return tree


@lru_cache(maxsize=None)
def open_nodes(rlflow_file: Path) -> frozenset[str]:
    """The nodes rlflow's file leaves empty (``override_config``, ``ray_kwargs``, ...): any key may be
    added under them, even where verl's tree lists some."""
    tree = OmegaConf.to_container(OmegaConf.load(rlflow_file), resolve=False)
    return frozenset(k for k, v in flatten(tree).items() if v == {}) | set(FOREIGN_BLOCKS) | set(OPEN_BLOCKS)


@lru_cache(maxsize=None)
def _resolved_defaults(rlflow_file: Path) -> dict:
    return OmegaConf.to_container(OmegaConf.create(default_container(rlflow_file)), resolve=True)


def resolved_defaults(rlflow_file: Path) -> dict:
    """The default tree with its interpolations resolved (a fresh copy: callers may change it)."""
    return copy.deepcopy(_resolved_defaults(rlflow_file))


@lru_cache(maxsize=None)
def _default_tree(rlflow_file: Path) -> DictConfig:
    return OmegaConf.create(default_container(rlflow_file))


def default_tree(rlflow_file: Path) -> DictConfig:
    """rlflow's default tree: verl's Megatron tree <- verl's FSDP tree <- rlflow's ``rlflow_file`` (a
    fresh ``DictConfig`` each call: loading mutates it). A deep copy of one tree made once: ``create`` parses
    every interpolation of the ~3,000 leaves again, about 3x the copy's time on each ``load_config``."""
    return copy.deepcopy(_default_tree(rlflow_file))


def verl_keys() -> set[str]:
    """Every leaf key of verl 0.9.1's FSDP and Megatron trees."""
    return set(flatten(_bundled("ppo_trainer"))) | set(flatten(_bundled("ppo_megatron_trainer")))


def bundled_name(config_name: str) -> str | None:
    """``ppo_megatron_trainer.yaml`` -> ``ppo_megatron_trainer`` when verl ships it, else ``None``."""
    stem = config_name.rsplit("/", 1)[-1]
    stem = stem[: -len(".yaml")] if stem.endswith(".yaml") else stem
    return stem if stem in BUNDLED else None


def _foreign(text: str) -> str | None:
    for module, name in FOREIGN_PACKAGES.items():
        if module in text.replace("-", "_").lower():
            return name
    return None


def compose_overlay(config_name: str = "ppo_trainer", groups: tuple[str, ...] = (),
                    searchpath: tuple[str, ...] = ()) -> dict:
    """What verl's Hydra composition of ``config_name`` with the group overrides ``groups``
    (``model_engine=megatron``, ``actor@actor_rollout_ref.actor=megatron_actor``) and ``hydra.searchpath``
    entries changes against the plain ``ppo_trainer`` tree, as a nested dict of defaults."""
    if not groups and not searchpath:
        return changed_leaves(_bundled(config_name), _bundled("ppo_trainer")) if config_name != "ppo_trainer" else {}
    return _compose(config_name, tuple(groups), tuple(searchpath))


@lru_cache(maxsize=16)
def _compose(config_name: str, groups: tuple[str, ...], searchpath: tuple[str, ...]) -> dict:
    from hydra import compose, initialize_config_dir  # Hydra's composition: only for group overrides
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    for entry in searchpath:
        if entry.startswith("pkg://"):
            module = entry[len("pkg://"):].split(".")[0]
            if importlib.util.find_spec(module) is None:
                name = _foreign(module)
                raise ConfigError(f"hydra.searchpath={entry}: the package {module!r} is not installed"
                                  + (f"; {name} is a backend rlflow does not have" if name else
                                     " (pip install it, or drop the search path)"))
    overrides = list(groups) + ([f"hydra.searchpath=[{','.join(searchpath)}]"] if searchpath else [])
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(VERL_CONFIG_DIR), version_base=None):
            composed = compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        first = " ".join(str(e).split())[:400]  # Hydra's message, with the options a group has
        name = _foreign(" ".join(groups + searchpath))
        hint = f"; {name} is a backend rlflow does not have" if name else ""
        raise ConfigError(f"{' '.join(overrides)}: verl {VERL_VERSION}'s configs cannot be composed so: "
                          f"{first}{hint}") from None
    finally:
        GlobalHydra.instance().clear()
    tree = _unset_missing(strip_targets(OmegaConf.to_container(composed, resolve=False)))
    for role in ("actor_rollout_ref.actor", "critic"):
        strategy = flatten(tree).get(f"{role}.strategy")
        if strategy in FOREIGN_STRATEGIES:
            raise ConfigError(f"{' '.join(overrides)}: selects verl's {FOREIGN_STRATEGIES[strategy]} training "
                              f"engine ({role}.strategy={strategy}), a backend rlflow does not have; rlflow "
                              "trains with fsdp/fsdp2 (model_engine=dp, the default) or megatron (model_engine=megatron)")
    tree.pop("model_engine", None)  # the group choice itself, not a key of the tree
    return changed_leaves(tree, _bundled("ppo_trainer"))
