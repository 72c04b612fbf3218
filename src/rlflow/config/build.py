"""Moved to :mod:`rlflow.config.verl.build`; this path is the same module, kept for old imports
(deprecated: it warns)."""

import sys
import warnings

from rlflow.config.verl import build as _moved

warnings.warn("rlflow.config.build is now rlflow.config.verl.build; import it from there", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
