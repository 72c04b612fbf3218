"""verl's Megatron LoRA block (``actor_rollout_ref.model.lora.*``, ``critic.model.lora.*``) -> ``peft.LoraConfig``'s
keyword arguments.

verl trains LoRA under Megatron through Megatron-Bridge's PEFT, configured by ``model.lora.rank`` (> 0 turns it
on), ``alpha`` and ``target_modules`` in Megatron's layer names. rlflow's Megatron strategy trains a PEFT LoRA
policy with the adapters on Megatron's tensor-parallel layers (``rlflow.strategies.megatron.lora``), so the block
becomes PEFT's settings: each Megatron target names the Hugging Face projections it fuses.

``type=lora`` (Megatron-Bridge's fused adapters: one ``A`` for q/k/v together, one for gate/up) becomes PEFT's
per-projection adapters, which is ``type=canonical_lora``'s shape: a rank-``r`` adapter per projection, whose merged
weights any engine loads and which saves as a PEFT adapter folder. A note says so.
"""

from __future__ import annotations

from rlflow.config.verl.loading import ConfigError, NotSupportedError, VerlConfig

L = "actor_rollout_ref.model.lora"
# Megatron-Bridge's target names (fused and canonical) -> the Hugging Face projections they adapt
MEGATRON_TARGETS = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",), "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",), "linear_q": ("q_proj",), "linear_k": ("k_proj",), "linear_v": ("v_proj",),
    "linear_fc1_gate": ("gate_proj",), "linear_fc1_up": ("up_proj",),
}


def wants_block(cfg: VerlConfig, L: str = L) -> bool:
    rank = cfg[f"{L}.rank"]
    return rank is not None and rank > 0


def projections(names, key: str) -> list[str]:
    """The Hugging Face projections of Megatron target names (a clear error for any other name)."""
    out = []
    for name in names or []:
        if name not in MEGATRON_TARGETS:
            raise NotSupportedError(key, list(names), f"LoRA on {name!r}", "rlflow's Megatron LoRA adapts "
                                    f"{', '.join(MEGATRON_TARGETS)} (no wildcards, routers or MLA projections).")
        out += [p for p in MEGATRON_TARGETS[name] if p not in out]
    return out


def megatron_lora_argument(cfg: VerlConfig, notes: list[str], L: str = L) -> dict:
    """``peft.LoraConfig``'s kwargs for verl's ``model.lora`` block (``rank`` > 0), with the strategy Megatron; ``L``:
    the block (the policy's, or ``critic.model.lora``)."""
    rank, kind = cfg[f"{L}.rank"], cfg[f"{L}.type"]
    if not isinstance(rank, int):
        raise ConfigError(f"{L}.rank={rank!r}: LoRA rank must be a positive integer")
    if kind not in ("lora", "canonical_lora"):
        raise NotSupportedError(f"{L}.type", kind, "this Megatron LoRA variant", "rlflow's Megatron LoRA is "
                                "type=lora or canonical_lora (DoRA and vlm_lora are not supported yet).")
    targets, exclude = cfg[f"{L}.target_modules"], cfg[f"{L}.exclude_modules"]
    if exclude:
        if targets and cfg.is_provided(f"{L}.target_modules"):
            raise ConfigError(f"{L}.exclude_modules needs {L}.target_modules empty (as in verl)")
        dropped = projections(exclude, f"{L}.exclude_modules")
        targets = [t for t in ("linear_q", "linear_k", "linear_v", "linear_proj", "linear_fc1_gate", "linear_fc1_up",
                               "linear_fc2") if MEGATRON_TARGETS[t][0] not in dropped]
    modules = projections(targets, f"{L}.target_modules")
    if not modules:
        raise ConfigError(f"{L}.target_modules is empty: LoRA adapts nothing")
    if cfg[f"{L}.dropout"]:
        raise NotSupportedError(f"{L}.dropout", cfg[f"{L}.dropout"], "LoRA dropout under the Megatron strategy",
                                "Each tensor-parallel rank would drop other entries; set it to 0.")
    if cfg[f"{L}.lora_B_init_method"] != "zero":
        raise NotSupportedError(f"{L}.lora_B_init_method", cfg[f"{L}.lora_B_init_method"], "a LoRA B that does not "
                                "start at zero", "rlflow's adapters start at the base model (B = 0).")
    if cfg[f"{L}.adapter_path"]:
        raise NotSupportedError(f"{L}.adapter_path", cfg[f"{L}.adapter_path"], "Megatron-Bridge adapter checkpoints",
                                f"A PEFT adapter folder goes in {L.removesuffix('.lora')}.lora_adapter_path.")
    notes.append(f"{L}: PEFT adapters of rank {rank} on {', '.join(modules)}, on Megatron's tensor-parallel layers "
                 + ("(type=lora's fused q/k/v and gate/up adapters become one adapter per projection, as "
                    "canonical_lora's)" if kind == "lora" and any(t in ("linear_qkv", "linear_fc1") for t in targets)
                    else "") + f"; A starts from PEFT's kaiming-uniform init, not {cfg[f'{L}.lora_A_init_method']}"
                 "; the engines receive merged weights W + s B A (as merge=True)")
    for key, why in (("merge", "rlflow's engines always receive merged weights"),
                     ("dropout_position", "dropout is 0"), ("a2a_experimental", "a Megatron-Bridge communication knob"),
                     ("dtype", "the adapter is float32, as every trained parameter; trainer.precision sets compute"),
                     ("freeze_vision_model", "a vlm_lora setting"), ("freeze_vision_projection", "a vlm_lora setting"),
                     ("freeze_language_model", "a vlm_lora setting")):
        if cfg.is_provided(f"{L}.{key}"):
            notes.append(f"{L}.{key}={cfg[f'{L}.{key}']!r} has no effect: {why}")
        cfg[f"{L}.{key}"]
    return {"r": rank, "lora_alpha": cfg[f"{L}.alpha"], "target_modules": modules, "exclude_modules": None,
            "use_rslora": False, "use_dora": False, "task_type": "CAUSAL_LM"}
