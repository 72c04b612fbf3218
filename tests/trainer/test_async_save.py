"""Asynchronous checkpoints (Trainer(async_save=True), verl's checkpoint.async_save): the state is copied off the
training tensors before save() returns, written and published in the background, waited for by the next save,
a load and the end of fit (tests/config/test_async_save_keys.py: resumed through main_ppo, as from a synchronous save)."""

import threading

import pytest
import torch
from lightning_fabric.plugins import TorchCheckpointIO

from rlflow.trainer import training_state as ckpt

from .helpers import make_trainer


def snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class SlowDisk(TorchCheckpointIO):
    """Lightning's own checkpoint writer, held back until the test lets it write (a slow disk)."""

    def __init__(self):
        super().__init__()
        self.go, self.writing = threading.Event(), threading.Event()

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.writing.set()
        assert self.go.wait(30)
        super().save_checkpoint(checkpoint, path, storage_options)


def test_the_save_holds_the_state_of_its_step_while_training_goes_on(model, tokenizer, addition_rows, tmp_path):
    trainer, _ = make_trainer(model, tokenizer, addition_rows, tmp_path, ppo=True, async_save=True)
    disk = trainer.fabric.strategy.checkpoint_io = SlowDisk()
    trainer.global_step = 3
    before, critic_before = (snapshot(m) for m in (trainer.policy.module, trainer.critic.module))
    path = trainer.save()
    assert disk.writing.wait(30) and path == tmp_path / "global_step_3"
    assert not path.exists() and ckpt.latest_checkpoint(tmp_path) is None  # not published while being written
    with torch.no_grad():  # training changes the live weights meanwhile
        for p in list(trainer.policy.module.parameters()) + list(trainer.critic.module.parameters()):
            p.add_(1.0)
    disk.go.set()
    ckpt.wait(trainer)
    assert ckpt.latest_checkpoint(tmp_path) == path and (path / "huggingface").is_dir()
    saved = torch.load(path / "state.ckpt", weights_only=False)["policy"]
    critic = torch.load(path / "critic.ckpt", weights_only=False)["critic"]
    for state, want, live in ((saved, before, trainer.policy.module), (critic, critic_before, trainer.critic.module)):
        assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)
        assert not torch.equal(state[next(iter(want))], live.state_dict()[next(iter(want))])  # the live ones moved


def test_an_error_of_the_background_write_is_raised_by_the_next_wait(model, tokenizer, addition_rows, tmp_path):
    trainer, _ = make_trainer(model, tokenizer, addition_rows, tmp_path, async_save=True)

    class FullDisk(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            raise OSError(28, "No space left on device")

    trainer.fabric.strategy.checkpoint_io = FullDisk()
    trainer.save()
    with pytest.raises(ckpt.CheckpointError, match=r"could not write checkpoint .*global_step_0 in the background "
                                                   r"\(No space left on device\); no earlier checkpoint exists"):
        ckpt.wait(trainer)
    assert ckpt.latest_checkpoint(tmp_path) is None
