"""Moved to :mod:`rlflow.config.verl.algos`; this path is the same module, kept for old imports."""

import sys

from rlflow.config.verl import algos as _moved

sys.modules[__name__] = _moved
