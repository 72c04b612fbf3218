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
    flat = td.exclude("one")  # tensors and one-level stacks: rlflow's fast path; else tensordict's own
    for source in (flat, td):
        fast, slow = nontensor.repeat_interleave(source, 3), source.repeat_interleave(3, dim=0)
        assert fast.batch_size == slow.batch_size == torch.Size([15]) and set(fast.keys()) == set(slow.keys())
        assert torch.equal(fast.get("x"), slow.get("x")) and nontensor.column(fast, "s") == nontensor.column(slow, "s")
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


def test_fast_rows_are_like_constructed_ones():
    """``stack`` builds its rows by copying a template: each behaves like ``NonTensorData(data=...)``."""
    assert nontensor._row is nontensor._copied_row  # the fast path is taken with this tensordict version
    a, b = nontensor.stack(["a", "b"]).tensordicts
    want = NonTensorData(data="a")
    assert type(a) is type(want) and a.data == "a" and b.data == "b" and a.batch_size == want.batch_size
    assert a._tensordict is not b._tensordict and a._non_tensordict is not b._non_tensordict
    assert vars(a).keys() == vars(want).keys() and a._non_tensordict == want._non_tensordict
    a.data = "changed"  # a row's own value: its neighbour keeps its own
    assert (a.data, b.data) == ("changed", "b")
    assert nontensor.stack(["a", "b"]).tolist() == ["a", "b"] and nontensor._TEMPLATE.data is None
    td = TensorDict({"s": nontensor.stack(["p", "q", "r"])}, batch_size=[3])
    assert td[1]["s"] == "q" and td.get("s")[2].data == "r"
