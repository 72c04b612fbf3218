"""Moved to :mod:`rlflow.config.verl.run`; this path is the same module, kept for old imports."""

import sys

from rlflow.config.verl import run as _moved

sys.modules[__name__] = _moved
