"""Moved to :mod:`rlflow.config.verl.plan`; this path is the same module, kept for old imports
(deprecated: it warns)."""

import sys
import warnings

from rlflow.config.verl import plan as _moved

warnings.warn("rlflow.config.plan is now rlflow.config.verl.plan; import it from there", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
