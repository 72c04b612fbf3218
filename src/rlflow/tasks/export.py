"""Deprecated: this module is now :mod:`rlflow.tasks.prepare` (it prepares task files; ``export`` meant three things).

``from rlflow.tasks import export`` and ``python -m rlflow.tasks.export OUT`` keep working, with a warning.
"""

from __future__ import annotations

import warnings

from rlflow.tasks.prepare import CHAT_TEMPLATE, TASKS, export_task, main, verl_rows  # noqa: F401

warnings.warn("rlflow.tasks.export is now rlflow.tasks.prepare; import it from there", DeprecationWarning,
              stacklevel=2)

if __name__ == "__main__":
    raise SystemExit(main())
