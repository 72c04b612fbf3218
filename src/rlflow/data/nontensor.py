"""Non-tensor columns (texts, ground truths, data sources, extra-info dicts) of a batch, read and built fast.

A batch keeps them as ``tensordict.NonTensorStack`` s: one ``NonTensorData`` per row, so that indexing,
splitting and ``repeat_interleave`` carry them with their rows. tensordict's generic paths are slow for
them (a step of the default job spent more time there than in its reward): ``batch[key]`` and
``stack.tolist()`` go through per-row attribute wrappers, ``td.to(device)`` and ``td.clone(False)`` rebuild
every row, and making a ``NonTensorData`` costs tens of microseconds. The helpers here take the short
paths and fall back to tensordict's own calls whenever a column is not the plain one-level stack they know.

Sharing: :func:`stack` gives rows with equal immutable values (``str``, numbers, ``None``, ...) one shared
``NonTensorData``, as ``TensorDict.repeat_interleave`` already does for repeated rows. Assigning into one
row of such a column in place (``batch.get(key)[i] = x``) would change its twins too: replace the column
(``batch.set(key, stack(new_values))``) instead, as rlflow's modules do.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

_IMMUTABLE = (str, bytes, int, float, bool, complex, type(None))


def values(value: Any) -> list[Any]:
    """The Python values of a non-tensor column (``NonTensorStack``), in row order, as a new list.

    One-level stacks of ``NonTensorData`` are read from the rows' stored values directly; anything else
    (nested stacks, a tensor, a plain list) goes through ``tolist()`` / ``list()``.
    """
    if type(value) is NonTensorStack and value.stack_dim == 0:
        try:
            rows = value.tensordicts
            if all(type(row) is NonTensorData for row in rows):
                return [row._non_tensordict["data"] for row in rows]  # what ``row.data`` returns, without its wrapper
        except (AttributeError, KeyError, TypeError):  # another tensordict layout: the generic path below
            pass
    if hasattr(value, "tolist"):
        return value.tolist()
    return list(value)


def column(batch: TensorDict, key: str) -> list[Any]:
    """The ``B`` values of ``batch``'s column ``key`` (non-tensor or tensor) as a plain Python list.

    A single ``NonTensorData`` (one value for the whole batch) gives that value ``B`` times.
    """
    value = batch.get(key)
    if isinstance(value, NonTensorData):
        return [value.data] * batch.batch_size[0]
    return values(value)


def per_row(batch: TensorDict, key: str) -> list:
    """The ``B`` values of a non-tensor field as a list (one value repeated when tensordict stored it once).

    Unlike :func:`column`, a value whose ``tolist()`` is not ``B`` long (one image list stored for the whole
    batch, say) is repeated, not split.
    """
    value = batch.get(key)
    if hasattr(value, "tolist"):
        items = value.tolist()
        if isinstance(items, list) and len(items) == batch.batch_size[0]:
            return items
    data = getattr(value, "data", value)
    return [data] * batch.batch_size[0]


def stack(items: list[Any]) -> NonTensorStack:
    """A ``NonTensorStack`` of ``items`` (one row each); equal immutable values share one ``NonTensorData``.

    Equivalent to ``NonTensorStack(*items)`` (same values, batch size ``[len(items)]``), several times
    faster on the columns a batch carries (few distinct data sources, repeated answers, ``None`` extras).
    """
    if not items:
        return NonTensorStack(*items)
    shared: dict[tuple[type, Any], NonTensorData] = {}
    rows = []
    for item in items:
        if isinstance(item, _IMMUTABLE):
            key = (type(item), item)
            row = shared.get(key)
            if row is None:
                row = shared[key] = _row(item)
        else:
            row = _row(item)
        rows.append(row)
    return NonTensorStack(*rows)


_TEMPLATE = NonTensorData(data=None)


def _copied_row(item: Any) -> NonTensorData:
    """``NonTensorData(data=item)`` (batch size ``[]``) made by copying a template row: ~20x cheaper than the
    tensorclass constructor (~40 us a row, 10 ms for the 256 response texts of a default-job step).

    The copy gets its own (empty) inner TensorDict and its own attribute dict, as a constructed row has;
    ``tests/data/test_nontensor.py`` checks the rows against constructed ones.
    """
    row = object.__new__(NonTensorData)
    row.__dict__.update(vars(_TEMPLATE), _tensordict=copy.copy(_TEMPLATE._tensordict),
                        _non_tensordict={**_TEMPLATE._non_tensordict, "data": item})
    return row


def _copying_works() -> bool:
    """Whether this tensordict version's rows are laid out as :func:`_copied_row` assumes (else: the constructor)."""
    try:
        row, want = _copied_row("probe"), NonTensorData(data="probe")
        return (vars(row).keys() == vars(want).keys() and row._non_tensordict == want._non_tensordict
                and row.data == "probe" and row.batch_size == want.batch_size)
    except Exception:  # noqa: BLE001 - any other layout: take the constructor
        return False


_row = _copied_row if _copying_works() else (lambda item: NonTensorData(data=item))


def repeat_interleave(batch: TensorDict, n: int) -> TensorDict:
    """``batch.repeat_interleave(n, dim=0)`` (each row ``n`` times in a row, ``[B] -> [B * n]``), non-tensor
    rows shared between the copies as tensordict shares them; a few times faster on a flat batch of tensors
    and one-level stacks. Anything else (nested TensorDicts, one value for the whole batch) goes through
    tensordict's own call."""
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            out[key] = value.repeat_interleave(n, dim=0)
        elif type(value) is NonTensorStack and value.stack_dim == 0 and all(
                type(row) is NonTensorData for row in value.tensordicts):
            out[key] = NonTensorStack(*[row for row in value.tensordicts for _ in range(n)])
        else:
            return batch.repeat_interleave(n, dim=0)
    return TensorDict(out, batch_size=[batch.batch_size[0] * n], device=batch.device)


def shallow_copy(batch: TensorDict) -> TensorDict:
    """A new TensorDict holding the same entries (tensors and non-tensor columns are not copied).

    ``batch.clone(False)`` does the same but rebuilds every non-tensor row (milliseconds per column).
    """
    return batch.select(*batch.keys())


def to_device(batch: TensorDict, device: torch.device | str) -> TensorDict:
    """``batch`` with its tensors on ``device``: itself when they all are there already, else a shallow copy
    with the tensors moved and the non-tensor columns carried over as they are.

    Unlike ``batch.to(device)`` the result's ``.device`` stays unset (``None``): a TensorDict with a device
    rebuilds every non-tensor row. Read a tensor's device instead (``batch[K.PROMPT_IDS].device``).
    """
    device = torch.device(device)
    moved = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            if value.device.type != device.type or (device.index is not None and value.device.index != device.index):
                moved[key] = value.to(device)
        elif not getattr(value, "_is_non_tensor", False):
            return batch.to(device)  # a nested TensorDict: tensordict moves it
    if not moved:
        return batch
    out = shallow_copy(batch)
    for key, value in moved.items():
        out.set(key, value)
    return out
