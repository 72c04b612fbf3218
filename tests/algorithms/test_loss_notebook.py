"""The custom-loss notebook runs top to bottom with nbclient and shows its loss learning."""

import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "custom_loss.ipynb"


@pytest.fixture
def warm_start_cached():
    # The kernel inherits RLFLOW_CACHE (tests/conftest.py); warming it here keeps the supervised
    # warm start (minutes, once per test session) out of the notebook's own run.
    from rlflow.tasks.addition import AdditionTask, warm_started_model

    warm_started_model(AdditionTask(), 0, log=lambda *_: None)


def stream(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


@pytest.mark.learning
def test_custom_loss_notebook_runs_and_learns(warm_start_cached, tmp_path, monkeypatch):
    # One thread in the kernel: the tiny model gains nothing from two, and on shared cores two threads
    # that wait on each other made the training cell 25x slower (300 s instead of 13 s).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    loss_cell = next(c.source for c in nb.cells if "class TOPRLoss(PPOLoss)" in c.source)
    assert len(loss_cell.splitlines()) < 50  # a new policy loss is a short subclass
    assert "def objective(self, batch)" in loss_cell and "agg_loss" not in loss_cell  # the shell aggregates
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "build_trainer(" in source and "loss=TOPRLoss()" in source

    # Raises CellExecutionError if a cell fails, including the plot cell's `assert last > first and after > before`.
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()

    outputs = [stream(c) for c in nb.cells if c.cell_type == "code"]
    hand = next(o for o in outputs if "neg_weight_mean" in o and "tensor(" in o)
    # weights [1, 1, 0.5] on A = [1, -1, -1]: gradient -w A / 3 tokens; padding 0
    assert "'actor/neg_weight_mean': 0.75" in hand
    grad = [float(x) for x in re.findall(r"-?\d+\.\d+", hand.split("tensor(")[1])]
    assert grad == pytest.approx([-1 / 3, 1 / 3, 0.5 / 3, 0.0], abs=1e-4)
    assert any("held-out greedy accuracy" in o for o in outputs)
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for c in nb.cells for o in c.get("outputs", []))  # the reward curve was drawn
