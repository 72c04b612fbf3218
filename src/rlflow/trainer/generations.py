"""Samples written out as text: each step's rollouts and each validation's generations (verl's
``trainer.rollout_data_dir`` / ``validation_data_dir``), and a few validation samples in the loggers
(verl's ``trainer.log_val_generations``).

Two callbacks; the verl entry point adds them when those keys are set, a Python user passes them in
``Trainer(callbacks=[...])``:

- :class:`DumpGenerations` writes ``<dir>/<global_step>.jsonl``, one JSON object per sample with verl's
  fields: ``input`` (the prompt's tokens decoded without special tokens), ``output`` (the response, the same
  way), ``gts`` (the ground truth), ``score`` (the reward's score, before any KL penalty), ``step``, then the
  reward's extra columns (for validation ``reward`` first, as verl's). Under dynamic sampling
  (``reward=None``) a step's rows come from several scoring rounds, so the extras are left out there.
- :class:`LogValidationGenerations` picks ``n`` validation samples as verl does (sorted by input, shuffled
  with ``numpy.random.RandomState(42)``, the first ``n``: the same prompts every validation) and logs them:
  a ``val/generations`` table in W&B, a text entry in TensorBoard, lines on the console logger, and always
  ``<run_dir>/val_generations.jsonl`` (one object per sample: ``step``, ``input``, ``output``, ``score``).

With several processes the samples of every rank are gathered and rank 0 writes.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlflow.data import keys as K
from rlflow.data.nontensor import column
from rlflow.roles import Reward, optional
from rlflow.trainer.distributed import gather_objects

BASE = ("input", "output", "gts", "score")


def wants(trainer, hook: str) -> bool:
    """Whether any callback of the trainer has ``hook`` (so work only it needs can be skipped)."""
    return any(callable(getattr(cb, hook, None)) for cb in getattr(trainer.fabric, "_callbacks", ()))


def batch_columns(batch, tokenizer, extras: dict | None = None) -> dict[str, list]:
    """verl's columns of a scored batch: input, output, gts, score, then ``extras`` (each a list per row)."""
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(batch[K.PROMPT_IDS].cpu(), batch[K.PROMPT_MASK].cpu())]
    if K.RESPONSE_TEXT in batch.keys():
        outputs = [str(t) for t in column(batch, K.RESPONSE_TEXT)]
    else:
        outputs = tokenizer.batch_decode(batch[K.RESPONSE_IDS].cpu(), skip_special_tokens=True)
    n = len(prompts)
    truths = column(batch, K.GROUND_TRUTH) if K.GROUND_TRUTH in batch.keys() else [None] * n
    out = {"input": tokenizer.batch_decode(prompts, skip_special_tokens=True), "output": outputs,
           "gts": list(truths), "score": batch[K.SCORES].tolist()}
    for key, values in (extras or {}).items():
        values = values.tolist() if hasattr(values, "tolist") else list(values)
        if len(values) == n:  # verl's rule: only complete columns
            out.setdefault(key, values)
    return out


def concat(parts: list[dict[str, list]]) -> dict[str, list]:
    """Columns of several shards, row after row; a column missing from a shard is filled with ``None``."""
    names = list(dict.fromkeys(k for p in parts for k in p))
    out: dict[str, list] = {k: [] for k in names}
    for p in parts:
        rows = len(p.get("input", ()))
        for k in names:
            out[k].extend(p.get(k, [None] * rows))
    return out


def write_generations(folder: str | Path, step: int, columns: dict[str, list]) -> Path:
    """``<folder>/<step>.jsonl`` in verl's layout (``_dump_generations``): input, output, gts, score, step,
    then the other columns."""
    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    n = len(columns["input"])
    data = {k: columns[k] for k in BASE} | {"step": [step] * n}
    data |= {k: v for k, v in columns.items() if k not in BASE and len(v) == n}
    path = folder / f"{step}.jsonl"
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for i in range(n):
            f.write(json.dumps({k: v[i] for k, v in data.items()}, ensure_ascii=False, default=str) + "\n")
    tmp.replace(path)  # a resumed run writes the step again: the file is replaced whole
    return path


def pick_samples(inputs: list, outputs: list, scores: list, n: int) -> list[tuple]:
    """verl's ``_maybe_log_val_generations``: (input, output, score) sorted by input, shuffled with a fixed
    seed (42), the first ``n``. Uses its own RandomState: the run's random streams are untouched."""
    import numpy as np

    samples = sorted(zip(inputs, outputs, scores), key=lambda s: s[0])
    np.random.RandomState(42).shuffle(samples)
    return samples[:n]


class DumpGenerations:
    """Write each step's rollouts to ``rollout_dir`` and each validation's generations to ``validation_dir``
    as ``<global_step>.jsonl`` (either may be ``None``); see the module docstring for the fields."""

    def __init__(self, rollout_dir: str | Path | None = None, validation_dir: str | Path | None = None):
        if rollout_dir is None and validation_dir is None:
            raise ValueError("DumpGenerations needs rollout_dir or validation_dir")
        self.rollout_dir, self.validation_dir = rollout_dir, validation_dir
        if rollout_dir is None:  # no training hook: the step does not decode what nobody writes
            self.on_batch_end = None

    def __repr__(self) -> str:
        return f"DumpGenerations(rollout_dir={self.rollout_dir!r}, validation_dir={self.validation_dir!r})"

    def on_batch_end(self, trainer, batch) -> None:
        extras = optional(trainer.reward, Reward, "extras") if trainer.reward is not None else {}
        mine = batch_columns(batch, trainer.policy.tokenizer, extras)
        # a sequence-parallel group holds one batch on all its ranks: its first rank speaks for it
        shards = gather_objects(trainer.fabric, mine if trainer.fabric.global_rank % trainer.sp_size == 0 else None)
        if trainer.fabric.global_rank == 0:
            write_generations(self.rollout_dir, trainer.global_step, concat([s for s in shards if s is not None]))

    def on_validation_generations(self, trainer, samples: dict[str, list]) -> None:
        if self.validation_dir is not None and trainer.fabric.global_rank == 0:
            write_generations(self.validation_dir, trainer.global_step, samples)


class LogValidationGenerations:
    """Log ``n`` validation samples (chosen as verl does) to the loggers and ``<run_dir>/val_generations.jsonl``."""

    FILE = "val_generations.jsonl"

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"LogValidationGenerations: n must be >= 1, got {n}")
        self.n, self.table_rows = n, []

    def __repr__(self) -> str:
        return f"LogValidationGenerations({self.n})"

    def on_fit_start(self, trainer) -> None:
        """A resumed run validates the steps after its checkpoint again: their old lines go."""
        path = Path(trainer.run_dir) / self.FILE
        if trainer.fabric.global_rank == 0 and path.exists():
            kept = [line for line in path.read_text().splitlines(keepends=True)
                    if line.strip() and json.loads(line)["step"] <= trainer.global_step]
            path.write_text("".join(kept))

    def on_validation_generations(self, trainer, samples: dict[str, list]) -> None:
        if trainer.fabric.global_rank:
            return
        step, picked = trainer.global_step, pick_samples(samples["input"], samples["output"], samples["score"], self.n)
        path = Path(trainer.run_dir) / self.FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            for inp, out, score in picked:
                f.write(json.dumps({"step": step, "input": inp, "output": out, "score": score}, ensure_ascii=False,
                                   default=str) + "\n")
        self.table_rows.append([step] + [x for s in picked for x in s])
        for logger in trainer.fabric.loggers:
            self._to_logger(logger, step, picked)

    def _to_logger(self, logger, step: int, picked: list[tuple]) -> None:
        kind = type(logger).__name__
        if kind == "WandbLogger":  # verl's table: one row per validation, input_i / output_i / score_i columns
            columns = ["step"] + [f"{c}_{i + 1}" for i in range(len(picked)) for c in ("input", "output", "score")]
            logger.log_table("val/generations", columns=columns,
                             data=[r for r in self.table_rows if len(r) == len(columns)], step=step)
        elif kind == "TensorBoardLogger":
            text = f"**Generation Results - Step {step}**\n\n" + "".join(
                f"### Sample {i + 1}\n**Input:** {inp}\n\n**Output:** {out}\n\n**Score:** {score}\n\n---\n\n"
                for i, (inp, out, score) in enumerate(picked))
            logger.experiment.add_text("val/generations", text, step)
            logger.experiment.flush()
        elif kind == "MLflowLogger":  # verl's artifact: val_step{N}.json, a list of {input, output, score}
            logger.log_generations(step, picked)
        elif kind == "ConsoleLogger":
            for i, (inp, out, score) in enumerate(picked):
                print(f"[val/generations step:{step} sample {i + 1}] score:{score} input:{inp!r} output:{out!r}",
                      flush=True)
