"""The Megatron plugin: tensor, pipeline, expert and data parallel training with megatron-core.

    pip install -e ".[megatron]"

    from rlflow.strategies.megatron import MegatronStrategy
    trainer = Trainer(policy=Policy.from_pretrained(path), ..., strategy=MegatronStrategy(tensor_parallel=2),
                      devices=2)

Importing this package is cheap: megatron-core (about 10 s to import) is imported when a strategy
starts. See docs/megatron.md for the seam, the conversion, the layouts and the limits.
"""

from __future__ import annotations

import importlib.util

from rlflow.strategies.megatron.dist_checkpoint import check_folder as check_dist_checkpoint
from rlflow.strategies.megatron.layout import ParallelLayout
from rlflow.strategies.megatron.strategy import MegatronStrategy

MEGATRON_CORE_VERSION = "0.16.1"  # the version this plugin is tested with (pinned by the "megatron" extra)


def megatron_available() -> bool:
    """Whether megatron-core can be imported here."""
    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


__all__ = ["MegatronStrategy", "ParallelLayout", "check_dist_checkpoint", "megatron_available",
           "MEGATRON_CORE_VERSION"]
