"""Moved to :mod:`rlflow.config.verl.reward_fn`; this path is the same module, kept for old imports."""

import sys

from rlflow.config.verl import reward_fn as _moved

sys.modules[__name__] = _moved
