"""LoRA keys of the verl entry point -> the ``lora=`` argument of ``Policy.from_pretrained``.

Two spellings configure the same adapters:

- verl's: ``actor_rollout_ref.model.lora_rank`` (> 0 turns LoRA on), ``lora_alpha``, ``target_modules``,
  ``exclude_modules``, ``lora_adapter_path`` (an adapter folder to train further);
- the seed's: ``actor_rollout_ref.actor.lora.{enabled, r, alpha, target_modules}``.

``actor_rollout_ref.model.use_rslora`` and ``use_dora`` (rlflow's keys) pass through to ``peft.LoraConfig``
for either spelling. Both spellings at once must agree. Either works with the Megatron strategy too, and so does
verl's Megatron LoRA block ``actor_rollout_ref.model.lora.*`` (:mod:`rlflow.config.verl.megatron_lora`).
"""

from __future__ import annotations

from pathlib import Path

from rlflow.config.verl import megatron_lora
from rlflow.config.verl.loading import ConfigError, VerlConfig
from rlflow.config.verl.megatron import wants_megatron

M, SEED = "actor_rollout_ref.model", "actor_rollout_ref.actor.lora"
# the seed's key -> verl's key for the same setting
SEED_TO_VERL = {f"{SEED}.r": f"{M}.lora_rank", f"{SEED}.alpha": f"{M}.lora_alpha",
                f"{SEED}.target_modules": f"{M}.target_modules"}


def lora_argument(cfg: VerlConfig, notes: list[str]) -> dict | str | None:
    """``peft.LoraConfig``'s keyword arguments (checked by building one), an adapter folder (``str``), or ``None``
    when LoRA is off."""
    seed_on, rank, adapter = cfg[f"{SEED}.enabled"], cfg[f"{M}.lora_rank"], cfg[f"{M}.lora_adapter_path"]
    if megatron_lora.wants_block(cfg):  # verl's Megatron LoRA block
        if not wants_megatron(cfg):
            raise ConfigError(f"{megatron_lora.L}.rank={cfg[f'{megatron_lora.L}.rank']}: verl's model.lora block is "
                              f"the Megatron strategy's LoRA (actor_rollout_ref.actor.strategy=megatron); with "
                              f"{cfg['actor_rollout_ref.actor.strategy']}, LoRA is {M}.lora_rank, lora_alpha and "
                              "target_modules")
        if seed_on or rank > 0 or adapter:
            raise ConfigError(f"{megatron_lora.L}.rank and {M}.lora_rank / lora_adapter_path / {SEED}.enabled both "
                              "turn LoRA on; set one")
        return megatron_lora.megatron_lora_argument(cfg, notes)
    if not (seed_on or rank > 0 or adapter):
        return None
    if adapter:
        return adapter_folder(cfg, notes, M, adapter, (f"{M}.lora_rank", *SEED_TO_VERL))
    if seed_on:
        values = {verl: cfg[seed] for seed, verl in SEED_TO_VERL.items()}
        for seed, verl in SEED_TO_VERL.items():
            if cfg.is_provided(verl) and cfg[verl] != values[verl] and not (verl.endswith("lora_rank") and cfg[verl] == 0):
                raise ConfigError(f"{seed}={cfg[seed]!r} and {verl}={cfg[verl]!r} disagree; set only one")
    else:
        values = {verl: cfg[verl] for verl in SEED_TO_VERL.values()}
    r, alpha, targets = (values[f"{M}.{k}"] for k in ("lora_rank", "lora_alpha", "target_modules"))
    if not isinstance(r, int) or r <= 0:
        raise ConfigError(f"LoRA rank must be a positive integer, got {r!r} ({SEED}.r / {M}.lora_rank)")
    from peft import LoraConfig

    kwargs = {"r": r, "lora_alpha": alpha, "target_modules": targets, "exclude_modules": cfg[f"{M}.exclude_modules"],
              "use_rslora": bool(cfg[f"{M}.use_rslora"]), "use_dora": bool(cfg[f"{M}.use_dora"]),
              "task_type": "CAUSAL_LM"}
    try:
        LoraConfig(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"LoRA settings ({M}.lora_* / {SEED}.*): {e}") from e
    return kwargs


CM = "critic.model"


def critic_lora_argument(cfg: VerlConfig, notes: list[str]) -> dict | str | None:
    """LoRA on the critic (``critic.model.lora_rank`` > 0, ``lora_alpha``, ``target_modules``, ``exclude_modules``,
    or ``lora_adapter_path``): ``peft.LoraConfig``'s kwargs, an adapter folder, or ``None``. The value head is new,
    so it trains beside the adapter (``Critic(lora=...)``)."""
    rank, adapter = cfg[f"{CM}.lora_rank"], cfg[f"{CM}.lora_adapter_path"]
    if megatron_lora.wants_block(cfg, f"{CM}.lora"):  # verl's Megatron LoRA block on the critic
        if not wants_megatron(cfg):
            raise ConfigError(f"{CM}.lora.rank={cfg[f'{CM}.lora.rank']}: verl's model.lora block is the Megatron "
                              f"strategy's LoRA; without it, the critic's LoRA is {CM}.lora_rank, lora_alpha and "
                              "target_modules")
        if adapter or (rank or 0) > 0:
            raise ConfigError(f"{CM}.lora.rank and {CM}.lora_rank / lora_adapter_path both turn LoRA on; set one")
        kwargs = megatron_lora.megatron_lora_argument(cfg, notes, f"{CM}.lora")
        return {k: v for k, v in kwargs.items() if k not in ("use_rslora", "use_dora")}
    if not (adapter or (rank or 0) > 0):
        return None
    if adapter:
        shape = (f"{CM}.lora_rank", f"{CM}.lora_alpha", f"{CM}.target_modules")
        return adapter_folder(cfg, notes, CM, adapter, shape)
    if not isinstance(rank, int):
        raise ConfigError(f"{CM}.lora_rank={rank!r}: LoRA rank must be a positive integer")
    from peft import LoraConfig

    kwargs = {"r": rank, "lora_alpha": cfg[f"{CM}.lora_alpha"], "target_modules": cfg[f"{CM}.target_modules"],
              "exclude_modules": cfg[f"{CM}.exclude_modules"], "task_type": "CAUSAL_LM"}
    try:
        LoraConfig(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"LoRA settings of the critic ({CM}.lora_rank / lora_alpha / target_modules): {e}") from e
    return kwargs


def adapter_folder(cfg, notes: list[str], model: str, adapter, shape_keys) -> str:
    """A PEFT adapter folder named by ``{model}.lora_adapter_path`` (checked), with a note naming the shape keys the
    user set, which the adapter's own adapter_config.json overrides."""
    folder = Path(str(adapter)).expanduser()
    if not (folder / "adapter_config.json").exists():
        raise ConfigError(f"{model}.lora_adapter_path={adapter!r}: not a PEFT adapter folder (no adapter_config.json)")
    shaped = [k for k in shape_keys if cfg.is_provided(k)]
    for key in shaped:  # read: this note replaces the generic "has no effect" one
        cfg[key]
    if shaped:
        notes.append(f"{model}.lora_adapter_path: the adapter's own adapter_config.json sets rank, alpha and targets; "
                     f"ignored: {', '.join(shaped)}")
    return str(folder)
