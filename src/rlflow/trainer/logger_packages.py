"""What the loggers beyond rlflow's own need installed, and the pip command that installs what is missing (light:
the config checks import it before anything heavy)."""

from __future__ import annotations

import importlib.util

# logger name -> its modules -> the pip packages that install them
LOGGER_PACKAGES = {"wandb": {"wandb": "wandb", "pytorch_lightning": "pytorch-lightning"},  # W&B's is Lightning's
                   "mlflow": {"mlflow": "mlflow-skinny"},  # rlflow[tracing]; the full mlflow package serves too
                   "clearml": {"clearml": "clearml"},
                   "trackio": {"trackio": "trackio"}}  # rlflow[tracing]


def install_command(packages: dict[str, str]) -> str | None:
    """The pip command that installs the packages whose module (``packages``: module -> package) is missing
    here, or None when nothing is missing."""
    missing = [package for module, package in packages.items() if importlib.util.find_spec(module) is None]
    return f"pip install {' '.join(missing)}" if missing else None
