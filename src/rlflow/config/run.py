"""Moved to :mod:`rlflow.config.verl.run`; this path is the same module, kept for old imports
(deprecated: it warns)."""

import sys
import warnings

from rlflow.config.verl import run as _moved

warnings.warn("rlflow.config.run is now rlflow.config.verl.run; import it from there", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
