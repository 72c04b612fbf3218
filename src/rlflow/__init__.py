"""rlflow: reinforcement-learning post-training of language models, in composable PyTorch modules.

The names below are imported on first use (PEP 562), so ``rlflow --help`` and a config error come
back without importing torch, transformers or Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "Trainer": "rlflow.trainer.trainer", "Policy": "rlflow.models.policy", "Critic": "rlflow.models.critic",
    "HFRollout": "rlflow.rollout.hf", "Reward": "rlflow.rewards", "FunctionReward": "rlflow.rewards",
    "AdvantageEstimator": "rlflow.algorithms", "GRPO": "rlflow.algorithms", "GAE": "rlflow.algorithms",
    "PPOLoss": "rlflow.algorithms", "ValueLoss": "rlflow.algorithms", "LossOutput": "rlflow.algorithms",
    "PromptData": "rlflow.data.prompts", "BatchModule": "rlflow.module",
    "register_estimator": "rlflow.registry", "register_policy_loss": "rlflow.registry",
    **{name: "rlflow.trainer.options" for name in ("Optim", "Batching", "Loop", "RunDir", "Hardware")},
}
__all__ = ["Trainer", "Policy", "Critic", "HFRollout", "Reward", "FunctionReward", "AdvantageEstimator", "GRPO", "GAE",
           "PPOLoss", "ValueLoss", "LossOutput", "PromptData", "BatchModule", "keys", "register_estimator",
           "register_policy_loss", "Optim", "Batching", "Loop", "RunDir", "Hardware"]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load lazily
    from rlflow.algorithms import GAE, GRPO, AdvantageEstimator, LossOutput, PPOLoss, ValueLoss
    from rlflow.data import keys
    from rlflow.data.prompts import PromptData
    from rlflow.models.critic import Critic
    from rlflow.models.policy import Policy
    from rlflow.module import BatchModule
    from rlflow.registry import register_estimator, register_policy_loss
    from rlflow.rewards import FunctionReward, Reward
    from rlflow.rollout.hf import HFRollout
    from rlflow.trainer.options import Batching, Hardware, Loop, Optim, RunDir
    from rlflow.trainer.trainer import Trainer


def __getattr__(name: str) -> Any:
    if name == "keys":
        value = importlib.import_module("rlflow.data.keys")
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'rlflow' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
