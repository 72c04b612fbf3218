"""Loggers: Lightning's CSV and TensorBoard loggers, a JSONL logger, and W&B when installed."""

from __future__ import annotations

import json
import math
from pathlib import Path

from lightning.fabric.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.fabric.utilities.rank_zero import rank_zero_only

LOGGER_NAMES = ("jsonl", "csv", "tensorboard", "wandb")


class JSONLLogger(Logger):
    """One JSON object per logged step in ``<root_dir>/metrics.jsonl``."""

    def __init__(self, root_dir: str | Path):
        self._root = Path(root_dir)
        self._file = None

    @property
    def name(self) -> str:
        return "jsonl"

    @property
    def version(self) -> str:
        return ""

    @property
    def root_dir(self) -> str:
        return str(self._root)

    @property
    def path(self) -> Path:
        return self._root / "metrics.jsonl"

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self._file is None:
            self._root.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a")
        row = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs) -> None:
        self._root.mkdir(parents=True, exist_ok=True)
        (self._root / "hparams.json").write_text(json.dumps(params, indent=2, default=str))

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def make_loggers(names, run_dir: str | Path, project: str = "rlflow", experiment: str = "run") -> list[Logger]:
    """Build loggers by name; an unknown name or an uninstalled W&B is a clear error."""
    out: list[Logger] = []
    for name in names:
        if name == "jsonl":
            out.append(JSONLLogger(run_dir))
        elif name == "csv":
            out.append(CSVLogger(root_dir=run_dir, name="csv"))  # csv/version_N per launch: a resume never overwrites
        elif name == "tensorboard":
            out.append(TensorBoardLogger(root_dir=run_dir, name="tensorboard", version=""))
        elif name == "wandb":
            try:
                from lightning.pytorch.loggers import WandbLogger
            except ImportError as e:  # pragma: no cover - depends on the environment
                raise ImportError("logger 'wandb' needs `pip install wandb` (or rlflow[wandb])") from e
            out.append(WandbLogger(project=project, name=experiment, save_dir=str(run_dir)))
        elif name == "console":
            continue  # the progress bar and the Trainer's console line do this
        else:
            raise ValueError(f"unknown logger '{name}'; choose from {LOGGER_NAMES + ('console',)}")
    return out
