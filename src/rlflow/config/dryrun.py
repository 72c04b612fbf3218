"""Moved to :mod:`rlflow.config.verl.dryrun`; this path is the same module, kept for old imports."""

import sys

from rlflow.config.verl import dryrun as _moved

sys.modules[__name__] = _moved
