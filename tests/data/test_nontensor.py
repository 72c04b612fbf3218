"""The fast non-tensor column helpers agree with tensordict's own (slow) paths."""

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from rlflow.data import nontensor


def batch():
    values = ["a", "b", "a", None, {"k": 1}]
    return TensorDict({"x": torch.arange(5), "s": nontensor.stack(values),
                       "one": NonTensorData("same", batch_size=[5])}, batch_size=[5]), values


def test_stack_and_values_round_trip_like_tensordict():
    td, values = batch()
    assert nontensor.column(td, "s") == values == NonTensorStack(*values).tolist() == td.get("s").tolist()
    assert nontensor.column(td, "one") == ["same"] * 5
    assert nontensor.column(td, "x") == [0, 1, 2, 3, 4]
    # rows travel with indexing / splitting / repeat_interleave as tensordict's own stacks do
    assert nontensor.column(td[torch.tensor([4, 0])], "s") == [{"k": 1}, "a"]
    assert nontensor.column(td.repeat_interleave(2, dim=0), "s") == [v for v in values for _ in range(2)]
    assert [nontensor.column(part, "s") for part in td.split(2)] == [values[:2], values[2:4], values[4:]]
    # a nested stack (2-d) falls back to tensordict's tolist
    nested = torch.stack([NonTensorStack("p", "q"), NonTensorStack("r", "s")])
    assert nontensor.values(nested) == [["p", "q"], ["r", "s"]]
    assert nontensor.stack([]).batch_size == NonTensorStack().batch_size


def test_shallow_copy_and_to_device_share_columns():
    td, values = batch()
    copy = nontensor.shallow_copy(td)
    copy.set("y", torch.zeros(5))
    assert "y" not in td.keys() and copy.get("s") is td.get("s")
    assert nontensor.to_device(td, "cpu") is td  # nothing to move: the same batch
    moved = nontensor.to_device(td, "meta")  # a device without data: tensors move, columns are shared
    assert moved.get("x").device.type == "meta" and td.get("x").device.type == "cpu"
    assert moved.get("s") is td.get("s")
