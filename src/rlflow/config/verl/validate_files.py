"""The environment step of :func:`rlflow.config.verl.validate.validate` (``environment=True``, as the command line
runs it): data files exist and have the prompt column and enough rows, model folders look like models (or are hub
ids), reward functions exist in their files, and what the models' ``config.json`` say fits the config (context
length, a vision model for ``rollout.enable_vision``). Nothing here imports torch or transformers."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from rlflow.config.verl import checks
from rlflow.config.verl.reward_fn import reward_file_problem, split_reward_spec
from rlflow.config.verl.validate_context import Context, positive_int
from rlflow.models.checks import ModelFolderError, check_model_folder
from rlflow.models.hub import ModelNotFoundError, locate_model

R = checks.R
DATA_SUFFIXES = (".parquet", ".json", ".jsonl")
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def check_data_files(ctx: Context, key: str) -> None:
    value = ctx.get(key)
    if value is None or not ctx.ok(key):
        if key == "data.train_files" and value is None:
            ctx.add("data.train_files is not set: give the training prompts (a .parquet, .json or .jsonl file)")
        return
    rows, prompt_key = 0, ctx.get("data.prompt_key")
    for item in value if isinstance(value, list) else [value]:
        path = Path(str(item)).expanduser()
        if not path.is_file():
            ctx.add(f"{key}={str(item)!r}: no such file {path.resolve()}" if not path.exists() else
                    f"{key}={str(item)!r}: {path} is a folder; give the data file(s) in it (.parquet, .json, .jsonl)")
            continue
        if path.suffix not in DATA_SUFFIXES:
            ctx.add(f"{key}={str(item)!r}: unsupported file type '{path.suffix}' (use .parquet, .json or .jsonl)")
            continue
        if path.suffix == ".parquet":
            rows += parquet_rows(ctx, key, path, prompt_key)
    bs = ctx.get("data.train_batch_size")
    if key == "data.train_files" and rows and positive_int(bs) and bs > rows:
        ctx.add(f"data.train_batch_size={bs} > {rows} training prompts in {value}")


def parquet_rows(ctx: Context, key: str, path: Path, prompt_key: str) -> int:
    """Rows of a parquet file, from its footer (no data read); a missing prompt column is a problem."""
    try:
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path)
        columns = meta.schema_arrow.names
    except Exception as e:  # noqa: BLE001 - any unreadable file: say which
        ctx.add(f"{key}: cannot read {path} as parquet ({e})")
        return 0
    if prompt_key not in columns:
        close = difflib.get_close_matches(prompt_key, columns, n=1)
        ctx.add(f"data.prompt_key={prompt_key!r}: {path} has no such column (columns: {', '.join(columns)})"
                + (f"; set data.prompt_key={close[0]}" if close else ""))
    return meta.metadata.num_rows


def check_model(ctx: Context, key: str, tokenizer: bool = True) -> None:
    """A local folder or a hub id (:func:`rlflow.models.hub.locate_model`); a local folder must hold a model
    (:func:`rlflow.models.checks.check_model_folder`); its ``config.json`` is kept for the cross-checks."""
    value = ctx.get(key)
    if not value or not ctx.ok(key):
        ctx.add(f"{key} is not set: give a model folder (or a Hugging Face hub id)")
        return
    try:
        located = locate_model(value, key)
        if located.folder is None:
            return  # a hub id transformers will download: nothing local to look at yet
        check_model_folder(located.folder, tokenizer=tokenizer, weights=not ctx.dry_run)
        ctx.model_configs[key] = json.loads((located.folder / "config.json").read_text())
    except (ModelNotFoundError, ModelFolderError, OSError, ValueError) as e:
        ctx.add(str(e) if str(e).startswith(key) else f"{key}: {e}")


def check_reward_files(ctx: Context) -> None:
    """``custom_reward_function.path``/``.name`` (or ``name: file.py:fn``) and each of ``.functions`` name a
    function that exists, read from the files without running them."""
    crf = "custom_reward_function"
    path, name = split_reward_spec(ctx.get(f"{crf}.path"), ctx.get(f"{crf}.name"))
    items = ctx.cfg.tree.get(crf, {}).get("functions") or []
    specs = [(path, name)] if path and not items else []
    for item in items if isinstance(items, list) else []:
        if isinstance(item, str) and ":" in item:
            specs.append(tuple(item.rsplit(":", 1)))
        elif isinstance(item, dict) and item.get("name"):
            specs.append(split_reward_spec(item.get("path") or path, item["name"]))
    for file, fn in specs:  # (a malformed entry is reported by the reward plan, naming it)
        problem = reward_file_problem(file, fn) if file else None
        if problem:
            ctx.add(problem)


def check_position_embeddings(ctx: Context) -> None:
    """``max_prompt_length + max_response_length`` must fit the model's context (from its config.json)."""
    prompt, response = ctx.get("data.max_prompt_length"), ctx.get(f"{R}.response_length")
    if not (positive_int(prompt) and positive_int(response)):
        return
    for key, config in ctx.model_configs.items():
        limit = next((config[k] for k in POSITION_KEYS if isinstance(config.get(k), int)), None)
        if limit is not None and prompt + response > limit:
            ctx.add(f"data.max_prompt_length + data.max_response_length = {prompt} + {response} = {prompt + response} "
                    f"tokens exceeds the model's max_position_embeddings={limit} ({key}={ctx.get(key)!r})")


def check_vision_model(ctx: Context) -> None:
    """``rollout.enable_vision`` needs an image-text-to-text model; a local folder's (or the cache's) config.json
    tells (a vision-language config nests a ``vision_config`` or ``text_config``; a hub id to download is
    checked when it loads)."""
    key = "actor_rollout_ref.model.path"
    config = ctx.model_configs.get(key)
    if ctx.get(f"{R}.enable_vision") and config is not None and not {"vision_config", "text_config"} & set(config):
        ctx.add(f"{R}.enable_vision=True but {key}={ctx.get(key)!r} is a text-only model (its config.json has no "
                f"vision_config; model_type={config.get('model_type')!r}): give an image-text-to-text model "
                f"(Qwen2-VL, Qwen2.5-VL, ...) or set {R}.enable_vision=False")


def check_environment(ctx: Context) -> None:
    for key, kind in checks.PATHS.items():
        if kind == "data":
            check_data_files(ctx, key)
        elif kind == "model":
            check_model(ctx, key)
        elif kind == "critic model" and ctx.with_critic and ctx.set_by_user_or_own(key):
            check_model(ctx, key, tokenizer=False)  # (a critic path that only repeats the actor's is checked there)
        elif kind == "reward model" and ctx.get("reward_model.enable"):
            re_encodes = ctx.get("reward_model.model.input_tokenizer") is not None  # then it needs its own tokenizer
            check_model(ctx, key, tokenizer=re_encodes)
    check_reward_files(ctx)
    check_position_embeddings(ctx)
    check_vision_model(ctx)
