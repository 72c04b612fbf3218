"""Moved to :mod:`rlflow.config.verl.native`; this path is the same module, kept for old imports
(deprecated: it warns)."""

import sys
import warnings

from rlflow.config.verl import native as _moved

warnings.warn("rlflow.config.native is now rlflow.config.verl.native; import it from there", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
