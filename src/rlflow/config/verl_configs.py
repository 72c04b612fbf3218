"""Moved to :mod:`rlflow.config.verl.configs`; this path is the same module, kept for old imports
(deprecated: it warns)."""

import sys
import warnings

from rlflow.config.verl import configs as _moved

warnings.warn("rlflow.config.verl_configs is now rlflow.config.verl.configs; import it from there", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
