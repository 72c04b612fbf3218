"""The extensibility notebook runs top to bottom with nbclient and shows its estimator learning."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


@pytest.fixture
def warm_start_cached():
    # The notebook's kernel inherits RLFLOW_CACHE (tests/conftest.py); warming it here keeps the
    # supervised warm start (minutes, once per test session) out of the notebook's own run.
    from rlflow.tasks.addition import AdditionTask, warm_started_model

    warm_started_model(AdditionTask(), 0, log=lambda *_: None)


def text_outputs(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


@pytest.mark.learning
def test_custom_estimator_notebook_runs_and_learns(warm_start_cached, tmp_path):
    nb = nbformat.read(NOTEBOOKS / "custom_estimator.ipynb", as_version=4)
    nbformat.validate(nb)
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    estimator = next(c.source for c in nb.cells if "class MedianBaseline(AdvantageEstimator)" in c.source)
    assert len(estimator.splitlines()) < 50  # the point of the notebook: a new algorithm is a short subclass
    assert "Trainer(" in source and "estimator=MedianBaseline()" in source and "build_trainer" not in source

    # Raises CellExecutionError if any cell fails, including the last cell's `assert last > first`.
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()

    outputs = [text_outputs(c) for c in nb.cells if c.cell_type == "code"]
    # The hand-made batch: group (1, 0, 0) has median 0, group (1, 1, 0) median 1.
    hand = next(o for o in outputs if o.startswith("tensor("))
    assert hand.replace(" ", "").replace("\n", "") == "tensor([[1.,1.],[0.,0.],[0.,0.],[0.,0.],[0.,0.],[-1.,-1.]])"
    assert any("mean batch reward, first 10 steps" in o for o in outputs)
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for c in nb.cells for o in c.get("outputs", []))  # the reward curve was drawn
