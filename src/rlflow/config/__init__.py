"""Configuration: verl's key tree (with Hydra overrides) and rlflow's short native recipe format.

Both end in one :class:`~rlflow.config.plan.Plan` that :mod:`rlflow.config.build` turns into the
same objects the Python API builds (``Policy``, ``HFRollout``, ``FunctionReward``, ``GRPO``,
``PPOLoss``, ``PromptData``, ``Trainer``). Loading and checking a config (:mod:`~rlflow.config.loading`,
:mod:`~rlflow.config.validate`) import nothing heavy; the plan and the builders load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from rlflow.config.loading import ConfigError, ConfigProblems, NotSupportedError, VerlConfig, load_config

__all__ = ["ConfigError", "ConfigProblems", "NotSupportedError", "VerlConfig", "load_config", "Plan", "make_plan"]


def __getattr__(name: str) -> Any:
    if name in ("Plan", "make_plan"):  # imports torch: only when asked for
        return getattr(importlib.import_module("rlflow.config.plan"), name)
    raise AttributeError(f"module 'rlflow.config' has no attribute {name!r}")
