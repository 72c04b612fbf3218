"""Moved to :mod:`rlflow.config.verl.build`; this path is the same module, kept for old imports."""

import sys

from rlflow.config.verl import build as _moved

sys.modules[__name__] = _moved
