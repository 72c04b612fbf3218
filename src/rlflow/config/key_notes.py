"""Moved to :mod:`rlflow.config.verl.key_notes`; this path is the same module, kept for old imports."""

import sys

from rlflow.config.verl import key_notes as _moved

sys.modules[__name__] = _moved
