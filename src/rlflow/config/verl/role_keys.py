"""verl 0.9.1's newer names of role settings rlflow already has, read the way verl reads them.

- ``actor.fsdp_config.ulysses_sequence_parallel_size`` / ``critic.fsdp.ulysses_sequence_parallel_size``: verl 0.9's
  FSDP engine blocks hold the sequence-parallel size; the role-level key (deprecated there) wins when it is above 1
  (verl's ``FSDPActorConfig.__post_init__``). :func:`sequence_parallel_keys` says which key holds each role's size.
- ``actor_rollout_ref.model.tokenizer_path`` / ``hf_config_path`` and ``critic.model.hf_config_path``: where the
  tokenizer (and processor) and the model config are read from, when not the model folder (:func:`model_paths`).
"""

from __future__ import annotations

from typing import Any, Callable

A, REF, C, M = "actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "actor_rollout_ref.model"
SP = "ulysses_sequence_parallel_size"
# each role's (deprecated) key -> its FSDP engine's key for the same size
SP_ENGINE_KEYS = {f"{A}.{SP}": f"{A}.fsdp_config.{SP}", f"{C}.{SP}": f"{C}.fsdp.{SP}"}


def _above_one(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 1


def sequence_parallel_keys(get: Callable[[str], Any], provided: Callable[[str], bool], with_critic: bool) -> list[str]:
    """The key holding each role's Ulysses size (actor first, then the reference when it has its own, then the
    critic): the role's key when above 1, else its engine's when above 1, else the role's. The reference's key
    follows the actor's role-level key in verl's tree, so it counts only when that is the actor's, or when set."""
    def role(key: str) -> str:
        engine = SP_ENGINE_KEYS[key]
        return engine if not _above_one(get(key)) and _above_one(get(engine)) else key

    actor = role(f"{A}.{SP}")
    keys = [actor] + ([f"{REF}.{SP}"] if actor == f"{A}.{SP}" or provided(f"{REF}.{SP}") else [])
    return keys + ([role(f"{C}.{SP}")] if with_critic else [])


def model_paths(cfg, role: str) -> dict[str, str]:
    """``tokenizer_path`` / ``config_path`` of the role's model (``Policy.from_pretrained``'s arguments), only those
    set: verl reads the tokenizer (and processor) from ``model.tokenizer_path`` and the model config from
    ``model.hf_config_path`` when they are set. The critic reads the policy's token ids, so only its config path."""
    keys = {"config_path": "hf_config_path"} | ({"tokenizer_path": "tokenizer_path"} if role == M else {})
    return {arg: str(cfg[f"{role}.{key}"]) for arg, key in keys.items() if cfg[f"{role}.{key}"]}
