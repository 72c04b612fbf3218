"""Loggers: Lightning's CSV and TensorBoard loggers, a JSONL logger, a console logger, and W&B, MLflow, ClearML and
Trackio when installed."""

from __future__ import annotations

import json
import math
import numbers
import pprint
from pathlib import Path

from lightning_fabric.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning_fabric.utilities.rank_zero import rank_zero_only

from rlflow.trainer.clearml_logger import ClearMLLogger
from rlflow.trainer.logger_packages import LOGGER_PACKAGES, install_command
from rlflow.trainer.mlflow_logger import MLflowLogger
from rlflow.trainer.trackio_logger import TrackioLogger

LOGGER_NAMES = ("jsonl", "csv", "tensorboard", "wandb", "mlflow", "clearml", "trackio", "console")


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
    def drop_after(self, step: int) -> None:
        """Forget rows past ``step`` (a resumed run logs those steps again), replacing the file atomically."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines(keepends=True)
                if line.strip() and (json.loads(line).get("step") or 0) <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(self.path)

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs) -> None:
        self._root.mkdir(parents=True, exist_ok=True)
        (self._root / "hparams.json").write_text(json.dumps(params, indent=2, default=str))

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class ConsoleLogger(Logger):
    """verl's console logger: each step's numeric metrics on one line, ``step:N - key:value - ...``."""

    @property
    def name(self) -> str:
        return "console"

    @property
    def version(self) -> str:
        return ""

    @staticmethod
    def format(metrics: dict, step: int | None) -> str:
        parts = [f"step:{step}"] + [f"{k}:{pprint.pformat(v)}" for k, v in metrics.items()
                                    if isinstance(v, numbers.Number)]
        return " - ".join(parts)

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        print(self.format(metrics, step), flush=True)

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def make_loggers(names, run_dir: str | Path, project: str = "rlflow", experiment: str = "run") -> list[Logger]:
    """Build loggers by name (a ``Logger`` instance passes through); an unknown name or an uninstalled
    W&B, MLflow, ClearML or Trackio is a clear error."""
    out: list[Logger] = []
    for name in names:
        if isinstance(name, Logger):
            out.append(name)
        elif name == "jsonl":
            out.append(JSONLLogger(run_dir))
        elif name == "csv":
            out.append(CSVLogger(root_dir=run_dir, name="csv"))  # csv/version_N per launch: a resume never overwrites
        elif name == "tensorboard":
            out.append(TensorBoardLogger(root_dir=run_dir, name="tensorboard", version=""))
        elif name == "wandb":
            try:
                from pytorch_lightning.loggers import WandbLogger  # Lightning's; rlflow itself needs only Fabric
            except ImportError as e:  # pragma: no cover - depends on the environment
                raise ImportError("logger 'wandb' needs `pip install wandb pytorch-lightning` (or rlflow[wandb])") from e
            out.append(WandbLogger(project=project, name=experiment, save_dir=str(run_dir)))
        elif name in ("mlflow", "clearml", "trackio"):
            missing = install_command(LOGGER_PACKAGES[name])
            if missing:
                raise ImportError(f"logger '{name}' needs `{missing}`")
            made = {"mlflow": MLflowLogger, "clearml": ClearMLLogger, "trackio": TrackioLogger}[name]
            out.append(made(run_dir, project=project, experiment=experiment))
        elif name == "console":
            out.append(ConsoleLogger())
        else:
            raise ValueError(f"unknown logger '{name}'; choose from {LOGGER_NAMES}")
    return out
