"""SandboxFusion: rlflow's server (rlflow's sandbox behind SandboxFusion's ``/run_code``) answers the official
``sandbox-fusion`` client; rlflow's client scores code on it as the local sandbox does, keeps to
``max_concurrent``, passes ``memory_limit_mb``, and a request that fails costs its sample, not the run."""

import functools
import json
import subprocess
import sys
import threading

import pytest
import sandbox_fusion as official
from sandbox_fusion import RunCodeRequest, RunStatus

from rlflow.data import keys as K
from rlflow.rewards import (FunctionReward, RewardError, RewardWarning, SandboxFusion, SandboxFusionError,
                            default_compute_score)
from rlflow.rewards import code
from rlflow.rewards.code import CodeReward
from rlflow.rewards.sandbox_server import SandboxFusionServer
from rlflow.sandbox import Sandbox

from .test_code_reward import CALL, FAST, GOOD, HALF, STDIO, batch_of, fenced

MISSING = [layer for layer in FAST.require if layer not in FAST.isolation()]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"this kernel lacks the sandbox's required layers {MISSING}")
DEAD = "http://127.0.0.1:9/run_code"  # the discard port: nothing listens there


@pytest.fixture
def server():
    srv = SandboxFusionServer(("127.0.0.1", 0), max_request_bytes=64 * 1024)
    srv.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def base(srv) -> str:
    return srv.url.removesuffix("/run_code")  # the official client adds /run_code itself


def test_the_official_client_talks_to_the_server(server):
    run = functools.partial(official.run_code, endpoint=base(server), max_attempts=1)
    ok = run(RunCodeRequest(code="print(int(input()) * 2)", language="python", stdin="21"))
    assert ok.status == RunStatus.Success and ok.run_result.stdout == "42\n" and ok.run_result.return_code == 0
    failed = run(RunCodeRequest(code="import sys; print('bye', file=sys.stderr); sys.exit(3)", language="python"))
    assert failed.status == RunStatus.Failed and failed.run_result.return_code == 3
    assert failed.run_result.stderr == "bye\n"
    slow = run(RunCodeRequest(code="while True: pass", language="python", run_timeout=1))
    assert slow.status == RunStatus.Failed and slow.run_result.status.value == "TimeLimitExceeded"
    files = run(RunCodeRequest(code="open('out.txt', 'w').write(open('in.txt').read().upper())", language="python",
                               files={"in.txt": "aGk="}, fetch_files=["out.txt"]))  # base64 of "hi"
    assert files.status == RunStatus.Success and files.files == {"out.txt": "SEk="}  # "HI"
    shell = run(RunCodeRequest(code="read x; echo $((x + 1))", language="bash", stdin="41"))
    assert shell.run_result.stdout == "42\n"
    with pytest.raises(Exception, match="422.*language 'cpp' is not run here"):
        run(RunCodeRequest(code="int main(){}", language="cpp"))
    assert server.requests == 6


RESPONSES = [GOOD, HALF, fenced("print(1/0)"), "no code at all", fenced("def add(a, b):\n    return a + b"),
             fenced("def add(a, b):\n    return 3"), fenced("def f(x):\n    return x * 2")]
TRUTHS = [STDIO, STDIO, STDIO, STDIO, CALL, CALL, {"asserts": ["assert f(2) == 4", "assert f(3) == 5"]}]


def test_scores_equal_the_local_sandbox(server):
    remote = SandboxFusion(server.url, memory_limit_mb=256)
    served = [default_compute_score("apps", r, t, sandbox=remote) for r, t in zip(RESPONSES, TRUTHS)]
    local = [default_compute_score("apps", r, t) for r, t in zip(RESPONSES, TRUTHS)]
    assert served == local
    assert [s["score"] for s in served] == [1.0, 0.5, 0.0, 0.0, 1.0, 0.5, 0.5]
    assert server.requests == sum(s["total"] for s in served)  # every case went to the server
    reward = CodeReward(remote, workers=4)
    assert reward(batch_of(RESPONSES, TRUTHS))[K.SCORES].tolist() == [s["score"] for s in local]


def test_max_concurrent_bounds_the_requests_in_flight(server):
    remote = SandboxFusion(server.url, max_concurrent=2)
    threads = [threading.Thread(target=remote.run_python, args=("import time; time.sleep(0.5)",)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert server.requests == 6 and server.peak_in_flight == 2


def test_memory_limit_mb_goes_with_each_request(server):
    program = "x = bytearray(200 << 20); print(len(x) >> 20)"
    assert SandboxFusion(server.url, memory_limit_mb=64).run_python(program).status == "memory_limit"
    roomy = SandboxFusion(server.url, memory_limit_mb=1024).run_python(program)
    assert roomy.status == "ok" and roomy.stdout == "200\n"


def test_a_failed_request_costs_its_sample_and_all_failing_stops_naming_the_url(server):
    with pytest.raises(SandboxFusionError, match=r"SandboxFusion server http://127.0.0.1:9/run_code is unreachable"):
        SandboxFusion(DEAD).run_python("print(1)")
    huge = fenced("a, b = map(int, input().split())\nprint(a + b)  # " + "x" * 70_000)  # over the server's 64 KiB
    reward = FunctionReward(functools.partial(default_compute_score, sandbox=SandboxFusion(server.url)))
    with pytest.warns(RewardWarning, match=r"1 sample\(s\).*HTTP 413"):
        out = reward(batch_of([GOOD, huge, HALF], [STDIO] * 3))
    assert out[K.SCORES].tolist() == [1.0, 0.0, 0.5] and reward.stats["reward/errors"] == 1
    dead = FunctionReward(functools.partial(default_compute_score, sandbox=SandboxFusion(DEAD)))
    with pytest.raises(RewardError, match=r"http://127.0.0.1:9/run_code is unreachable"):
        dead(batch_of([GOOD, HALF], [STDIO] * 2))
    code_reward = CodeReward(SandboxFusion(server.url), workers=2)
    with pytest.warns(RewardWarning, match=r"1 sample\(s\): the sandbox could not run the program.*HTTP 413"):
        out = code_reward(batch_of([GOOD, huge], [STDIO] * 2))
    assert out[K.SCORES].tolist() == [1.0, 0.0] and code_reward.stats["reward/errors"] == 1


def test_the_client_reads_verl_urls_and_survives_pickling():
    assert SandboxFusion("http://h:8080").url == SandboxFusion("http://h:8080/").url == "http://h:8080/run_code"
    assert SandboxFusion("https://faas.example/api/run_code").url == "https://faas.example/api/run_code"
    with pytest.raises(ValueError, match="sandbox_fusion.url='localhost:8080': not an http"):
        SandboxFusion("localhost:8080")
    import pickle

    copy = pickle.loads(pickle.dumps(SandboxFusion("http://h/run_code", max_concurrent=3)))
    assert copy == SandboxFusion("http://h/run_code", max_concurrent=3) and copy._slots._value == 3


def test_rlflow_sandbox_serve_command():
    proc = subprocess.Popen([sys.executable, "-m", "rlflow.cli", "sandbox", "serve", "--port", "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("SandboxFusion-compatible server (rlflow's local sandbox) at http://127.0.0.1:")
        url = line.split(" at ")[1].strip()
        answer = official.run_code(RunCodeRequest(code="print(6 * 7)", language="python"),
                                   endpoint=url.removesuffix("/run_code"), max_attempts=1)
        assert answer.run_result.stdout == "42\n"
        assert code.compute_score(GOOD, STDIO, sandbox=SandboxFusion(url))["score"] == 1.0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
