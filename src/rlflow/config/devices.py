"""Moved to :mod:`rlflow.config.verl.devices`; this path is the same module, kept for old imports
(deprecated: it warns)."""

import sys
import warnings

from rlflow.config.verl import devices as _moved

warnings.warn("rlflow.config.devices is now rlflow.config.verl.devices; import it from there", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
