import pytest
import torch
from tensordict import TensorDict

from rlflow.module import BatchModule, Chain, MissingKeyError, check_chain


class Double(BatchModule):
    in_keys, out_keys = ("x",), ("y",)

    def forward(self, batch):
        batch["y"] = batch["x"] * 2
        return batch


class AddOne(BatchModule):
    in_keys, out_keys = ("y", "z"), ("w",)
    needs_critic = True

    def __init__(self):
        self.calls = 0

    def forward(self, batch):
        self.calls += 1
        batch["w"] = batch["y"] + batch["z"] + 1
        return batch

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


def test_chain_keys_run_and_state():
    chain = Chain(Double(), AddOne())
    assert chain.in_keys == ("x", "z") and set(chain.out_keys) == {"y", "w"} and chain.needs_critic
    batch = chain(TensorDict({"x": torch.tensor([1.0, 2.0]), "z": torch.tensor([10.0, 20.0])}, batch_size=[2]))
    assert batch["w"].tolist() == [13.0, 25.0]
    other = Chain(Double(), AddOne())
    other.load_state_dict(chain.state_dict())
    assert other.modules[1].calls == 1


def test_missing_key_is_named_at_call_and_in_chain_check():
    with pytest.raises(KeyError, match=r"Double needs batch key\(s\) \['x'\]"):
        Double()(TensorDict({"q": torch.zeros(2)}, batch_size=[2]))
    with pytest.raises(MissingKeyError, match=r"second \(AddOne\) reads 'z'"):
        check_chain({"x"}, [("first", Double()), ("second", AddOne())])
    assert check_chain({"x", "z"}, [("first", Double()), ("skipped", None), ("second", AddOne())]) == {"x", "y", "z", "w"}
