"""Moved to :mod:`rlflow.config.verl.key_notes`; this path is the same module, kept for old imports
(deprecated: it warns)."""

import sys
import warnings

from rlflow.config.verl import key_notes as _moved

warnings.warn("rlflow.config.key_notes is now rlflow.config.verl.key_notes; import it from there", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
