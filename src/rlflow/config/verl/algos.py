"""Config -> algorithm classes: the candidate constructor values of estimators, losses and KL
controllers, and the modules chained around an estimator (KL in the reward, ReMax's greedy
baseline, rollout-correction weights). Classes are looked up by name in :mod:`rlflow.algorithms`.
"""

from __future__ import annotations

from typing import Any

import rlflow.algorithms
from rlflow.config.verl import tables
from rlflow.algorithms.bypass import LOSS_TYPES
from rlflow.algorithms.correction import parse_is_threshold
from rlflow.algorithms.rejection import parse_rs
from rlflow.config.verl.asynchronous import bypass_mode
from rlflow.config.verl.loading import ConfigError, NotSupportedError, VerlConfig
from rlflow.config.verl.optim import first_set
from rlflow.config.verl.resolve import Candidate, class_kwargs, fill, instantiate, key, resolve_class

A = "actor_rollout_ref.actor"
RC = "algorithm.rollout_correction.rollout_is_"
BYPASS, LOSS_TYPE = "algorithm.rollout_correction.bypass_mode", "algorithm.rollout_correction.loss_type"

__all__ = ["ESTIMATOR_POOL", "KL_CTRL_POOL", "KL_IN_REWARD_KEYS", "bypass_loss", "companions", "loss_pool", "pf_ppo"]


def loss_pool(cfg: VerlConfig) -> dict[str, Candidate]:
    """Candidate constructor values for policy losses, by parameter name."""
    use_kl = Candidate((f"{A}.use_kl_loss", f"{A}.kl_loss_coef"),
                       lambda c: float(c[f"{A}.kl_loss_coef"]) if c[f"{A}.use_kl_loss"] else 0.0, always=True)
    pool = {name: key(f"{A}.{name}") for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c",
                                                   "loss_scale_factor")}
    # SAPO: verl reads actor.tau_pos / tau_neg; its SAPO example writes +actor.policy_loss.tau_pos (either here)
    pool |= {name: Candidate((f"{A}.{name}", f"{A}.policy_loss.{name}"),
                             lambda c, n=name: first_set(c, (f"{A}.policy_loss.{n}", f"{A}.{n}")))
             for name in ("tau_pos", "tau_neg")}
    pool |= {name: key(f"{A}.policy_loss.{name}") for name in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub",
                                                                "kl_cov_ratio", "ppo_kl_coef")}
    return pool | {"kl_coef": use_kl, "kl_type": key(f"{A}.kl_loss_type"), "entropy_coef": key(f"{A}.entropy_coeff"),
                   "agg": key(f"{A}.loss_agg_mode")}


ESTIMATOR_POOL = {"gamma": key("algorithm.gamma"), "lam": key("algorithm.lam"),
                  "norm_by_std": key("algorithm.norm_adv_by_std_in_grpo"),
                  "norm_adv_by_std_in_grpo": key("algorithm.norm_adv_by_std_in_grpo"),
                  "reward_keys": key("algorithm.gdpo_reward_keys"), "reward_weights": key("algorithm.gdpo_reward_weights")}
KL_IN_REWARD_KEYS = ("algorithm.kl_penalty", "algorithm.kl_ctrl.type")  # read when use_kl_in_reward is on
KL_CTRL_POOL = {name: key(f"algorithm.kl_ctrl.{k}") for name, k in (
    ("kl_coef", "kl_coef"), ("init_coef", "kl_coef"), ("coef", "kl_coef"), ("target_kl", "target_kl"),
    ("horizon", "horizon"))}


def gdpo_keys(estimator_kwargs: dict) -> None:
    """An estimator taking ``reward_keys`` (GDPO) needs ``algorithm.gdpo_reward_keys``: fail at planning."""
    if "reward_keys" in estimator_kwargs and not estimator_kwargs["reward_keys"]:
        raise ConfigError("algorithm.gdpo_reward_keys is not set: GDPO normalises each reward key the reward function "
                          "returns beside 'score' on its own; list them, e.g. "
                          "+algorithm.gdpo_reward_keys='[accuracy_reward, format_reward]'")


def algorithm_class(name: str, key_: str, value: Any) -> type:
    cls = getattr(rlflow.algorithms, name, None)
    if cls is None:
        raise NotSupportedError(key_, value, f"{name} (not in rlflow.algorithms yet)")
    return cls


def is_threshold(cfg: VerlConfig) -> tuple[float, float | None]:
    """``rollout_is_threshold``: a number (truncation at it) or verl's ``'lower_upper'`` string (IcePop: weights
    outside ``[lower, upper]`` are zeroed); a bad one is an error naming the key."""
    value = cfg[RC + "threshold"]
    try:
        return parse_is_threshold(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{RC}threshold={value!r}: {e}") from None


def companions(cfg: VerlConfig, estimator_cls: type) -> tuple[list, list, tuple | None]:
    """Modules chained around the estimator: KL in the reward, ReMax's greedy baseline, IS weights."""
    before, after, controller = [], [], None
    if cfg["algorithm.use_kl_in_reward"]:
        ctrl_cls = resolve_class("algorithm.kl_ctrl.type", cfg["algorithm.kl_ctrl.type"], tables.KL_CONTROLLERS,
                                 rlflow.algorithms)
        controller = (ctrl_cls, class_kwargs(ctrl_cls, KL_CTRL_POOL, cfg))
        wrapper = algorithm_class(tables.KL_IN_REWARD, "algorithm.use_kl_in_reward", True)
        pool = {"kind": key("algorithm.kl_penalty", always=True), "kl_type": key("algorithm.kl_penalty", always=True),
                "controller": fill("KL controller")}
        before.append((wrapper, class_kwargs(wrapper, pool, cfg)))
    if estimator_cls.__name__ in tables.ESTIMATOR_BEFORE:
        cls = algorithm_class(tables.ESTIMATOR_BEFORE[estimator_cls.__name__], "algorithm.adv_estimator",
                              cfg["algorithm.adv_estimator"])
        before.append((cls, class_kwargs(cls, {"rollout": fill("rollout"), "reward": fill("reward")}, cfg)))
    corrections = rollout_correction(cfg)
    if bypass_mode(cfg):  # the sampler's log-probs are the old ones; the loss corrects (bypass_loss), not the chain
        before.insert(0, (algorithm_class(tables.BYPASS, BYPASS, True), {}))
    else:
        after += corrections
    return before, after, controller


def rollout_correction(cfg: VerlConfig) -> list[tuple[type, dict]]:
    """``rollout_is`` / ``rollout_rs`` -> ``[(TruncatedIS, kwargs), (RejectionSampling, kwargs)]`` (those set)."""
    out = []
    level = cfg["algorithm.rollout_correction.rollout_is"]
    if level:
        cls = algorithm_class(tables.ROLLOUT_IS, "algorithm.rollout_correction.rollout_is", level)
        upper, lower = is_threshold(cfg)
        pool = {"level": Candidate((), lambda c: level, always=True),
                "threshold": Candidate((RC + "threshold",), lambda c: upper, always=True),
                "lower": Candidate((), lambda c: lower, always=lower is not None),
                "batch_normalize": key(RC + "batch_normalize")}
        out.append((cls, class_kwargs(cls, pool, cfg)))
    if options := cfg["algorithm.rollout_correction.rollout_rs"]:
        cls = algorithm_class(tables.ROLLOUT_RS, "algorithm.rollout_correction.rollout_rs", options)
        threshold = cfg["algorithm.rollout_correction.rollout_rs_threshold"]
        try:
            parse_rs(options, threshold)
        except ValueError as e:
            raise ConfigError(f"algorithm.rollout_correction.rollout_rs={options!r}, rollout_rs_threshold="
                              f"{threshold!r}: {e}") from None
        out.append((cls, {"options": options, "threshold": threshold}))
    return out


def bypass_loss(cfg: VerlConfig, loss_cls: type, notes: list[str]) -> tuple[type, dict | None]:
    """verl's bypass mode replaces the policy loss with its own (``loss_mode=bypass_mode``, as verl's
    ``apply_bypass_mode`` does): ``(BypassLoss, its fixed kwargs)``; without bypass mode ``(loss_cls, None)``."""
    mode = cfg[f"{A}.policy_loss.loss_mode"]
    if not bypass_mode(cfg):
        if loss_cls.__name__ == tables.BYPASS_LOSS:
            raise ConfigError(f"{A}.policy_loss.loss_mode=bypass_mode needs {BYPASS}=True (verl's loss reads the "
                              "sampler's log-probs as the old ones, which only bypass mode provides)")
        return loss_cls, None
    loss_type = cfg[LOSS_TYPE]
    cls = algorithm_class(tables.BYPASS_LOSS, BYPASS, True)
    if loss_type not in LOSS_TYPES:
        raise ConfigError(f"{LOSS_TYPE}={loss_type!r}: unknown; valid: {', '.join(LOSS_TYPES)}")
    if mode not in ("vanilla", "bypass_mode"):
        notes.append(f"{BYPASS}=True: {A}.policy_loss.loss_mode={mode!r} is replaced by verl's bypass loss "
                     f"(loss_type={loss_type}: {'PPO-clip' if loss_type == 'ppo_clip' else 'REINFORCE'} against "
                     "the sampler's log-probs), as verl's apply_bypass_mode does")
    made = {c.__name__: instantiate(c, kwargs, "algorithm.rollout_correction.*") for c, kwargs in rollout_correction(cfg)}
    return cls, {"loss_type": loss_type, "weights": made.get(tables.ROLLOUT_IS),
                 "rejection": made.get(tables.ROLLOUT_RS)}



PF = "algorithm.pf_ppo"


def pf_ppo(cfg: VerlConfig, estimator_cls: type, notes: list[str]) -> list[tuple[type, dict]]:
    """``algorithm.use_pf_ppo`` -> ``[(PFPPO, kwargs)]`` after the estimator; as in verl, only GAE resamples
    (with another estimator the key changes nothing, and a note says so)."""
    if not cfg["algorithm.use_pf_ppo"]:
        return []
    method, power = cfg[f"{PF}.reweight_method"], cfg[f"{PF}.weight_pow"]
    if estimator_cls.__name__ != "GAE":
        notes.append(f"algorithm.use_pf_ppo=True has no effect with algorithm.adv_estimator="
                     f"{cfg['algorithm.adv_estimator']}: verl resamples by PF-PPO's weights only after GAE")
        return []
    cls = algorithm_class("PFPPO", "algorithm.use_pf_ppo", True)
    if method not in ("pow", "max_min", "max_random"):
        raise ConfigError(f"{PF}.reweight_method={method!r}: unknown; valid: pow, max_min, max_random")
    if isinstance(power, bool) or not isinstance(power, (int, float)):
        raise ConfigError(f"{PF}.weight_pow={power!r}: must be a number")
    return [(cls, {"reweight_method": method, "weight_pow": float(power)})]
