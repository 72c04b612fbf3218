"""``trainer.async_weight_update`` (the seed's key) and verl's ``async_training.*`` -> ``AsyncRollout``.

The seed answers "slow weight sync / long waits between rollout and training" with
``trainer.async_weight_update=true``; verl's fully-async recipe bounds how far generation runs ahead with
``async_training.staleness_threshold``. In rlflow either one turns on the asynchronous mode: the rollout is
wrapped as ``AsyncRollout(rollout, max_staleness=k)`` (docs/async.md), and truncated importance sampling
(``algorithm.rollout_correction.rollout_is=token``) is switched on unless the config says otherwise.

verl counts ``staleness_threshold`` as a fraction of a batch that may come from older weights; rlflow
generates whole batches ahead, so the value must be a whole number of steps: 0 (synchronous, the engine
in its own process), 1 (one-step-off, the default), 2, ...

``async_training.max_engine_restarts`` (rlflow's key, default 2): how often a generation process that died
is started again in one run (``ProcessEngine``), before the run stops naming it.
"""

from __future__ import annotations

from rlflow.config import tables
from rlflow.config.devices import Devices
from rlflow.config.loading import ConfigError, NotSupportedError, VerlConfig

STALENESS = "async_training.staleness_threshold"
SWITCH = "trainer.async_weight_update"
IS_LEVEL, IS_THRESHOLD = "algorithm.rollout_correction.rollout_is", "algorithm.rollout_correction.rollout_is_threshold"
BYPASS = "algorithm.rollout_correction.bypass_mode"
RESTARTS = "async_training.max_engine_restarts"  # rlflow's: the engine's process started again after it died


def async_plan(cfg: VerlConfig, notes: list[str], devices: Devices, after: list, dynamic_sampling: dict | None
               ) -> dict | None:
    """AsyncRollout's kwargs, or None when the mode is off; appends the IS correction to ``after`` (the
    modules chained after the estimator) when the config leaves it unset."""
    switch, steps = cfg[SWITCH], cfg[STALENESS]
    if not (switch or cfg.is_provided(STALENESS)):
        return None
    key = STALENESS if cfg.is_provided(STALENESS) else SWITCH
    if isinstance(steps, bool) or not isinstance(steps, (int, float)) or steps < 0 or steps != int(steps):
        raise ConfigError(f"{STALENESS}={steps!r}: rlflow generates whole batches ahead, so the bound is a whole "
                          "number of steps (0: synchronous, 1: one-step-off, the default; 2, ...); verl's fractional "
                          "values allow part of a batch: round up for more overlap, down for fresher samples")
    if devices.processes > 1:
        raise NotSupportedError(key, cfg[key], "asynchronous generation with several training processes",
                                "Run it on one process, or turn it off.")
    if dynamic_sampling:
        raise NotSupportedError(key, cfg[key], "asynchronous generation with dynamic sampling "
                                "(algorithm.filter_groups)", "Turn one of them off.")
    if cfg[BYPASS]:  # the loss corrects against the sampler (rlflow.algorithms.bypass); nothing to add here
        notes.append(f"{key} with {BYPASS}=True: the loss's ratio (or its IS weights) is taken against the "
                     "sampler's log-probs, which correct for the stale weights")
    elif not cfg.is_provided(IS_LEVEL) and not any(cls.__name__ == tables.ROLLOUT_IS for cls, _ in after):
        import rlflow.algorithms

        after.append((getattr(rlflow.algorithms, tables.ROLLOUT_IS), {"level": "token",
                                                                      "threshold": cfg[IS_THRESHOLD]}))
        notes.append(f"{key}: truncated importance sampling is on ({IS_LEVEL}=token, threshold "
                     f"{cfg[IS_THRESHOLD]}); set {IS_LEVEL}=null to train without it")
    elif cfg[IS_LEVEL] is None:
        notes.append(f"{key} with {IS_LEVEL}=null: stale samples are trained without importance-sampling correction")
    notes.append(f"{key}: the Trainer gets rollout=AsyncRollout(rollout, max_staleness={int(steps)}) (the engine "
                 "runs beside the trainer; docs/async.md)")
    restarts = {"max_engine_restarts": int(cfg[RESTARTS])} if cfg.is_provided(RESTARTS) else {}  # else its default
    return {"max_staleness": int(steps)} | restarts
