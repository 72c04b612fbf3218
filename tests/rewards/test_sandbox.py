"""The sandbox: each limit holds, each escape is contained, and the caller goes on unharmed.

Limits are small so each misbehaving program ends in about a second. A layer the kernel lacks skips
the test that needs it, naming the layer (``Sandbox.isolation()`` says what this machine provides).
"""

import os
import signal
import socket
import threading
import time

import pytest

from rlflow.sandbox import Limits, Sandbox

FAST = Limits(wall_s=3, cpu_s=1, memory_mb=256, max_processes=8, max_output_bytes=10_000, max_file_mb=1,
              disk_mb=8)


@pytest.fixture(scope="module")
def layers():
    return Sandbox().isolation()


@pytest.fixture(scope="module")
def box(layers):
    """The default sandbox; where the kernel lacks a default layer, one that does without it (the tests of that
    layer skip)."""
    return Sandbox(FAST, require=tuple(layer for layer in Sandbox().require if layer in layers))


def need(layers, layer):
    if layer not in layers:
        pytest.skip(f"this kernel does not provide the {layer!r} isolation layer (have: {layers})")


def test_runs_python_with_stdin_args_and_files(box):
    code = "import sys\nprint(int(input()) * 2, sys.argv[1:], open('data.txt').read())"
    result = box.run_python(code, stdin="21", args=["a", "b"], files={"data.txt": "hello"})
    assert result.status == "ok" and result.exit_code == 0, result
    assert result.stdout == "42 ['a', 'b'] hello\n"
    assert result.cpu_s > 0 and result.wall_s > 0


def test_runs_any_program_and_collects_files(box):
    result = box.run(["/bin/sh", "-c", "cat in.txt | tr a-z A-Z > out.txt; echo done; exit 3"],
                     files={"in.txt": "abc"}, collect=("out.txt",))
    assert (result.status, result.exit_code, result.stdout) == ("error", 3, "done\n")
    assert result.files == {"out.txt": b"ABC"}


def test_wall_time_limit_kills_a_sleeping_program(box):
    result = box.run_python("import time; time.sleep(60)", limits=Limits(wall_s=0.5))
    assert result.status == "timeout" and result.wall_s < 5


def test_cpu_limit_stops_an_infinite_loop(box):
    result = box.run_python("while True: pass", limits=Limits(wall_s=20, cpu_s=1))
    assert result.status == "cpu_limit", result
    assert 0.5 <= result.cpu_s < 3  # the kernel's limit counts scheduler time; rusage samples it (close, not equal)


def test_memory_limit_stops_a_big_allocation(box):
    result = box.run_python("x = bytearray(2 * 2**30)\nprint('allocated')")
    assert result.status == "memory_limit" and "allocated" not in result.stdout, result


def test_output_limit_ends_a_flood(box):
    result = box.run_python("import sys\nwhile True: sys.stdout.write('x' * 4096)")
    assert result.status == "output_limit" and result.truncated
    assert len(result.stdout) <= FAST.max_output_bytes


def test_fork_bomb_is_contained(box, layers):
    need(layers, "nproc")
    code = ("import os\nforked = 0\nfor _ in range(1000):\n    try:\n        if os.fork() == 0:\n"
            "            import time; time.sleep(30); os._exit(0)\n        forked += 1\n"
            "    except OSError:\n        break\nprint(forked)")
    result = box.run_python(code)
    assert result.status == "ok", result
    assert int(result.stdout) == FAST.max_processes - 1  # the program itself is one of them


def test_no_process_outlives_its_run(box):
    token = f"rlflow-leftover-{os.getpid()}-{time.monotonic_ns()}"  # names the sandboxed processes in /proc
    code = "import os, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(60)\nelse:\n    print('parent done')"
    result = box.run_python(code, args=[token])
    assert result.status == "ok" and result.stdout == "parent done\n"
    time.sleep(0.2)
    leftovers = [p for p in os.listdir("/proc") if p.isdigit() and token in _cmdline(p)]
    assert leftovers == []


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def test_writing_outside_the_folder_is_refused(box, layers, tmp_path):
    need(layers, "landlock")
    target = tmp_path / "escape.txt"
    code = f"open('inside.txt', 'w').write('ok')\nopen({str(target)!r}, 'w').write('escaped')"
    result = box.run_python(code)
    assert result.status == "error" and "PermissionError" in result.stderr
    assert not target.exists()


def test_reading_outside_the_allowed_folders_is_refused(box, layers, tmp_path):
    need(layers, "landlock")
    secret = tmp_path / "answers.txt"
    secret.write_text("42")
    result = box.run_python(f"print(open({str(secret)!r}).read())")
    assert result.status == "error" and "PermissionError" in result.stderr and "42" not in result.stdout


def test_opening_a_socket_is_refused(box, layers):
    need(layers, "seccomp")
    with socket.socket() as server:  # a listener the program must not reach
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
        result = box.run_python(code)
        server.settimeout(0.2)
        with pytest.raises(socket.timeout):
            server.accept()
    assert result.status == "error" and "connected" not in result.stdout
    assert "PermissionError" in result.stderr or "OSError" in result.stderr


def test_signalling_the_caller_is_refused(box, layers):
    need(layers, "landlock")
    got = threading.Event()
    previous = signal.signal(signal.SIGUSR1, lambda *a: got.set())
    try:
        result = box.run_python(f"import os, signal\nos.kill({os.getpid()}, signal.SIGUSR1)")
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert result.status == "error" and not got.is_set()


def test_parallel_runs_are_independent(box):
    results = [None] * 4

    def run(i):
        results[i] = box.run_python(f"print({i} * 10)")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.stdout for r in results] == ["0\n", "10\n", "20\n", "30\n"]


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="wall_s"):
        Limits(wall_s=0)
    with pytest.raises(ValueError, match="unknown layer"):
        Sandbox(require=("magic",))
    result = Sandbox().run(["no-such-program-xyz"])
    assert result.status == "sandbox_error" and "no-such-program-xyz" in result.stderr
    result = Sandbox().run_python("print(1)", files={"../x.py": "x"})
    assert result.status == "sandbox_error" and "leaves the folder" in result.stderr


def test_a_required_layer_that_is_missing_stops_the_run_before_it_starts():
    box = Sandbox(FAST, namespaces=False, require=("userns",))  # namespaces off: the layer cannot hold
    result = box.run_python("print('ran')")
    assert result.status == "sandbox_error" and "ran" not in result.stdout
    assert "required isolation unavailable on this machine: userns" in result.stderr
