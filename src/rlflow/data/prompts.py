"""Prompt datasets: verl-style parquet files or in-memory rows, tokenized into left-padded batches.

Rows are read and normalised by :mod:`rlflow.data.rows` (``prompt``, ``ground_truth``, ``data_source``,
``extra_info``; ``DataError`` and ``load_rows`` are importable from here too); vision-language rows are
collated by :mod:`rlflow.data.multimodal`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice

import torch
from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.data.datagen import DataGenerator, accepted_rows
from rlflow.data.multimodal import check_images, collate_multimodal, prompt_length
from rlflow.data.nontensor import stack
from rlflow.data.rows import (DataError, agent_name_column, datasets_bars_off, load_rows,  # noqa: F401  (here before)
                              normalise_row)

TRUNCATION_MODES = ("error", "left", "right", "middle")
MISSING_GROUND_TRUTH = ("error", "skip", "allow")  # PromptData(missing_ground_truth=...)


def drop_missing_ground_truth(rows: list[dict], name: str, mode: str) -> tuple[list[dict], int]:
    """Rows without a ground truth: an error naming the first (``"error"``), dropped and counted
    (``"skip"``), or kept with ``None`` (``"allow"``, for rewards that need none). Returns (rows, dropped)."""
    missing = [r for r in rows if r["ground_truth"] is None]
    if not missing or mode == "allow":
        return rows, 0
    if mode == "error":
        raise DataError(
            f"{name}, row {missing[0]['index']}: no ground truth (column 'reward_model.ground_truth', or "
            f"'ground_truth'); {len(missing)} of {len(rows)} rows lack one. Add it, or drop and count such rows "
            "with missing_ground_truth='skip' (verl entry point: data.missing_ground_truth=skip), or keep them "
            "with 'allow' when the reward needs no ground truth")
    kept = [r for r in rows if r["ground_truth"] is not None]
    if not kept:
        raise DataError(f"{name}: every row lacks a ground truth ('reward_model.ground_truth')")
    return kept, len(missing)


def render_prompt(prompt: str | list[dict], tokenizer, template_kwargs: dict | None = None) -> str:
    """Chat messages go through the tokenizer's chat template (see :func:`check_chat_template`), with
    ``template_kwargs`` as more ``apply_chat_template`` arguments (e.g. ``{"enable_thinking": False}``)."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, **(template_kwargs or {}))


def check_chat_template(rows: Sequence[dict], name: str, tokenizer) -> None:
    """Chat-message prompts need the tokenizer's chat template: fail before the first step if it has none."""
    if getattr(tokenizer, "chat_template", None):
        return
    chat = next((r for r in rows if not isinstance(r["prompt"], str)), None)
    if chat is not None:
        source = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(f"{name}, row {chat['index']}: the prompt is chat messages but the tokenizer ({source}) has no "
                        "chat template: set tokenizer.chat_template (verl entry point: "
                        "actor_rollout_ref.model.custom_chat_template), or store prompts as plain strings")


def collate(rows: Sequence[dict], tokenizer, max_prompt_length: int | None = None,
            truncation: str = "error", name: str = "", template_kwargs: dict | None = None) -> TensorDict:
    """Tokenize rows into a batch: left-padded ``prompt_ids``/``prompt_mask`` and the non-tensor fields
    (chat prompts rendered with ``template_kwargs``, see :func:`render_prompt`)."""
    check_chat_template(rows, name, tokenizer)
    texts = [render_prompt(r["prompt"], tokenizer, template_kwargs) for r in rows]
    ids = list(tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else []  # one call for the batch
    if max_prompt_length is not None:
        for i, seq in enumerate(ids):
            if len(seq) > max_prompt_length:
                if truncation == "error":
                    raise DataError(
                        f"{name}, row {rows[i]['index']}: prompt has {len(seq)} tokens > max_prompt_length="
                        f"{max_prompt_length} (set truncation='left' or 'right', or filter long prompts)"
                    )
                half = max_prompt_length // 2  # "middle" keeps both ends, as verl
                ids[i] = {"left": seq[-max_prompt_length:], "right": seq[:max_prompt_length],
                          "middle": seq[:half] + seq[len(seq) - (max_prompt_length - half):]}[truncation]
    P = max(len(s) for s in ids)
    pad = tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (P - len(s)) + s for s in ids], dtype=torch.long)
    prompt_mask = torch.tensor([[0] * (P - len(s)) + [1] * len(s) for s in ids], dtype=torch.long)
    return TensorDict(
        {
            K.PROMPT_IDS: prompt_ids,
            K.PROMPT_MASK: prompt_mask,
            K.PROMPT_TEXT: stack(texts),
            K.RAW_PROMPT: stack([r["prompt"] for r in rows]),  # re-encoded by reward models
            K.GROUND_TRUTH: stack([r["ground_truth"] for r in rows]),
            K.DATA_SOURCE: stack([r["data_source"] for r in rows]),
            K.EXTRA_INFO: stack([r["extra_info"] for r in rows]),
            **agent_name_column(rows),
        },
        batch_size=[len(rows)],
    )


class PromptLoader:
    """Endless, seeded, resumable iteration over prompt batches.

    Each epoch is a permutation drawn from ``seed + epoch``; the position
    (epoch, index) is the whole state, so a resumed run sees exactly the
    batches an uninterrupted run would. A last partial batch is skipped
    (every RL step sees the same number of prompts). Rows a ``datagen``
    generated join at an epoch's start; the state holds them too.
    """

    def __init__(self, data: "PromptData", batch_size: int, tokenizer):
        if batch_size > len(data.train):
            raise DataError(f"batch size {batch_size} > {len(data.train)} training prompts in {data.train_name}")
        self.data, self.batch_size, self.tokenizer = data, batch_size, tokenizer
        self.epoch, self.index = 0, 0
        self._cached_order: tuple = (None, [])
        # a user's sampler (PromptData(sampler=...)): drawn from lazily, as a DataLoader does, so that what its
        # update(batch) learns decides the batches drawn after it
        self.sampler = data.sampler(data.train) if data.sampler is not None else None
        self._draws: Iterator[int] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return len(self.data.train) // self.batch_size

    def _order(self) -> list[int]:
        n, key = len(self.data.train), (self.epoch, len(self.data.train), self.data.seed, self.data.shuffle)
        if self._cached_order[0] != key:  # one permutation per epoch, not one per batch
            g = torch.Generator().manual_seed(self.data.seed + self.epoch)
            self._cached_order = (key, torch.randperm(n, generator=g).tolist() if self.data.shuffle else list(range(n)))
        return self._cached_order[1]

    def __iter__(self) -> Iterator[TensorDict]:
        return self

    def __next__(self) -> TensorDict:
        if self.sampler is not None:
            return self._next_sampled()
        if self.index + self.batch_size > len(self.data.train):
            self.epoch, self.index = self.epoch + 1, 0
            self.data.join_generated()
        order = self._order()[self.index : self.index + self.batch_size]
        self.index += self.batch_size
        return self.data.collate([self.data.train[i] for i in order], self.tokenizer)

    def _next_sampled(self) -> TensorDict:
        """The next ``batch_size`` indices of the user's sampler; a new epoch (a new ``iter(sampler)``) when it
        runs out before a full batch (verl's loader drops the last partial batch too). The batch carries each
        prompt's position in ``data.train`` (``row_index``) for the sampler's ``update(batch)``."""
        if self._draws is None:
            self._draws = iter(self.sampler)
        order = list(islice(self._draws, self.batch_size))
        if len(order) < self.batch_size:
            self.epoch, self.index, self._draws = self.epoch + 1, 0, iter(self.sampler)
            order = list(islice(self._draws, self.batch_size))
            if len(order) < self.batch_size:
                raise DataError(f"{self.data.train_name}: the sampler {type(self.sampler).__name__} yields {len(order)}"
                                f" indices per epoch, fewer than a batch of {self.batch_size}")
        bad = [i for i in order if not isinstance(i, int) or not 0 <= i < len(self.data.train)]
        if bad:
            raise DataError(f"{self.data.train_name}: the sampler {type(self.sampler).__name__} yielded {bad[0]!r}, not "
                            f"a row index in [0, {len(self.data.train)})")
        self.index += self.batch_size
        batch = self.data.collate([self.data.train[i] for i in order], self.tokenizer)
        batch[K.ROW_INDEX] = torch.tensor(order, dtype=torch.long)
        return batch

    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "index": self.index}
        if self.data.datagen is not None:  # the live list: a state kept while batches are ahead saves every row
            state |= {"generated": self.data.generated, "joined": self.data.joined,
                      "generator": self.data.generator_state}
        if hasattr(self.sampler, "state_dict"):
            state["sampler"] = self.sampler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        if "generated" in state:
            self.data.restore_generated(state["generated"], int(state["joined"]), state.get("generator") or {})
        if self.sampler is not None:  # resume: this epoch's draws again, less those already trained on
            if "sampler" in state and hasattr(self.sampler, "load_state_dict"):
                self.sampler.load_state_dict(state["sampler"])
            self._draws = iter(self.sampler)
            for _ in islice(self._draws, self.index):
                pass


def select_rows(rows: list[dict], max_samples: int | None, shuffle: bool, seed: int | None) -> list[dict]:
    """At most ``max_samples`` rows, as verl's ``RLHFDataset`` picks them (``train_max_samples``): with
    ``shuffle``, ``numpy.random.default_rng(seed).choice(len(rows), max_samples, replace=False)`` in that order,
    else the first ``max_samples``; every row when ``max_samples`` is ``None``, <= 0 or not below the count."""
    if not max_samples or max_samples <= 0 or max_samples >= len(rows):
        return rows
    if not shuffle:
        return rows[:max_samples]
    import numpy as np

    rng = np.random.default_rng(*(() if seed is None else (seed,)))
    return [rows[i] for i in rng.choice(len(rows), size=max_samples, replace=False).tolist()]


class PromptData:
    """Training (and optional validation) prompts.

    Args:
        train: a parquet/json/jsonl path or a list of row dicts.
        val: the same, for held-out prompts.
        prompt_key: the column holding the prompt.
        max_prompt_length: longer prompts raise (``truncation="error"``) or are cut on the left/right/middle.
        shuffle, seed: per-epoch seeded shuffling.
        filter_overlong_prompts: drop prompts longer than ``max_prompt_length`` (in tokens, after the chat
            template) before training, and report how many (see :meth:`filter_overlong`).
        missing_ground_truth: rows without ``reward_model.ground_truth`` (or ``ground_truth``): ``"error"``
            (the default) names the file and the first such row; ``"skip"`` drops them and counts them in
            ``skipped``; ``"allow"`` keeps them (``ground_truth=None``) for rewards that need none.
        processor: a vision-language model's processor: rows are read in verl's multimodal layout
            (``rlflow.data.multimodal``: ``image_key`` column, ``<image>`` placeholders) and batches carry
            each row's vision inputs.
        image_key: the column holding each row's images.
        skip_bad_images: drop (and count in ``skipped_images``) rows with a missing or corrupt image instead
            of failing with the file, row and image.
        chat_template_kwargs: more ``apply_chat_template`` arguments for every chat prompt (training,
            validation, length filter; the processor's template too), e.g. ``{"enable_thinking": False}``.
        image_patch_size: resize each image first as verl does (``qwen_vl_utils``' ``smart_resize`` to
            multiples of ``2 x image_patch_size`` pixels, ``rlflow.data.multimodal.patch_resize``); ``None``:
            the processor alone sizes the images.
        train_max_samples, val_max_samples: use at most this many rows of each split (``None``: all), chosen
            as verl does (:func:`select_rows`) before any filtering.
        tool_schemas: OpenAI function schemas rendered into chat prompts (``apply_chat_template(tools=...)``)
            when ``filter_overlong_prompts`` measures them, as an agent loop with these tools renders them.
        mm_processor_kwargs: keyword arguments of every ``processor(...)`` call on a row (vision-language).
        data_source_key: the column read as each row's ``data_source`` (what the reward and the per-source
            validation metrics go by); a row without it is an error naming the row.
        sampler: ``sampler(train_rows) -> iterable of row indices`` (e.g. a ``torch.utils.data.Sampler`` class),
            called once with the final training rows; it decides the order of the training prompts in place of
            ``shuffle``. One with an ``update(batch)`` method (verl's curriculum samplers) is called by the
            Trainer after each step with the step's batch; with ``state_dict`` / ``load_state_dict`` its state is
            saved in checkpoints.
        datagen: a :class:`~rlflow.data.datagen.DataGenerator` (verl's ``data.datagen``): after each training
            step ``datagen.generate(rows)`` returns new rows, checked as loaded rows are (dropped ones counted in
            ``generated_dropped``), which join the training rows at the next epoch's start (``generated``);
            checkpoints hold them, and the generator's ``state_dict()`` when it has one.
    """

    def __init__(self, train, val=None, *, prompt_key: str = "prompt", max_prompt_length: int | None = None,
                 truncation: str = "error", shuffle: bool = True, seed: int = 0,
                 filter_overlong_prompts: bool = False, missing_ground_truth: str = "error", processor=None,
                 image_key: str = "images", skip_bad_images: bool = False, chat_template_kwargs: dict | None = None,
                 image_patch_size: int | None = None,
                 train_max_samples: int | None = None, val_max_samples: int | None = None,
                 tool_schemas: list[dict] | None = None, mm_processor_kwargs: dict | None = None,
                 data_source_key: str = "data_source", sampler: Callable[[list[dict]], Iterable[int]] | None = None,
                 datagen: DataGenerator | None = None):
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation must be one of {TRUNCATION_MODES}, got '{truncation}'")
        if missing_ground_truth not in MISSING_GROUND_TRUTH:
            raise ValueError(f"missing_ground_truth must be one of {MISSING_GROUND_TRUTH}, got '{missing_ground_truth}'")
        self.train, self.train_name = load_rows(train, prompt_key, image_key, data_source_key)
        self.val, self.val_name = load_rows(val, prompt_key, image_key, data_source_key) if val is not None else ([], "")
        if datagen is not None and (sampler is not None or not hasattr(datagen, "generate")):
            raise ValueError(f"datagen={datagen!r}: " + ("a DataGenerator with generate(rows) -> list[dict]" if sampler
                             is None else "with a sampler, which is built once over the loaded rows; use one"))
        self.sampler, self.live_sampler = sampler, None
        self.datagen, self.generated, self.joined, self._tokenizer = datagen, [], 0, None
        self.generator_state: dict = {}  # the datagen's state_dict() after its last call, when it has one
        self.generated_dropped = {"missing_ground_truth": 0, "bad_images": 0, "overlong": 0}
        self.row_keys = (prompt_key, image_key, data_source_key)
        self.missing_ground_truth, self.skip_bad_images = missing_ground_truth, skip_bad_images
        self.train = select_rows(self.train, train_max_samples, shuffle, seed)
        self.val = select_rows(self.val, val_max_samples, shuffle, seed)
        self.tool_schemas, self.mm_processor_kwargs = tool_schemas, dict(mm_processor_kwargs or {})
        self.processor, self.skipped_images = processor, {"train": 0, "val": 0}
        self.chat_template_kwargs, self.image_patch_size = dict(chat_template_kwargs or {}), image_patch_size
        if processor is not None:
            self.train, self.skipped_images["train"] = check_images(self.train, self.train_name, skip_bad_images)
            self.val, self.skipped_images["val"] = check_images(self.val, self.val_name, skip_bad_images)
        elif any("images" in r or "videos" in r for r in self.train + self.val):
            raise DataError(f"{self.train_name}: rows have a '{image_key}' column but no processor was given "
                            "(PromptData(..., processor=policy.processor) for a vision-language model)")
        if not self.train:
            raise DataError(f"{self.train_name}: no rows")
        self.train, dropped_train = drop_missing_ground_truth(self.train, self.train_name, missing_ground_truth)
        self.val, dropped_val = drop_missing_ground_truth(self.val, self.val_name, missing_ground_truth)
        self.skipped = {"train": dropped_train, "val": dropped_val}  # rows without a ground truth, dropped
        self.max_prompt_length, self.truncation = max_prompt_length, truncation
        self.shuffle, self.seed = shuffle, seed
        self.filter_overlong_prompts, self.filtered = filter_overlong_prompts, None

    def filter_overlong(self, tokenizer) -> dict[str, int]:
        """Drop over-long prompts once (when ``filter_overlong_prompts``); returns the count dropped per split.

        First checks that chat-message prompts have a chat template to render them (else a DataError)."""
        templates = self.processor if self.processor is not None else tokenizer  # a VLM's prompts: the processor's
        check_chat_template(self.train, self.train_name, templates)
        check_chat_template(self.val, self.val_name, templates)
        if self.filtered is None:
            self.filtered = {"train": 0, "val": 0}
            if self.filter_overlong_prompts and self.max_prompt_length is not None:
                for split in ("train", "val"):
                    rows = getattr(self, split)
                    kept = [r for r in rows if self.prompt_length(r, tokenizer) <= self.max_prompt_length]
                    self.filtered[split] = len(rows) - len(kept)
                    setattr(self, split, kept)
                if not self.train:
                    raise DataError(f"{self.train_name}: every prompt is longer than "
                                    f"max_prompt_length={self.max_prompt_length}")
        return self.filtered

    def prompt_length(self, row: dict, tokenizer) -> int:
        """Tokens of ``row``'s prompt after the chat template (image tokens included with a processor)."""
        if self.processor is not None:
            return prompt_length(row, self.processor, self.train_name, self.chat_template_kwargs, self.image_patch_size,
                                 self.mm_processor_kwargs)
        prompt = row["prompt"]
        text = (tokenizer.apply_chat_template(prompt, tools=self.tool_schemas, add_generation_prompt=True,
                                              tokenize=False, **self.chat_template_kwargs)
                if self.tool_schemas and not isinstance(prompt, str)
                else render_prompt(prompt, tokenizer, self.chat_template_kwargs))
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    def collate(self, rows: Sequence[dict], tokenizer, name: str | None = None) -> TensorDict:
        if self.processor is not None:
            return collate_multimodal(rows, self.processor, self.max_prompt_length, name or self.train_name,
                                      self.chat_template_kwargs, self.image_patch_size, self.mm_processor_kwargs)
        return collate(rows, tokenizer, self.max_prompt_length, self.truncation, name or self.train_name,
                       self.chat_template_kwargs)

    def loader(self, batch_size: int, tokenizer) -> PromptLoader:
        self.filter_overlong(tokenizer)
        self._tokenizer = tokenizer  # a datagen's rows are measured with it
        loader = PromptLoader(self, batch_size, tokenizer)
        self.live_sampler = loader.sampler
        return loader

    def batch_trained(self, batch: TensorDict) -> None:
        """After a training step on ``batch``: a curriculum sampler (one with ``update``) learns from it, as
        verl's trainer calls ``sampler.update(batch=batch)`` (here ``batch`` is rlflow's TensorDict: scores,
        ``row_index``, ...)."""
        update = getattr(self.live_sampler, "update", None)
        if update is not None:
            update(batch=batch)
        if self.datagen is not None:
            first = len(self.train) - self.joined + len(self.generated)  # the rows' numbers go on from the files'
            rows, dropped = accepted_rows(self, self.datagen.generate([dict(r) for r in self.train]), first,
                                          self._tokenizer)
            self.generated += rows
            if hasattr(self.datagen, "state_dict"):  # updated in place: the loader's states refer to this dict
                self.generator_state.clear()
                self.generator_state.update(self.datagen.state_dict())
            self.generated_dropped = {k: n + dropped[k] for k, n in self.generated_dropped.items()}

    def join_generated(self) -> None:
        """The generated rows not yet trained on join the training rows (an epoch's start: its order is new)."""
        self.train, self.joined = self.train + self.generated[self.joined:], len(self.generated)

    def restore_generated(self, rows: list[dict], joined: int, generator_state: dict) -> None:
        """A checkpoint's generated rows, the first ``joined`` of them among the training rows, and the
        datagen's state (``load_state_dict``, when it has one)."""
        if generator_state and hasattr(self.datagen, "load_state_dict"):
            self.datagen.load_state_dict(generator_state)
            self.generator_state.clear()
            self.generator_state.update(generator_state)
        base = self.train[:len(self.train) - self.joined]
        self.generated[:] = rows  # the same list object: the loader's states refer to it
        self.train, self.joined = base + self.generated[:joined], joined

    def val_batches(self, tokenizer, batch_size: int = 512) -> Iterator[TensorDict]:
        self.filter_overlong(tokenizer)
        for start in range(0, len(self.val), batch_size):
            yield self.collate(self.val[start : start + batch_size], tokenizer, self.val_name)
