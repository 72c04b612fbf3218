"""Advantage estimators and losses: pure tensor math in ``functional``, key-mapping shells around it."""

from rlflow.algorithms import advantages, functional
from rlflow.algorithms.aggregate import Aggregation
from rlflow.algorithms.correction import TruncatedIS
from rlflow.algorithms.rejection import RejectionSampling
from rlflow.algorithms.pf_ppo import PFPPO
from rlflow.algorithms.bypass import BypassLoss, RolloutAsOld
from rlflow.algorithms.mismatch import MismatchMetrics
from rlflow.algorithms.estimators import (
    GAE,
    GDPO,
    GPG,
    GRPO,
    OPO,
    RLOO,
    AdvantageEstimator,
    DrGRPO,
    GreedyBaseline,
    GRPOPassK,
    ReinforcePlusPlus,
    ReinforcePlusPlusBaseline,
    ReMax,
)
from rlflow.algorithms.kl import AdaptiveKLController, FixedKLController, KLInReward
from rlflow.algorithms.distillation import DistillationLoss, PolicyGradientDistillationLoss
from rlflow.algorithms.losses import LossOutput, PPOLoss, ValueLoss
from rlflow.algorithms import policy_functional
from rlflow.algorithms.policy_losses import (
    LOSS_MODES,
    CISPOLoss,
    ClipCovLoss,
    CovSelection,
    DPPOKLLoss,
    DPPOTVLoss,
    GMPOLoss,
    GSPOLoss,
    KLCovLoss,
    ReinforceLoss,
    SAPOLoss,
)
from rlflow.algorithms.self_play import GroupWinRate, NoAdvantage, SPINLoss, SPPOLoss, UpdateReference

__all__ = ["functional", "AdvantageEstimator", "GRPO", "GAE", "PPOLoss", "ValueLoss", "LossOutput",
           "advantages", "DrGRPO", "RLOO", "ReinforcePlusPlus", "ReinforcePlusPlusBaseline", "ReMax", "GreedyBaseline",
           "OPO", "GPG", "GRPOPassK", "KLInReward", "FixedKLController", "AdaptiveKLController", "TruncatedIS"]
__all__ += ["policy_functional", "GSPOLoss", "CISPOLoss", "SAPOLoss", "ClipCovLoss", "KLCovLoss", "CovSelection",
            "GMPOLoss", "ReinforceLoss", "LOSS_MODES", "SPINLoss", "SPPOLoss", "NoAdvantage", "GroupWinRate",
            "UpdateReference", "GDPO", "DPPOTVLoss", "DPPOKLLoss", "RejectionSampling", "Aggregation",
            "BypassLoss", "RolloutAsOld", "MismatchMetrics", "DistillationLoss", "PolicyGradientDistillationLoss", "PFPPO"]
