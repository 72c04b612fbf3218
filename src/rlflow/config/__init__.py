"""Configuration: component trees (rlflow's recipe format, :mod:`rlflow.config.components`), verl's key tree (with
Hydra overrides) and the short recipe format, a shorthand for verl keys (:mod:`rlflow.config.verl.native`).

verl's keys and the short format end in one :class:`~rlflow.config.verl.plan.Plan`, whose component tree
:mod:`rlflow.config.verl.build` builds into the objects the Python API builds (``Policy``, ``HFRollout``,
``FunctionReward``, ``GRPO``, ``PPOLoss``, ``PromptData``, ``Trainer``). Loading and checking a config (:mod:`~rlflow.config.verl.loading`,
:mod:`~rlflow.config.verl.validate`) import nothing heavy; the plan and the builders load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from rlflow.config.verl.loading import ConfigError, ConfigProblems, NotSupportedError, VerlConfig, load_config

__all__ = ["ConfigError", "ConfigProblems", "NotSupportedError", "VerlConfig", "load_config", "Plan", "make_plan"]


def __getattr__(name: str) -> Any:
    if name in ("Plan", "make_plan"):  # imports torch: only when asked for
        return getattr(importlib.import_module("rlflow.config.verl.plan"), name)
    raise AttributeError(f"module 'rlflow.config' has no attribute {name!r}")
