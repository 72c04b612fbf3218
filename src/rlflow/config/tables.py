"""Moved to :mod:`rlflow.config.verl.tables`; this path is the same module, kept for old imports
(deprecated: it warns)."""

import sys
import warnings

from rlflow.config.verl import tables as _moved

warnings.warn("rlflow.config.tables is now rlflow.config.verl.tables; import it from there", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
