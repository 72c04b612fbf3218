"""Moved to :mod:`rlflow.config.verl.native`; this path is the same module, kept for old imports."""

import sys

from rlflow.config.verl import native as _moved

sys.modules[__name__] = _moved
