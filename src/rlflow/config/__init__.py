"""Configuration: verl's key tree (with Hydra overrides) and rlflow's short native recipe format.

Both end in one :class:`~rlflow.config.plan.Plan` that :mod:`rlflow.config.build` turns into the
same objects the Python API builds (``Policy``, ``HFRollout``, ``FunctionReward``, ``GRPO``,
``PPOLoss``, ``PromptData``, ``Trainer``).
"""

from rlflow.config.loading import ConfigError, NotSupportedError, VerlConfig, load_config
from rlflow.config.plan import Plan, make_plan

__all__ = ["ConfigError", "NotSupportedError", "VerlConfig", "load_config", "Plan", "make_plan"]
