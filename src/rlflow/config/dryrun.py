"""Moved to :mod:`rlflow.config.verl.dryrun`; this path is the same module, kept for old imports
(deprecated: it warns)."""

import sys
import warnings

from rlflow.config.verl import dryrun as _moved

warnings.warn("rlflow.config.dryrun is now rlflow.config.verl.dryrun; import it from there", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
