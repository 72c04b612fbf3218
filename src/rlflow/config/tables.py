"""Moved to :mod:`rlflow.config.verl.tables`; this path is the same module, kept for old imports."""

import sys

from rlflow.config.verl import tables as _moved

sys.modules[__name__] = _moved
