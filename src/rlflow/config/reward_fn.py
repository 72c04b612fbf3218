"""Moved to :mod:`rlflow.config.verl.reward_fn`; this path is the same module, kept for old imports
(deprecated: it warns)."""

import sys
import warnings

from rlflow.config.verl import reward_fn as _moved

warnings.warn("rlflow.config.reward_fn is now rlflow.config.verl.reward_fn; import it from there", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
