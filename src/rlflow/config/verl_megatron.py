"""Moved to :mod:`rlflow.config.verl.megatron`; this path is the same module, kept for old imports
(deprecated: it warns)."""

import sys
import warnings

from rlflow.config.verl import megatron as _moved

warnings.warn("rlflow.config.verl_megatron is now rlflow.config.verl.megatron; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
