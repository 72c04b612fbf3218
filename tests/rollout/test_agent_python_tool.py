"""The sandboxed Python tool in the agent loop: programs that break a limit or try to escape get a clear tool
error, the other samples go on, and nothing outside the sandbox is touched. (The sandbox's own tests,
tests/rewards/test_sandbox.py, try each escape in depth; these show what the model reads.)"""

import socket
import uuid
from pathlib import Path

import pytest

from rlflow.data import keys as K
from rlflow.rollout.agent import AgentLoop
from rlflow.rewards import SandboxFusion
from rlflow.rewards.sandbox_server import SandboxFusionServer
from rlflow.rollout.tools import PythonTool, load_tool_config
from rlflow.rollout.tools.base import ToolError
from rlflow.sandbox import Sandbox
from rlflow.tasks.calculator import chat_tokenizer
from tests.rollout.agent_helpers import call, prompts, replay_rollout

LIMITS = {"wall_s": 3, "cpu_s": 1, "memory_mb": 256, "max_processes": 8, "max_output_bytes": 10_000,
          "max_file_mb": 1, "disk_mb": 8}


@pytest.fixture(scope="module")
def layers():
    return Sandbox().isolation()


def test_misbehaving_programs_become_clear_tool_errors(layers, tmp_path):
    outside = Path("/tmp") / f"rlflow-escape-{uuid.uuid4().hex}"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.1)
    port = listener.getsockname()[1]
    programs = {
        "ok": "print(sum(range(10)))",
        "loop": "while True:\n    pass",
        "sleep": "import time\ntime.sleep(60)",
        "forks": "import os\nwhile True:\n    os.fork()",
        "alloc": "x = bytearray(4 * 1024 ** 3)\nprint(len(x))",
        "flood": "while True:\n    print('x' * 1000)",
        "write": f"open({str(outside)!r}, 'w').write('escaped')",
        "net": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')",
        "syntax": "def (:",
    }
    expected = {
        # the CPU limit (1 s) or, on a busy machine, the wall limit (3 s) stops the loop
        "ok": "45", "loop": "was stopped", "sleep": "ran longer than its 3 s of wall time",
        "alloc": "ran out of its 256 MiB of memory", "flood": "printed more than 10000 bytes",
        "syntax": "SyntaxError", "forks": "Error: python: the program", "write": "Error: python: the program",
        "net": "Error: python: the program",
    }

    def script(context):
        name = context.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        if "<|im_start|>tool" not in context:
            return call("python", code=programs[name])
        return "done"

    require = tuple(layer for layer in Sandbox().require if layer in layers)
    tool = PythonTool({**LIMITS, "require": require})
    loop = AgentLoop(replay_rollout(tok := chat_tokenizer(), script, max_new_tokens=2000), [tool])
    out = loop(prompts(tok, list(programs)))
    seen = {name: info["messages"][2]["content"] for name, info in zip(programs, out[K.EXTRA_INFO])}
    for name, text in expected.items():
        assert text in seen[name], (name, seen)
    assert seen["ok"] == "45\n"
    assert all(info["messages"][-1]["content"] == "done" for info in out[K.EXTRA_INFO])  # every sample went on
    assert loop.stats["agent/tool_errors/error"] == len(programs) - 1
    assert loop.stats["agent/tool_error_rate"] == pytest.approx((len(programs) - 1) / len(programs))
    if "landlock" in layers:
        assert not outside.exists()
    if "seccomp" in layers or "userns" in layers:
        with pytest.raises(socket.timeout):
            listener.accept()  # nobody connected
    listener.close()


SANDBOX_FUSION_TOOL = """
tools:
  - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool
    config: {type: native, sandbox_fusion_url: URL, default_timeout: 4, memory_limit_mb: 128,
             num_workers: 10, rate_limit: 3}
    tool_schema:
      type: function
      function:
        name: code_interpreter
        description: A tool for executing code.
        parameters: {type: object, properties: {code: {type: string}}, required: [code]}
"""


def test_verl_sandbox_fusion_tool_runs_on_its_server(tmp_path, layers):
    server = SandboxFusionServer(("127.0.0.1", 0))
    server.start()
    try:
        config = tmp_path / "tools.yaml"
        config.write_text(SANDBOX_FUSION_TOOL.replace("URL", server.url))
        (tool,) = load_tool_config(config)
        assert isinstance(tool, PythonTool) and tool.name == "code_interpreter"
        assert tool.sandbox == SandboxFusion(server.url, max_concurrent=3, memory_limit_mb=128, run_timeout=4)
        assert tool.execute({"code": "print(6 * 7)"}) == "42\n" and server.requests == 1
        with pytest.raises(ToolError, match="ran out of its 128 MiB of memory"):
            tool.execute({"code": "x = bytearray(300 << 20)"})
    finally:
        server.shutdown()
        server.server_close()
    config.write_text(SANDBOX_FUSION_TOOL.replace("URL", "http://127.0.0.1:9/run_code"))
    (dead,) = load_tool_config(config)
    with pytest.raises(ToolError, match=r"python: SandboxFusion server http://127.0.0.1:9/run_code is unreachable"):
        dead.execute({"code": "print(1)"})
    with pytest.raises(ValueError, match=r"\['cpu_s'\] limit the local sandbox; with sandbox_fusion_url"):
        PythonTool({"sandbox_fusion_url": server.url, "cpu_s": 2})


def test_verl_sandbox_fusion_tool_without_a_url_runs_in_the_local_sandbox(tmp_path, layers):
    config = tmp_path / "tools.yaml"
    config.write_text(SANDBOX_FUSION_TOOL.replace("sandbox_fusion_url: URL, ", "").replace(", rate_limit: 3", ""))
    (tool,) = load_tool_config(config)
    assert isinstance(tool, PythonTool) and tool.name == "code_interpreter"
    assert (tool.sandbox.limits.wall_s, tool.sandbox.limits.memory_mb) == (4, 128)
    with pytest.raises(ValueError, match="unknown config key"):
        PythonTool({"cpu_seconds": 3})
