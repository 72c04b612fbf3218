"""Moved to :mod:`rlflow.config.verl.loading`; this path is the same module, kept for old imports."""

import sys

from rlflow.config.verl import loading as _moved

sys.modules[__name__] = _moved
