"""Moved to :mod:`rlflow.config.verl.resolve`; this path is the same module, kept for old imports
(deprecated: it warns)."""

import sys
import warnings

from rlflow.config.verl import resolve as _moved

warnings.warn("rlflow.config.resolve is now rlflow.config.verl.resolve; import it from there", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
