"""verl 0.9.1's keys beyond the tree rlflow first mirrored: what each one does here.

Every leaf key of verl 0.9.1's tree (``config/verl/``) can be set. Those that rlflow reads are honoured
where they are read; the rest are listed here, merged into :mod:`rlflow.config.tables`:

- ``INERT``: accepted, and a note at start-up says the key changes nothing here, and why (an engine,
  placement or profiling knob of a system rlflow does not run);
- ``NOT_SUPPORTED``: accepted at verl's default; set otherwise, refused with the feature it asks for,
  because ignoring it would change what the user gets (another algorithm, another model).

Keys are dotted; ``*`` matches any run of characters (``fnmatch``), so one row covers a subtree.
"""

from __future__ import annotations

from typing import Any, Callable


def _truthy(v: Any) -> bool:
    return bool(v)


def _not(*ok: Any) -> Callable[[Any], bool]:
    return lambda v: v not in ok


# ------------------------------------------------------------------ actor_rollout_ref.* and critic.*
ROLE_INERT: dict[str, str] = {
}
ROLE_NOT_SUPPORTED: dict[str, tuple[str, Callable[[Any], bool]]] = {
}

# ------------------------------------------ data, reward_model, algorithm, trainer and the other sections
_RM_SERVER = ("a setting of verl's reward-model servers (the legacy name of reward.reward_model.*); rlflow's "
              "reward model (reward_model.model.path) scores in the training processes with transformers")
_SANDBOX = "a SandboxFusion server (rlflow runs code in its local sandbox: code data sources are scored without a server)"
_V1_ASYNC = "only used with trainer.v1.trainer_mode=colocate_async / separate_async (refused; see trainer.v1.trainer_mode)"
RUN_INERT: dict[str, str] = {
    "data.audio_key": "audio inputs are not supported yet (images are: data.image_key)",
    **{f"reward_model.{k}": _RM_SERVER for k in ("enable_resource_pool", "n_gpus_per_node", "nnodes", "rollout.*")},
    **{f"reward_model.reward_loop_{k}": "only used with reward_model.reward_loop_source=importlib, not supported yet"
       for k in ("module_path", "class_name")},
    "sandbox_fusion.max_concurrent": "code runs in rlflow's local sandbox (rlflow.rewards.code)",
    "sandbox_fusion.memory_limit_mb": ("code runs in rlflow's local sandbox; its limits are "
                                       "rlflow.rewards.code.DEFAULT_LIMITS (512 MiB)"),
    "algorithm.filter_groups.max_inflight_gen_batches": (
        "bounds how many prompt batches verl's V1 trainer generates at once for DAPO (surplus groups are "
        "discarded); rlflow's DynamicSampling generates one data.train_batch_size batch at a time, as verl's default 1"),
    "distillation.*": "only used with distillation.enabled=True, not supported yet",
    "transfer_queue.*": "verl's TransferQueue is a Ray data store between its workers; rlflow passes batches in memory",
    "trainer.v1.sync": "verl V1's sync mode takes no options",
    "trainer.v1.colocate_async.*": _V1_ASYNC, "trainer.v1.separate_async.*": _V1_ASYNC,
    "trainer.v1.sampler.max_off_policy_*": ("verl V1's staleness bound for its asynchronous modes; in sync mode "
                                            "(rlflow's) every sample comes from the current weights"),
    "trainer.v1.sampler.sync_refill_failed_groups": ("replaces groups whose generation failed; rlflow's rollout "
                                                     "returns every group (a failing generation stops the step)"),
    "trainer.v1.sampler.custom_sampler.name": "only used with trainer.v1.sampler.custom_sampler.path, not supported yet",
    "trainer.v1.sampler.sampler_kwargs": "only used with trainer.v1.sampler.custom_sampler.path, not supported yet",
    "skip.*": "only used with skip.*.enable=True (replaying dumped rollouts), not supported yet",
}
RUN_NOT_SUPPORTED: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "data.function_tool_path": ("@function_tool files (function_tool_path; rlflow's tools come from "
                                "multi_turn.tool_config_path)", _truthy),
    "reward_model.reward_loop_source": ("custom reward-manager classes (reward_loop_source=importlib)",
                                        _not(None, "register")),
    "sandbox_fusion.url": (_SANDBOX, _truthy),
    "distillation.enabled": ("on-policy distillation from teacher models (distillation.*)", _truthy),
    "trainer.v1.sampler.custom_sampler.path": ("custom replay-buffer samplers (trainer.v1.sampler.custom_sampler)",
                                               _truthy),
    "skip.*.enable": ("replaying dumped rollouts (verl's skip.*)", _truthy),
}

INERT = ROLE_INERT | RUN_INERT
NOT_SUPPORTED = ROLE_NOT_SUPPORTED | RUN_NOT_SUPPORTED
