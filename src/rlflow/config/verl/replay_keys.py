"""verl's replay of dumped rollouts -> the kwargs of :class:`rlflow.rollout.replay.ReplayRollout`.

verl (a debugging aid to iterate on training without generating again) dumps each step's generated batch to a
folder the first time and, on a later run with the same keys, loads it instead of generating:

- verl 0.9's ``skip.<section>.enable`` with ``dump_dir``, ``steps`` (only the listed steps are dumped and replayed:
  none by default) and ``action`` (``cache``: step k from step k's dump; ``repeat``: the nearest dumped step). Its
  sections are read by one trainer each: ``skip.rollout`` by the legacy trainer (``trainer.use_v1=False``),
  ``skip.rollout_tq`` by the V1 trainer, ``skip.async_rollout`` by the fully asynchronous one; rlflow has one loop
  and honours whichever section is enabled (one at most).
- the older ``actor_rollout_ref.rollout.skip_rollout`` with ``skip_dump_dir``: every step, ``cache``.

verl's dumps are pickled verl ``DataProto`` objects; rlflow writes and reads its own format in
``<dump folder>/<experiment_name>_<project_name>`` and refuses verl's (the class says how).
"""

from __future__ import annotations

from rlflow.config.errors import ConfigError
from rlflow.config.verl.loading import VerlConfig
from rlflow.rollout.replay import ACTIONS

R = "actor_rollout_ref.rollout"
SECTIONS = {"skip.rollout": "the legacy trainer (trainer.use_v1=False)", "skip.rollout_tq": "the V1 trainer",
            "skip.async_rollout": "the fully asynchronous trainer"}
OLD, OLD_DIR = f"{R}.skip_rollout", f"{R}.skip_dump_dir"
# the settings a dump is generated with, checked on replay (besides the rollout's n, temperature, max_new_tokens)
FINGERPRINT = {"model": "actor_rollout_ref.model.path", "rollout": f"{R}.name", "top_p": f"{R}.top_p",
               "top_k": f"{R}.top_k", "do_sample": f"{R}.do_sample", "max_prompt_length": "data.max_prompt_length",
               "train_batch_size": "data.train_batch_size"}


def replay_plan(cfg: VerlConfig, notes: list[str], asynchronous: bool) -> dict | None:
    """ReplayRollout's kwargs, or None when no replay key is on; ``asynchronous``: the run generates ahead
    (AsyncRollout, FullyAsyncRollout), which replay does not wrap yet."""
    enabled = [s for s in SECTIONS if cfg[f"{s}.enable"]]
    old = bool(cfg[OLD])
    if len(enabled) + old > 1:
        on = [f"{s}.enable=True" for s in enabled] + ([f"{OLD}=True"] if old else [])
        raise ConfigError(f"{', '.join(on)}: each turns on the replay of dumped rollouts; rlflow has one training "
                          "loop and one dump folder: keep one")
    if not enabled and not old:
        return None
    key = f"{enabled[0]}.enable" if enabled else OLD
    if asynchronous:
        raise ConfigError(f"{key}=True: replaying dumped rollouts with asynchronous generation (AsyncRollout, "
                          "FullyAsyncRollout: batches generated ahead) is not supported yet; replay with "
                          "synchronous generation (the default)")
    folder = cfg[f"{enabled[0]}.dump_dir"] if enabled else cfg[OLD_DIR]
    name = f"{cfg['trainer.experiment_name']}_{cfg['trainer.project_name']}"
    kwargs = {"dump_dir": f"{folder}/{name}", "settings": {k: cfg[v] for k, v in FINGERPRINT.items()}}
    if enabled:
        section = enabled[0]
        steps, kwargs["action"] = list(cfg[f"{section}.steps"] or []), cfg[f"{section}.action"]
        kwargs["rounds"] = steps
        if kwargs["action"] not in ACTIONS:
            raise ConfigError(f"{section}.action={kwargs['action']!r}: expected one of {ACTIONS} (as verl)")
        if not steps:
            notes.append(f"{section}.enable=True with {section}.steps=[]: no step is dumped or replayed (verl's "
                         "SkipManager acts on the listed steps only); list them, e.g. steps=[1,2,3]")
        notes.append(f"{section}.enable=True: verl reads it in {SECTIONS[section]}; rlflow's one loop replays with "
                     f"ReplayRollout from {kwargs['dump_dir']}")
    return kwargs
