"""verl's user-code and column keys of ``data.*`` -> PromptData's rows and arguments.

- ``data.reward_fn_key``: the column read as each row's ``data_source`` (``PromptData(data_source_key=...)``).
- ``data.custom_cls.path`` / ``.name``: a dataset class loaded from a file (or ``pkg://module``), as verl's
  ``load_extern_object``, and made as verl makes it: ``cls(data_files=, tokenizer=, processor=, config=<the data
  node>, max_samples=)``; it must subclass ``torch.utils.data.Dataset``. rlflow takes its rows, ``ds[i]`` for
  ``i < len(ds)``: the prompt (``data.prompt_key``, else verl's ``raw_prompt``), ``reward_model.ground_truth``,
  ``data_source``, ``extra_info`` and the images, and tokenizes the prompt itself; tensors an item carries
  (``input_ids``, ...) are not used (a note says so).
- ``data.sampler.class_path`` / ``.class_name``: verl's custom sampler, ``cls(data_source=<the training rows>,
  data_config=<the data node>)``, yielding row indices; one with ``update(batch)`` (verl's
  ``AbstractCurriculumSampler``) is called after every step (``PromptData(sampler=...)``).
- ``data.datagen.path`` / ``.name``: verl's dynamic data generation, a ``DataGenerator`` class
  (``rlflow.data.datagen``) made as verl makes its generator, ``cls(<the data.datagen node>)``; its
  ``generate(rows)`` adds training rows after every step (``PromptData(datagen=...)``). A class written against
  verl's ``AbstractDataGenerator`` (a verl base, a ``generate(dataset)`` returning a ``datasets.Dataset``) is
  refused naming the file, the class and the change.
"""

from __future__ import annotations

import ast
from typing import Any

from omegaconf import OmegaConf

from rlflow.config.verl.loading import ConfigError, VerlConfig
from rlflow.config.verl.user_classes import load_user_class
from rlflow.registry import load_object

DATAGEN_HOW = ("subclass rlflow.data.datagen.DataGenerator and override generate(self, rows) -> list[dict] (rows: the "
               "current training rows as dicts; return new rows in the data files' layout, docs/data.md#generated-rows)")
TENSOR_FIELDS = ("input_ids", "attention_mask", "position_ids", "raw_prompt_ids")


def verl_location(path: str) -> str:
    """verl's ``file://x.py`` / ``pkg://a.b`` / ``pkg://a/b`` spellings -> rlflow's file path / module name."""
    if path.startswith("file://"):
        return path[len("file://"):]
    if path.startswith("pkg://"):
        return path[len("pkg://"):].replace("/", ".")
    return path


def user_class(cfg: VerlConfig, path_key: str, name_key: str) -> type | None:
    """The class that ``path_key`` / ``name_key`` name (None when the path is unset); a bad one is an error
    naming the key."""
    path, name = cfg[path_key], cfg[name_key]
    if not path:
        return None
    if not name:
        raise ConfigError(f"{path_key}={path!r} needs {name_key} (the class to take from it)")
    try:
        cls = load_object(verl_location(str(path)), str(name), where=f"{path_key}={path!r}")
    except LookupError as e:
        raise ConfigError(str(e)) from None
    if not isinstance(cls, type):
        raise ConfigError(f"{name_key}={name!r}: {path} defines it, but it is a {type(cls).__name__}, not a class")
    return cls


def data_node(cfg: VerlConfig):
    """The ``data`` section as the OmegaConf node verl hands to dataset and sampler classes."""
    return OmegaConf.create(cfg.tree["data"])


def dataset_class(cfg: VerlConfig, notes: list[str]) -> type | None:
    """``data.custom_cls``'s class, checked as verl checks it (a ``torch.utils.data.Dataset``)."""
    from torch.utils.data import Dataset

    cls = user_class(cfg, "data.custom_cls.path", "data.custom_cls.name")
    if cls is None:
        return None
    if not issubclass(cls, Dataset):
        raise ConfigError(f"data.custom_cls.name={cls.__name__!r} from {cfg['data.custom_cls.path']}: must subclass "
                          "torch.utils.data.Dataset (as verl requires)")
    notes.append(f"data.custom_cls: the rows come from {cls.__name__}(...)[i]; rlflow reads each item's prompt "
                 f"({cfg['data.prompt_key']!r} or 'raw_prompt'), reward_model, data_source and extra_info and "
                 "tokenizes the prompt itself (tensors the items carry are not used)")
    return cls


def dataset_rows(cls: type, files: Any, split: str, tokenizer, processor, config, max_samples: int) -> list[dict]:
    """The rows of ``cls`` made on ``files`` as verl makes it: its items as dicts, with verl's ``raw_prompt``
    (chat messages) as the ``prompt`` column when the item has no column of that name."""
    key = "data.train_files" if split == "train" else "data.val_files"
    files = list(files) if isinstance(files, (list, tuple)) else [files]
    try:
        dataset = cls(data_files=files, tokenizer=tokenizer, processor=processor, config=config,
                      max_samples=max_samples)
    except Exception as e:  # noqa: BLE001 - the user's class: name it, the files and what it raised
        raise ConfigError(f"data.custom_cls.name={cls.__name__!r} on {key}={files}: {type(e).__name__}: {e}") from e
    rows = []
    prompt_key = config.get("prompt_key", "prompt")
    for i in range(len(dataset)):
        item = dataset[i]
        if not isinstance(item, dict):
            raise ConfigError(f"data.custom_cls.name={cls.__name__!r}: item {i} of {key} is a "
                              f"{type(item).__name__}, not a dict of columns (verl's dataset items are dicts)")
        row = {k: plain(v) for k, v in item.items() if k not in TENSOR_FIELDS}
        if prompt_key not in row and "raw_prompt" in row:
            row[prompt_key] = row["raw_prompt"]
        rows.append(row)
    return rows


def plain(value: Any) -> Any:
    """numpy arrays (what pandas gives for list columns: messages, images) as lists, inside dicts and lists too."""
    if hasattr(value, "tolist") and getattr(value, "ndim", 0) > 0 and getattr(value, "dtype", None) == object:
        value = list(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def sampler_factory(cfg: VerlConfig, processes: int):
    """``data.sampler``'s class as PromptData's ``sampler`` (``rows -> cls(data_source=rows, data_config=...)``),
    or None when unset."""
    cls = user_class(cfg, "data.sampler.class_path", "data.sampler.class_name")
    if cls is None:
        return None
    if processes > 1 and hasattr(cls, "update"):
        raise ConfigError(f"data.sampler.class_name={cls.__name__!r} is a curriculum sampler (it has update()) and "
                          f"the run has {processes} processes: each would update from its own share of the batch and "
                          "draw different prompts; run it on one process")
    config = data_node(cfg)

    def make(rows: list[dict]):
        try:
            return cls(data_source=rows, data_config=config)
        except Exception as e:  # noqa: BLE001 - the user's class
            raise ConfigError(f"data.sampler.class_name={cls.__name__!r}: {type(e).__name__}: {e}") from e

    make.__qualname__ = cls.__name__
    return make


def data_source_key(cfg: VerlConfig, notes: list[str]) -> dict:
    """``data.reward_fn_key`` -> PromptData's ``data_source_key`` (only when it is not verl's default)."""
    key = cfg["data.reward_fn_key"]
    if not isinstance(key, str) or not key:
        raise ConfigError(f"data.reward_fn_key={key!r}: must be the name of a column of the data files")
    if key == "data_source":
        return {}
    notes.append(f"data.reward_fn_key={key}: each row's {key!r} column is its data_source, for the reward (as verl "
                 "before 0.9 passed it to the reward manager; verl 0.9's reward loop reads 'data_source' whatever it "
                 "is) and for the per-source validation metrics (verl groups those by the 'data_source' column)")
    return {"data_source_key": key}


def _verl_generator_methods(method) -> list[str]:
    returns = ast.unparse(method.returns) if method.returns is not None else ""
    return [f"its generate returns a {returns}"] if method.name == "generate" and "Dataset" in returns else []


def data_generator(cfg: VerlConfig, processes: int):
    """``data.datagen``'s class, built as verl builds it (``cls(<the data.datagen node>)``); None when unset."""
    path, name = cfg["data.datagen.path"], cfg["data.datagen.name"]
    if not path:
        return None
    if not name or not str(name).isidentifier():
        raise ConfigError(f"data.datagen.name={name!r}: the class name in data.datagen.path={path!r}")
    if processes > 1:
        raise ConfigError(f"data.datagen.path={path!r} with {processes} processes: each process would add its own rows "
                          "to its own copy of the data; run it on one process")
    if cfg["data.sampler.class_path"]:
        raise ConfigError("data.datagen.path and data.sampler.class_path: the sampler is built once over the loaded "
                          "rows and would never draw the generated ones; use one of them")
    cls = load_user_class("data generator", "rlflow.data.datagen:DataGenerator", verl_location(str(path)), str(name),
                          f"data.datagen.path={path!r}", "AbstractDataGenerator interface", DATAGEN_HOW,
                          _verl_generator_methods)
    try:
        return cls(OmegaConf.to_container(OmegaConf.create(cfg.tree["data"]["datagen"])))
    except Exception as e:  # noqa: BLE001 - the user's class
        raise ConfigError(f"data.datagen.name={name!r}: {name}(config) failed: {type(e).__name__}: {e}") from e
