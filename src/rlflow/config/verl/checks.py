"""The rules a config is checked against before anything heavy loads: one line per key.

- ``RANGES``: key -> the interval a number must lie in (temperatures, lengths, batch sizes, ratios,
  coefficients). ``count()`` is an integer >= 1; ``ge``/``gt``/``between`` are intervals; every
  number must be finite; ``None`` passes where the default is ``None`` (the key is optional).
- ``CHOICES``: key -> the strings it may take.
- ``PATHS``: key -> what it must point at: ``"data"`` (existing data files), ``"model"`` (a model
  folder with ``config.json``, weights and tokenizer, or a hub id; ``"critic model"`` and ``"reward
  model"`` only when the run has one), ``"python"`` (a ``.py`` file or an importable module).
- ``REGISTRIES``: key -> the :class:`~rlflow.registry.Registry` whose names (or ``file.py:Class``) it takes.

Rules between keys are functions in :mod:`rlflow.config.verl.validate` (``CROSS_CHECKS``). To add a key
of a new feature, add its line here; :func:`rlflow.config.verl.validate.validate` reads these tables and
reports every problem of a config in one message.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from rlflow import registry
from rlflow.config.verl import tables

A, R, C, REF = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "critic", "actor_rollout_ref.ref"


@dataclass(frozen=True)
class Range:
    """``low <= value <= high`` (``<`` where open); ``special`` values are allowed besides (e.g. -1: off)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    special: tuple = ()
    note: str = ""

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            text = f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {self.low}"
        elif self.high is not None:
            text = f"{'<' if self.high_open else '<='} {self.high}"
        else:
            text = "a finite number"
        text += " (an integer)" if self.integer else ""
        if self.special:
            text += f", or {' / '.join(map(str, self.special))}"
        return text + (f": {self.note}" if self.note else "")

    def problem(self, key: str, value: Any) -> str | None:
        if value is None or value in self.special and not isinstance(value, bool):
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return f"{key}={value!r}: expected {'an integer' if self.integer else 'a number'} {self.describe()}"
        bad = (not math.isfinite(value) or (self.integer and value != int(value))
               or (self.low is not None and (value <= self.low if self.low_open else value < self.low))
               or (self.high is not None and (value >= self.high if self.high_open else value > self.high)))
        return f"{key}={value!r}: must be {self.describe()}" if bad else None


def count(minimum: int = 1, **kw: Any) -> Range:
    """An integer >= ``minimum`` (batch sizes, lengths, sample counts, process counts)."""
    return Range(low=minimum, integer=True, **kw)


def ge(low: float, **kw: Any) -> Range:
    return Range(low=low, **kw)


def gt(low: float, **kw: Any) -> Range:
    return Range(low=low, low_open=True, **kw)


def between(low: float, high: float, **kw: Any) -> Range:
    return Range(low=low, high=high, **kw)


ANY_NUMBER = Range()
PROB = between(0, 1)

RANGES: dict[str, Range] = {
    # data
    "data.train_batch_size": count(note="prompts per RL step"),
    "data.max_prompt_length": count(note="tokens"),
    "data.max_response_length": count(note="tokens generated per sample"),
    "data.seed": count(0),
    "async_training.max_engine_restarts": count(0, note="times a dead generation process is started again per run"),
    # actor: batch sizes, clipping, coefficients, optimizer
    f"{A}.ppo_mini_batch_size": count(note="prompts per optimizer step"),
    f"{A}.ppo_micro_batch_size": count(), f"{A}.ppo_micro_batch_size_per_gpu": count(),
    f"{A}.ppo_max_token_len_per_gpu": count(), f"{A}.ppo_epochs": count(),
    f"{A}.clip_ratio": gt(0), f"{A}.clip_ratio_low": ge(0), f"{A}.clip_ratio_high": ge(0),
    f"{A}.clip_ratio_c": gt(1, note="the dual-clip bound"),
    f"{A}.tau_pos": gt(0), f"{A}.tau_neg": gt(0), f"{A}.policy_loss.tau_pos": gt(0), f"{A}.policy_loss.tau_neg": gt(0),
    f"{A}.policy_loss.clip_cov_ratio": between(0, 1, low_open=True),
    f"{A}.policy_loss.clip_cov_lb": ANY_NUMBER, f"{A}.policy_loss.clip_cov_ub": ANY_NUMBER,
    f"{A}.policy_loss.kl_cov_ratio": between(0, 1, low_open=True), f"{A}.policy_loss.ppo_kl_coef": ge(0),
    f"{A}.loss_scale_factor": gt(0), f"{A}.entropy_coeff": ANY_NUMBER, f"{A}.kl_loss_coef": ge(0),
    f"{A}.lr": gt(0), f"{A}.optim.lr": gt(0), f"{A}.max_grad_norm": gt(0), f"{A}.grad_clip": gt(0),
    f"{A}.optim.clip_grad": gt(0), f"{A}.optim.min_lr_ratio": PROB, f"{A}.optim.num_cycles": ge(0),
    f"{A}.data_loader_seed": count(0),
    f"{A}.optim.weight_decay": ge(0), f"{A}.optim.lr_warmup_steps_ratio": PROB,
    f"{A}.optim.lr_warmup_steps": Range(integer=True, note="< 0: use lr_warmup_steps_ratio"),
    f"{A}.ulysses_sequence_parallel_size": count(), f"{A}.fsdp_config.ulysses_sequence_parallel_size": count(),
    # reference and rollout
    f"{REF}.log_prob_micro_batch_size": count(), f"{REF}.log_prob_micro_batch_size_per_gpu": count(),
    f"{REF}.log_prob_max_token_len_per_gpu": count(), f"{C}.forward_max_token_len_per_gpu": count(),
    f"{REF}.ulysses_sequence_parallel_size": count(),
    f"{R}.temperature": ge(0, note="0 samples greedily"), f"{R}.top_p": between(0, 1, low_open=True),
    f"{R}.top_k": count(-1, note="-1 or 0: off"), f"{R}.n": count(note="samples per prompt"),
    f"{R}.response_length": count(), f"{R}.log_prob_micro_batch_size": count(),
    f"{R}.log_prob_micro_batch_size_per_gpu": count(), f"{R}.log_prob_max_token_len_per_gpu": count(),
    f"{R}.val_kwargs.temperature": ge(0), f"{R}.val_kwargs.top_p": between(0, 1, low_open=True),
    f"{R}.val_kwargs.top_k": count(-1), f"{R}.val_kwargs.n": count(),
    # critic
    f"{C}.optim.lr": gt(0), f"{C}.optim.weight_decay": ge(0), f"{C}.optim.lr_warmup_steps_ratio": PROB,
    f"{C}.optim.lr_warmup_steps": Range(integer=True), f"{C}.optim.min_lr_ratio": PROB,
    f"{C}.ppo_mini_batch_size": count(), f"{C}.ppo_micro_batch_size": count(),
    f"{C}.ppo_micro_batch_size_per_gpu": count(), f"{C}.ppo_max_token_len_per_gpu": count(),
    f"{C}.ppo_epochs": count(), f"{C}.cliprange_value": gt(0), f"{C}.forward_micro_batch_size": count(),
    f"{C}.forward_micro_batch_size_per_gpu": count(), f"{C}.ulysses_sequence_parallel_size": count(),
    f"{C}.grad_clip": gt(0), f"{C}.optim.clip_grad": gt(0), f"{C}.optim.num_cycles": ge(0),
    f"{C}.data_loader_seed": count(0), f"{C}.fsdp.ulysses_sequence_parallel_size": count(),
    f"{C}.loss_scale_factor": gt(0),
    # algorithm
    "algorithm.gamma": PROB, "algorithm.lam": PROB, "algorithm.kl_ctrl.kl_coef": ge(0),
    "algorithm.kl_ctrl.horizon": gt(0), "algorithm.kl_ctrl.target_kl": gt(0),
    # rewards
    "reward_model.timeout_s": gt(0, note="seconds per reward call; null: no limit"),
    "reward_model.num_workers": count(note="reward worker processes; null: threads"),
    "reward_model.weight": ANY_NUMBER, "custom_reward_function.weight": ANY_NUMBER,
    "reward_model.micro_batch_size": count(), "reward_model.micro_batch_size_per_gpu": count(),
    "reward_model.max_length": count(2),
    # trainer
    "trainer.total_epochs": count(), "trainer.total_training_steps": count(),
    "trainer.nnodes": count(), "trainer.n_gpus_per_node": count(note="processes per node"),
    "trainer.save_freq": Range(integer=True, note="<= 0: never"),
    "trainer.test_freq": Range(integer=True, note="<= 0: never"),
    "trainer.max_actor_ckpt_to_keep": Range(integer=True, note="null, 0 or < 0: keep every checkpoint"),
    "trainer.max_critic_ckpt_to_keep": Range(integer=True, note="null, 0 or < 0: keep every checkpoint"),
    "trainer.log_val_generations": count(0, note="validation samples logged; 0: none"),
    "trainer.critic_warmup": count(0, note="0 or 1: no warm-up"),
}

# rlflow.algorithms.functional's (torch-free copies; tests/config/test_validate.py keeps them equal)
KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")  # each also with a "+" suffix
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum")

CHOICES: dict[str, tuple] = {
    "data.truncation": ("error", "left", "right", "middle"),
    "data.missing_ground_truth": ("error", "skip", "allow"),
    f"{A}.loss_agg_mode": AGG_MODES, f"{C}.loss_agg_mode": AGG_MODES,
    f"{A}.kl_loss_type": KL_KINDS + tuple(k + "+" for k in KL_KINDS),
    "algorithm.kl_penalty": KL_KINDS + tuple(k + "+" for k in KL_KINDS),
    "algorithm.kl_ctrl.type": tuple(tables.KL_CONTROLLERS),
    "algorithm.rollout_correction.rollout_is": (None, "token", "sequence"),
    f"{A}.optim.lr_scheduler_type": ("constant", "cosine"), f"{A}.optim.warmup_style": (None, "constant", "cosine"),
    f"{C}.optim.lr_scheduler_type": ("constant", "cosine"), f"{C}.optim.warmup_style": (None, "constant", "cosine"),
    "reward_model.reward_manager": tables.REWARD_MANAGERS,
    f"{R}.name": tuple(tables.ROLLOUT_ENGINES),
    "trainer.device": ("auto", "cuda", "cpu"),
    "trainer.resume_mode": ("auto", "disable", "resume_path"),
}

# what a path key must point at ("critic" models are checked only when the run has a critic)
PATHS: dict[str, str] = {
    "data.train_files": "data", "data.val_files": "data",
    "actor_rollout_ref.model.path": "model", "critic.model.path": "critic model",
    "reward_model.model.path": "reward model",
    "custom_reward_function.path": "python",
}

REGISTRIES: dict[str, registry.Registry] = {
    "algorithm.adv_estimator": registry.ESTIMATORS,
    f"{A}.policy_loss.loss_mode": registry.POLICY_LOSSES,
}

# estimators (registered names) that train a critic; a user class decides for itself when imported
NEEDS_CRITIC = ("gae",)
