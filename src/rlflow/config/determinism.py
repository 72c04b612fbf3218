"""Moved to :mod:`rlflow.config.verl.determinism`; this path is the same module, kept for old imports
(deprecated: it warns)."""

import sys
import warnings

from rlflow.config.verl import determinism as _moved

warnings.warn("rlflow.config.determinism is now rlflow.config.verl.determinism; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
