"""verl's entry point under rlflow's name: ``python -m rlflow.trainer.main_ppo key=value ...``.

Takes verl's commands, configs (``--config-path/--config-name``) and data unchanged; see
``docs/verl-compat.md`` for how each key maps onto rlflow's objects. ``--dry-run`` validates the
config and data, prints the resolved config, the batch arithmetic and a cost estimate, and stops.
"""

from __future__ import annotations

import sys

from rlflow.config.verl.run import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
