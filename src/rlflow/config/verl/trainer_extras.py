"""verl ``trainer.*`` keys about what a run keeps and writes, and critic warm-up -> the Trainer's arguments.

- ``max_actor_ckpt_to_keep`` / ``max_critic_ckpt_to_keep`` -> ``Trainer(keep_checkpoints=...)``. verl rotates the
  actor's and the critic's sub-folders of ``global_step_N`` separately, so a step resumes only while both parts
  are there: verl keeps the smaller count of resumable checkpoints (null / 0 / < 0: no limit), plus half
  checkpoints of the other role. rlflow saves both in one folder and keeps that smaller count of whole ones.
  Without a critic only the actor's key counts, as in verl.
- ``critic_warmup=N`` -> ``Trainer(critic_warmup_steps=N - 1)``: verl skips the actor update while
  ``critic_warmup > global_steps``, with steps numbered from 1, so N gives N - 1 critic-only steps. Without a
  critic verl would skip the policy update all the same and train nothing in those steps: refused.
- ``rollout_data_dir`` / ``validation_data_dir`` / ``log_val_generations`` -> the callbacks of
  :mod:`rlflow.trainer.generations`.
"""

from __future__ import annotations

from rlflow.config.verl.loading import ConfigError, VerlConfig

T = "trainer"


def keep_checkpoints(cfg: VerlConfig, notes: list[str], with_critic: bool) -> int | None:
    actor, critic = cfg[f"{T}.max_actor_ckpt_to_keep"], cfg[f"{T}.max_critic_ckpt_to_keep"]
    actor, critic = (None if v is None or v <= 0 else v for v in (actor, critic))
    if not with_critic:
        if critic is not None:
            notes.append(f"{T}.max_critic_ckpt_to_keep={critic}: no effect, this run has no critic "
                         f"(max_actor_ckpt_to_keep rotates the checkpoints)")
        keep = actor
    else:
        keep = min((v for v in (actor, critic) if v is not None), default=None)
        if actor != critic:
            notes.append(f"{T}.max_actor_ckpt_to_keep={actor} and max_critic_ckpt_to_keep={critic}: rlflow saves "
                         f"actor and critic in one global_step_N folder and keeps the newest {keep}: the checkpoints "
                         "verl can resume from (it would also keep the other role's half of older steps, which "
                         "cannot resume)")
    if keep is not None and cfg[f"{T}.save_freq"] <= 0:
        notes.append(f"{T}.max_actor_ckpt_to_keep={keep}: no effect, trainer.save_freq={cfg[f'{T}.save_freq']} "
                     "saves no checkpoints")
    return keep


def critic_warmup_steps(cfg: VerlConfig, notes: list[str], with_critic: bool) -> int:
    n = cfg[f"{T}.critic_warmup"]
    steps = max(n - 1, 0)
    rule = "verl skips the actor update while critic_warmup > global_steps, steps numbered from 1"
    if not with_critic:
        if steps:
            raise ConfigError(f"{T}.critic_warmup={n} without a critic: {rule}, so steps 1-{steps} would train "
                              "nothing at all. Set trainer.critic_warmup=0, or train a critic "
                              "(algorithm.adv_estimator=gae, or critic.enable=True)")
        if n:
            notes.append(f"{T}.critic_warmup={n}: no effect ({rule}: with 1, no step)")
        return 0
    if n:
        notes.append(f"{T}.critic_warmup={n}: the first {steps} step(s) update only the critic ({rule}): "
                     f"Trainer(critic_warmup_steps={steps})")
    return steps


def folder(cfg: VerlConfig, key: str) -> str | None:
    value = cfg[key]
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{key}={value!r}: expected a folder path (or null: off)")
    return value


def generation_callbacks(cfg: VerlConfig, notes: list[str]) -> list:
    """DumpGenerations / LogValidationGenerations for the keys that are set (none: an empty list)."""
    from rlflow.trainer.generations import DumpGenerations, LogValidationGenerations

    rollouts, validation = folder(cfg, f"{T}.rollout_data_dir"), folder(cfg, f"{T}.validation_data_dir")
    out = [DumpGenerations(rollouts, validation)] if rollouts or validation else []
    n = cfg[f"{T}.log_val_generations"]
    validates = cfg["data.val_files"] and (cfg[f"{T}.test_freq"] > 0 or cfg[f"{T}.val_before_train"])
    for key, on in ((f"{T}.validation_data_dir", validation), (f"{T}.log_val_generations", n)):
        if on and not validates:
            notes.append(f"{key}: no effect, this run never validates (it needs data.val_files and trainer.test_freq "
                         "> 0 or trainer.val_before_train)")
    return out + ([LogValidationGenerations(n)] if n else [])
