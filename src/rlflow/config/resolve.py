"""Moved to :mod:`rlflow.config.verl.resolve`; this path is the same module, kept for old imports."""

import sys

from rlflow.config.verl import resolve as _moved

sys.modules[__name__] = _moved
