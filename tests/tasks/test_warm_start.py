"""The shipped warm starts are the ones the tasks ask for, and a warm start rlflow does not ship is made once."""

import pytest
import torch

from rlflow.tasks import warm_start
from rlflow.tasks.addition import AdditionTask, greedy_accuracy, supervised_warm_start, warm_started_model


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_default_task_loads_its_shipped_warm_start(seed):
    lines = []
    model, tokenizer = warm_started_model(AdditionTask(), seed, log=lines.append)
    assert lines[-1] == f"warm start: addition-seed{seed}.safetensors, shipped with rlflow", lines
    # what the shipped file was made for: the validation accuracy the warm start stops at. Greedy argmax over
    # fixed weights; rounding could flip a near-tie answer, never 5 of 128.
    _, val, _ = AdditionTask().splits()
    assert greedy_accuracy(model, tokenizer, val) >= 0.15 - 5 / len(val)


def test_shipped_files_are_used_only_for_their_own_key():
    assert warm_start.shipped_file("addition", {"task": {}, "seed": 0, "target": 0.15}) is None
    other = AdditionTask(held_out=255)
    from dataclasses import asdict

    assert warm_start.shipped_file("addition", {"task": asdict(other), "seed": 0, "target": 0.15}) is None


def test_a_warm_start_without_a_shipped_file_is_made_once_then_loaded(monkeypatch):
    made = []
    module = torch.nn.Linear(3, 2)

    def make():
        with torch.no_grad():
            module.weight.fill_(0.5)
        made.append(1)
        return "made"

    lines = []
    warm_start.load_or_make("unit", {"seed": 7, "what": "test"}, module, make, lines.append)
    other = torch.nn.Linear(3, 2)
    warm_start.load_or_make("unit", {"seed": 7, "what": "test"}, other, make, lines.append)
    assert made == [1] and lines[0].startswith("made; cached at ") and lines[1].startswith("warm start: loaded ")
    assert torch.equal(other.weight, module.weight)


def test_the_jitter_moves_weights_by_about_1e_4(monkeypatch):
    shipped, _ = warm_started_model(AdditionTask(), 0, log=lambda _: None)
    monkeypatch.setenv(warm_start.JITTER, "1")
    jittered, _ = warm_started_model(AdditionTask(), 0, log=lambda _: None)
    for a, b in zip(shipped.parameters(), jittered.parameters()):
        rel = ((b - a).abs() / a.abs().clamp_min(1e-30)).max().item()
        assert 0 < rel < 1e-3 or torch.equal(a, torch.zeros_like(a))


def test_the_supervised_warm_start_reaches_its_target():
    """The code that made the shipped files still works (a smaller task: seconds, not minutes)."""
    task = AdditionTask(max_operand=9, held_out=10, warm_val=20, hidden_size=32, num_layers=1)
    model, tok = task.model(0), task.tokenizer()
    train, val, _ = task.splits()
    steps = supervised_warm_start(model, tok, train, val, target=0.15, seed=0, eval_every=10, max_steps=1500)
    assert steps <= 1500 and greedy_accuracy(model, tok, val) >= 0.15
