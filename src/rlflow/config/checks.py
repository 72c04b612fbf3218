"""Moved to :mod:`rlflow.config.verl.checks`; this path is the same module, kept for old imports
(deprecated: it warns)."""

import sys
import warnings

from rlflow.config.verl import checks as _moved

warnings.warn("rlflow.config.checks is now rlflow.config.verl.checks; import it from there", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
