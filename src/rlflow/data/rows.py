"""Rows of a prompt dataset: read from parquet / json / jsonl files or in-memory dicts, and normalised.

A row is normalised to ``prompt`` (a string or chat messages), ``ground_truth``, ``data_source``,
``extra_info`` and ``index`` (plus ``images`` / ``videos`` / ``agent_name`` when it has them); verl's layout
(``reward_model.ground_truth``) is read as is. A malformed file or row is a :class:`DataError` naming the
file and the row. A leaf of :mod:`rlflow.data`: :mod:`~rlflow.data.multimodal` and
:mod:`~rlflow.data.prompts` (which tokenizes the rows into batches) both build on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from rlflow.data import keys as K
from rlflow.data.nontensor import stack


class DataError(ValueError):
    """A malformed file or row; the message names the file and the row."""


def load_rows(source: str | Path | Sequence[dict], prompt_key: str = "prompt",
              image_key: str = "images", data_source_key: str = "data_source") -> tuple[list[dict], str]:
    """Read rows from a parquet file (with pyarrow), a json/jsonl file (with ``datasets``), a list of such files, or a list of dicts.

    Returns the normalised rows and a name for error messages; ``data_source_key`` names the column read as
    each row's ``data_source`` (verl's ``data.reward_fn_key``).
    """
    if isinstance(source, (list, tuple)) and source and all(isinstance(s, (str, Path)) for s in source):
        # several files: rows in order, one name
        parts = [load_rows(s, prompt_key, image_key, data_source_key) for s in source]
        rows = [dict(r, index=i) for i, r in enumerate(r for part, _ in parts for r in part)]
        return rows, " + ".join(name for _, name in parts)
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if not path.exists():
            raise DataError(f"data file not found: {path}")
        kind = {".parquet": "parquet", ".json": "json", ".jsonl": "json"}.get(path.suffix)
        if kind is None:
            raise DataError(f"{path}: unsupported file type '{path.suffix}' (use .parquet, .json or .jsonl)")
        if path.stat().st_size == 0:
            raise DataError(f"{path}: the file is empty")
        try:
            raw, name = (read_parquet(path) if kind == "parquet" else read_json(path)), str(path)
        except Exception as e:  # noqa: BLE001 - pyarrow/json errors of every kind: name the file
            cause = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            raise DataError(f"{path}: cannot be read as {kind} ({type(e).__name__}: {cause})") from e
    else:
        raw, name = list(source), "<in-memory rows>"
    return [normalise_row(r, i, name, prompt_key, image_key, data_source_key) for i, r in enumerate(raw)], name


def read_parquet(path: Path) -> list[dict]:
    """A parquet file's rows, read with pyarrow: the rows ``datasets.load_dataset("parquet", ...).to_list()``
    gives (``datasets`` reads them with pyarrow too; its features, images included, are stored as arrow types),
    without importing ``datasets`` and pandas (~0.5 CPU s in each process that reads data) or writing its cache.
    ``ParquetFile`` reads the one file (``pq.read_table`` goes through ``pyarrow.dataset``, which imports pandas)."""
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as file:
        return file.read().to_pylist()


def read_json(path: Path) -> list[dict]:
    """A json / jsonl file's rows, read by ``datasets`` (its type inference across rows)."""
    import datasets

    with datasets_bars_off(datasets):  # reading a local file takes a blink: no "Generating train split" bars
        return datasets.load_dataset("json", data_files=str(path), split="train").to_list()


@contextlib.contextmanager
def datasets_bars_off(datasets) -> Iterator[None]:
    """``datasets``' progress bars off for the block (restored after, as the caller had them)."""
    was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            datasets.enable_progress_bars()


def normalise_row(row: dict, index: int, name: str, prompt_key: str = "prompt", image_key: str = "images",
                  data_source_key: str = "data_source") -> dict:
    if not isinstance(row, dict) or prompt_key not in row or row[prompt_key] is None:
        raise DataError(f"{name}, row {index}: no '{prompt_key}' column (row: {str(row)[:200]})")
    prompt = row[prompt_key]
    if not isinstance(prompt, str):
        try:
            prompt = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
        except (TypeError, KeyError) as e:
            raise DataError(f"{name}, row {index}: '{prompt_key}' must be a string or chat messages "
                            f"[{{'role': ..., 'content': ...}}] ({e!r})") from e
    if not prompt or (isinstance(prompt, str) and not prompt.strip()):
        raise DataError(f"{name}, row {index}: '{prompt_key}' is empty")
    reward_model = row.get("reward_model") or {}
    if not isinstance(reward_model, dict):
        raise DataError(f"{name}, row {index}: 'reward_model' must be a mapping with a 'ground_truth' "
                        f"(got {type(reward_model).__name__})")
    ground_truth = row.get("ground_truth", reward_model.get("ground_truth"))
    if data_source_key != "data_source" and data_source_key not in row:  # chosen by the user: it must be there
        raise DataError(f"{name}, row {index}: no '{data_source_key}' column to read the data source from "
                        f"(data_source_key / verl's data.reward_fn_key; columns: {', '.join(map(str, row))})")
    if isinstance(ground_truth, float) and ground_truth != ground_truth:  # NaN: pandas' missing value
        ground_truth = None
    out = {
        "prompt": prompt,
        "ground_truth": None if ground_truth is None else str(ground_truth),
        "data_source": str(row.get(data_source_key) or "unknown"),
        "extra_info": row.get("extra_info"),
        "index": index,
    }
    agent = row.get(K.AGENT_NAME)
    if isinstance(agent, float) and agent != agent:  # NaN: pandas' missing value
        agent = None
    if agent is not None and (not isinstance(agent, str) or not agent):
        raise DataError(f"{name}, row {index}: '{K.AGENT_NAME}' must name an agent loop (a string), got {agent!r}")
    media = {"images": row.get(image_key), "videos": row.get("videos")}  # read by rlflow.data.multimodal
    return out | {k: v for k, v in media.items() if v is not None} | ({K.AGENT_NAME: agent} if agent else {})


def agent_name_column(rows: Sequence[dict]) -> dict:
    """``{agent_name: the rows' names}`` for a batch when a row names its agent loop (``None`` for the others,
    which run with the default loop); ``{}`` when none does."""
    if not any(K.AGENT_NAME in r for r in rows):
        return {}
    return {K.AGENT_NAME: stack([r.get(K.AGENT_NAME) for r in rows])}
