"""Moved to :mod:`rlflow.config.verl.algos`; this path is the same module, kept for old imports
(deprecated: it warns)."""

import sys
import warnings

from rlflow.config.verl import algos as _moved

warnings.warn("rlflow.config.algos is now rlflow.config.verl.algos; import it from there", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
