import os

# The suite runs one CPU thread per process whatever the shell says (RLFLOW_TEST_THREADS to change it): on a
# shared 2-core machine torch's default of one thread per core made single-process tests ~5x slower. Set
# before torch starts, so that subprocesses (torchrun, the CLI, notebook kernels) inherit it too.
_THREADS = os.environ.get("RLFLOW_TEST_THREADS", "1")
os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = _THREADS

# No usage reports from the suite: MLflow decides at import (here, during collection, before pytest sets
# PYTEST_CURRENT_TEST, which it would read as a test run) and sends from background threads; gradio-client (trackio's)
# and huggingface_hub have their own switches. Subprocesses inherit these too.
for _name, _value in {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true", "HF_HUB_DISABLE_TELEMETRY": "1",
                      "GRADIO_ANALYTICS_ENABLED": "False"}.items():
    os.environ.setdefault(_name, _value)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(_THREADS))

from rlflow.models.tiny import char_tokenizer, tiny_qwen2
from rlflow.tasks.addition import AdditionTask

from .distributed.launch import fsdp2_results, launch_fsdp2_jobs


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # The warm-start cache is shared by the tests of one session, never with the user's ~/.cache.
    monkeypatch.setenv("RLFLOW_CACHE", os.environ.get("RLFLOW_TEST_CACHE") or str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="session")
def trackio_dir(tmp_path_factory):
    """Trackio's folder for the session. trackio reads ``$TRACKIO_DIR`` once, when first imported: the suite imports
    it here, pointed under the session's temp folder, so no test writes to ~/.cache/huggingface/trackio."""
    folder = tmp_path_factory.getbasetemp() / "trackio"
    before = os.environ.get("TRACKIO_DIR")
    os.environ["TRACKIO_DIR"] = str(folder)
    try:
        pytest.importorskip("trackio", reason="Trackio tracing needs trackio (pip install 'rlflow[tracing]')")
    finally:
        if before is None:
            del os.environ["TRACKIO_DIR"]
        else:
            os.environ["TRACKIO_DIR"] = before
    from trackio import utils
    assert utils.TRACKIO_DIR == folder, f"trackio was imported before the trackio_dir fixture: {utils.TRACKIO_DIR}"
    return folder


@pytest.fixture
def tokenizer():
    return char_tokenizer()


@pytest.fixture
def model(tokenizer):
    return tiny_qwen2(len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      intermediate_size=64, seed=0)


@pytest.fixture
def addition_rows():
    train, _, test = AdditionTask().splits()
    return train[:64], test[:16]


@pytest.fixture(scope="session")
def fsdp2_launch(tmp_path_factory):
    """One 2-process launch of tests/distributed/launch.py's FSDP2_JOBS (shared by the files that read them: each
    launch starts interpreters that import the trainer), the last job failing: (the launch, its folder)."""
    root = tmp_path_factory.mktemp("fsdp2_jobs")
    return launch_fsdp2_jobs(root), root


@pytest.fixture(scope="session")
def fsdp2_launched(fsdp2_launch):
    """{job: (its steps' records, its run folder)} of FSDP2_JOBS; their checkpoints are read, never written."""
    return fsdp2_results(*fsdp2_launch)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
