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
is started again in one run (``ProcessEngine``; one-step-off and the V1 modes alike), before the run stops naming it.

verl 0.9's V1 asynchronous modes (``trainer.use_v1=True``, ``trainer.v1.trainer_mode=colocate_async`` or
``separate_async``) are fully asynchronous with partial rollouts: the rollout is wrapped as
``FullyAsyncRollout(rollout, max_off_policy_threshold, max_off_policy_strategy, num_warmup_batches)`` from
``trainer.v1.sampler.*`` and ``trainer.v1.<mode>.num_warmup_batches`` (docs/async.md), with the same IS default.
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
USE_V1, MODE = "trainer.use_v1", "trainer.v1.trainer_mode"
THRESHOLD, STRATEGY = "trainer.v1.sampler.max_off_policy_threshold", "trainer.v1.sampler.max_off_policy_strategy"


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
    correction(cfg, notes, after, key)
    notes.append(f"{key}: the Trainer gets rollout=AsyncRollout(rollout, max_staleness={int(steps)}) (the engine "
                 "runs beside the trainer; docs/async.md)")
    restarts = {"max_engine_restarts": int(cfg[RESTARTS])} if cfg.is_provided(RESTARTS) else {}  # else its default
    return {"max_staleness": int(steps)} | restarts


def v1_async_plan(cfg: VerlConfig, notes: list[str], devices: Devices, after: list, dynamic_sampling: dict | None
                  ) -> dict | None:
    """FullyAsyncRollout's kwargs for verl V1's asynchronous modes, or None (``sync``, or the legacy trainer)."""
    mode = cfg[MODE]
    if not cfg[USE_V1] or mode == "sync":
        return None
    if cfg[SWITCH] or cfg.is_provided(STALENESS):
        other = SWITCH if cfg[SWITCH] else STALENESS
        raise ConfigError(f"{MODE}={mode!r} and {other}={cfg[other]!r} choose two asynchronous modes: fully "
                          f"asynchronous with partial rollouts ({MODE}) or one-step-off ({other}); set one of them")
    if devices.processes > 1:
        raise NotSupportedError(MODE, mode, "fully asynchronous generation with several training processes",
                                "Run it on one process, or use trainer_mode=sync.")
    if dynamic_sampling:
        raise NotSupportedError(MODE, mode, "fully asynchronous generation with dynamic sampling "
                                "(algorithm.filter_groups)", "Turn one of them off.")
    threshold, strategy = cfg[THRESHOLD], cfg[STRATEGY]
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1):
        raise ConfigError(f"{THRESHOLD}={threshold!r}: an integer >= 1 (model versions from a prompt's first "
                          "generation to its training; 1: trained on the weights it was admitted under) or null")
    if strategy not in ("drop", "wait"):
        raise ConfigError(f"{STRATEGY}={strategy!r}: choose from drop, wait")
    warmup_key = f"trainer.v1.{mode}.num_warmup_batches"
    warmup = cfg[warmup_key]
    if isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or warmup < 0:
        raise ConfigError(f"{warmup_key}={warmup!r}: a number of batches >= 0")
    correction(cfg, notes, after, MODE)
    kwargs = {"max_off_policy_threshold": threshold, "max_off_policy_strategy": strategy,
              "num_warmup_batches": warmup}
    if cfg.is_provided(RESTARTS):
        kwargs["max_engine_restarts"] = int(cfg[RESTARTS])
    notes.append(f"{MODE}={mode}: the Trainer gets rollout=FullyAsyncRollout(rollout, "
                 + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ") (generation runs beside training with "
                 "partial rollouts; the engine in its own process or a server driven from a thread, in either mode; "
                 "docs/async.md)")
    return kwargs


def correction(cfg: VerlConfig, notes: list[str], after: list, key: str) -> None:
    """Truncated IS against the sampler's log-probs unless the config sets the correction (or bypass mode)."""
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
