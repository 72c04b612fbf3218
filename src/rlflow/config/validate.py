"""Moved to :mod:`rlflow.config.verl.validate`; this path is the same module, kept for old imports
(deprecated: it warns)."""

import sys
import warnings

from rlflow.config.verl import validate as _moved

warnings.warn("rlflow.config.validate is now rlflow.config.verl.validate; import it from there", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
