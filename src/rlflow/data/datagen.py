"""Training prompts generated during the run (verl's dynamic data generation, ``data.datagen.*``).

A :class:`DataGenerator` is given the current training rows after every training step and returns new rows
(``generate(rows) -> list[dict]``, in the data files' layout: ``prompt``, ``reward_model.ground_truth``,
``data_source``, ``extra_info``; images with a vision-language processor). The new rows pass the checks loaded
rows pass (:func:`accepted_rows`): a malformed row stops the run naming the generator and the row; a row without a
ground truth, with a bad image or over ``max_prompt_length`` is handled as ``missing_ground_truth``,
``skip_bad_images`` and ``filter_overlong_prompts`` handle loaded ones, and each one dropped is counted
(``PromptData.generated_dropped``) and logged. Accepted rows wait, and join the training rows at the start of the
next epoch, so that the current epoch's order is unchanged; checkpoints hold them (``PromptLoader.state_dict``).
"""

from __future__ import annotations

import logging

from rlflow.data.multimodal import check_images
from rlflow.data.rows import DataError, normalise_row

log = logging.getLogger(__name__)


class DataGenerator:
    """Makes new training rows from the current ones; ``config``: what the generator was configured with (verl
    passes the ``data.datagen`` node)."""

    def __init__(self, config: dict | None = None):
        self.config = config

    def generate(self, rows: list[dict]) -> list[dict]:
        """New rows (the data files' layout), given copies of the current training rows (normalised: ``prompt``,
        ``ground_truth``, ``data_source``, ``extra_info``, ``index``)."""
        raise NotImplementedError(f"{type(self).__name__}.generate(rows) -> list[dict]")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def accepted_rows(data, raw, first_index: int, tokenizer) -> tuple[list[dict], dict[str, int]]:
    """``raw`` (a generator's rows) read and checked as ``data`` (a :class:`~rlflow.data.prompts.PromptData`)
    reads its files, numbered from ``first_index``; returns the rows kept and the count dropped per reason."""
    name = f"{type(data.datagen).__name__}.generate"
    if not isinstance(raw, (list, tuple)):
        raise DataError(f"{name} returned {type(raw).__name__}, not a list of row dicts")
    prompt_key, image_key, source_key = data.row_keys
    rows = [normalise_row(r, first_index + i, name, prompt_key, image_key, source_key) for i, r in enumerate(raw)]
    dropped = {"missing_ground_truth": 0, "bad_images": 0, "overlong": 0}
    missing = [r for r in rows if r["ground_truth"] is None]
    if missing and data.missing_ground_truth == "error":
        raise DataError(f"{name}, row {missing[0]['index']}: no ground truth ('reward_model.ground_truth'); "
                        "missing_ground_truth='skip' drops and counts such rows, 'allow' keeps them")
    if data.missing_ground_truth == "skip":
        rows, dropped["missing_ground_truth"] = [r for r in rows if r["ground_truth"] is not None], len(missing)
    if data.processor is not None:
        rows, dropped["bad_images"] = check_images(rows, name, data.skip_bad_images)
    elif any(r.get("images") or r.get("videos") for r in rows):
        raise DataError(f"{name}: rows with images but the data has no processor (not a vision-language model)")
    if data.filter_overlong_prompts and data.max_prompt_length is not None:
        kept = [r for r in rows if data.prompt_length(r, tokenizer) <= data.max_prompt_length]
        rows, dropped["overlong"] = kept, len(rows) - len(kept)
    if any(dropped.values()):
        log.warning("%s: %d row(s) kept, dropped %s", name, len(rows), dropped)
    return rows, dropped
