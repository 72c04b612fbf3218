"""verl's ``full_determinism`` keys -> one switch for the whole run (:mod:`rlflow.trainer.determinism`).

verl turns deterministic kernels on in each worker whose engine sets ``full_determinism``
(``actor.fsdp_config``, ``ref.fsdp_config``, ``critic.fsdp``) and, for ``rollout.full_determinism``, sets vLLM's
batch-invariant kernels for the rollout servers. rlflow's roles share the training processes, so any of the keys
makes the whole run deterministic (a note says so when only some are set); vLLM's batch-invariant kernels are
GPU kernels, so on ``trainer.device=cpu`` that variable is not set (a note says so).
"""

from __future__ import annotations

from rlflow.config.verl.loading import VerlConfig

KEYS = ("actor_rollout_ref.actor.fsdp_config.full_determinism", "actor_rollout_ref.ref.fsdp_config.full_determinism",
        "critic.fsdp.full_determinism", "actor_rollout_ref.rollout.full_determinism")
ROLLOUT = KEYS[-1]


def determinism(cfg: VerlConfig, notes: list[str], accelerator: str) -> dict | None:
    """``full_determinism``'s kwargs (``seed``, ``batch_invariant``), or None when every key is off."""
    on = [k for k in KEYS if cfg[k]]
    if not on:
        return None
    off = [k for k in KEYS if k not in on and cfg.is_provided(k)]
    notes.append(f"{', '.join(on)}=True: deterministic kernels for the whole run (rlflow's roles share its processes"
                 f"{'; ' + ', '.join(off) + '=False cannot exclude a role' if off else ''}); seeds from data.seed")
    batch_invariant = cfg[ROLLOUT] and cfg["actor_rollout_ref.rollout.name"] == "vllm"
    if batch_invariant and accelerator == "cpu":
        notes.append(f"{ROLLOUT}=True: VLLM_BATCH_INVARIANT is not set on trainer.device=cpu (vLLM's batch-invariant "
                     "kernels are GPU kernels)")
        batch_invariant = False
    return {"seed": cfg["data.seed"], "batch_invariant": bool(batch_invariant)}
