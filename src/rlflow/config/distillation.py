"""Moved to :mod:`rlflow.config.verl.distillation`; this path is the same module, kept for old imports
(deprecated: it warns)."""

import sys
import warnings

from rlflow.config.verl import distillation as _moved

warnings.warn("rlflow.config.distillation is now rlflow.config.verl.distillation; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
