"""Moved to :mod:`rlflow.config.verl.loading`; this path is the same module, kept for old imports
(deprecated: it warns)."""

import sys
import warnings

from rlflow.config.verl import loading as _moved

warnings.warn("rlflow.config.loading is now rlflow.config.verl.loading; import it from there", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
