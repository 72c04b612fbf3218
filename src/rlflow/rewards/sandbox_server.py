"""A SandboxFusion-compatible server backed by rlflow's local sandbox: ``rlflow sandbox serve --port 8080``.

It answers SandboxFusion's ``POST /run_code`` (the request and response models of the official ``sandbox-fusion``
client, which talks to it unchanged) by running the program in :class:`rlflow.sandbox.Sandbox`: the limits of
``rlflow.rewards.code.DEFAULT_LIMITS`` with the request's ``run_timeout`` as wall time (and CPU time, when
lower) and its ``memory_limit_MB`` as memory. Languages: ``python`` (``python3``), the interpreter running the
server, and ``bash``. Where a SandboxFusion server is wanted without one (a CPU machine, a test, a laptop)::

    rlflow sandbox serve --port 8080 &
    rlflow train ... reward_model.sandbox_fusion.url=http://127.0.0.1:8080/run_code

How a sandbox result is answered (``status`` / ``run_result.status`` / ``return_code``):

=====================  ===========================================================
sandbox status         answer
=====================  ===========================================================
ok                     Success / Finished / 0
error, memory_limit    Failed / Finished / the exit code (stderr says MemoryError)
signal                 Failed / Finished / minus the signal number
timeout, cpu_limit     Failed / TimeLimitExceeded
output_limit           Failed / Error (stderr ends with a line saying so)
sandbox_error          SandboxError, ``message`` the sandbox's reason
=====================  ===========================================================

A request that is not a valid ``RunCodeRequest`` gets HTTP 422 with ``{"detail": why}``, a body over
``max_request_bytes`` HTTP 413. ``peak_in_flight`` and ``requests`` count what the server saw.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rlflow.rewards.code import DEFAULT_LIMITS
from rlflow.sandbox import Sandbox, SandboxResult

LANGUAGES = ("python", "python3", "bash")
MAX_REQUEST_BYTES = 64 << 20


class SandboxFusionServer(ThreadingHTTPServer):
    """``POST /run_code`` on ``(host, port)`` (port 0: a free one, then ``server_address[1]``), one thread per request.

    Args:
        address: ``(host, port)``.
        sandbox: where programs run (default: ``Sandbox(DEFAULT_LIMITS)`` of ``rlflow.rewards.code``).
        max_request_bytes: larger request bodies are refused (HTTP 413).
    """

    daemon_threads = True

    def __init__(self, address: tuple[str, int], sandbox: Sandbox | None = None, *,
                 max_request_bytes: int = MAX_REQUEST_BYTES):
        super().__init__(address, RunCodeHandler)
        self.sandbox = sandbox or Sandbox(DEFAULT_LIMITS)
        self.max_request_bytes = max_request_bytes
        self.requests, self.in_flight, self.peak_in_flight = 0, 0, 0
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/run_code"

    def start(self) -> threading.Thread:
        """Serve on a daemon thread (``shutdown()`` stops it)."""
        thread = threading.Thread(target=self.serve_forever, name="rlflow-sandbox-fusion", daemon=True)
        thread.start()
        return thread

    def run_code(self, request: dict) -> dict:
        """One ``RunCodeRequest`` -> its ``RunCodeResponse``; ``ValueError`` for a request that is not one."""
        code, language = request.get("code"), request.get("language")
        if not isinstance(code, str):
            raise ValueError("'code' must be a string")
        if language not in LANGUAGES:
            raise ValueError(f"language {language!r} is not run here; languages: {', '.join(LANGUAGES)}")
        limits = self.sandbox.limits
        run_timeout = _positive(request.get("run_timeout", 10), "run_timeout")
        memory = request.get("memory_limit_MB")
        limits = dataclasses.replace(limits, wall_s=run_timeout, cpu_s=min(limits.cpu_s, run_timeout),
                                     memory_mb=int(_positive(memory, "memory_limit_MB")) if memory is not None
                                     else limits.memory_mb)
        files, stdin = _decoded(request.get("files") or {}), request.get("stdin") or ""
        collect = tuple(request.get("fetch_files") or ())
        if language == "bash":
            result = self.sandbox.run(["bash", "main.sh"], stdin=stdin, files={"main.sh": code, **files},
                                      limits=limits, collect=collect)
        else:
            result = self.sandbox.run_python(code, stdin=stdin, files=files, limits=limits, collect=collect)
        return response_of(result)


def response_of(result: SandboxResult) -> dict:
    """A sandbox result as SandboxFusion's ``RunCodeResponse`` (the table in the module docs)."""
    files = {name: base64.b64encode(data).decode() for name, data in result.files.items()}
    if result.status == "sandbox_error":
        return {"status": "SandboxError", "message": result.stderr.strip()[-2000:], "compile_result": None,
                "run_result": None, "executor_pod_name": None, "files": files}
    run = {"status": "Finished", "execution_time": result.wall_s, "cpu_time": result.cpu_s,
           "return_code": result.exit_code, "stdout": result.stdout, "stderr": result.stderr}
    if result.status in ("timeout", "cpu_limit"):
        run.update(status="TimeLimitExceeded", return_code=None)
    elif result.status == "output_limit":
        run.update(status="Error", return_code=None,
                   stderr=result.stderr + "\nrlflow sandbox: the program printed more than its output limit\n")
    elif result.status == "signal":
        run["return_code"] = -(result.signal or 9)
    return {"status": "Success" if result.ok else "Failed", "message": "", "compile_result": None,
            "run_result": run, "executor_pod_name": None, "files": files}


class RunCodeHandler(BaseHTTPRequestHandler):
    server: SandboxFusionServer
    protocol_version = "HTTP/1.1"

    def do_POST(self):  # noqa: N802 (http.server's name)
        if self.path.rstrip("/").rsplit("/", 1)[-1] != "run_code":
            return self._answer(404, {"detail": f"no endpoint {self.path}; this server answers POST /run_code"})
        size = int(self.headers.get("Content-Length") or 0)
        if size > self.server.max_request_bytes:
            self.close_connection = True
            while size > 0:  # read it (unread, the client's send fails before it sees the answer)
                size -= len(self.rfile.read(min(size, 1 << 20)) or b"x" * size)
            return self._answer(413, {"detail": f"request of {size} bytes; at most {self.server.max_request_bytes}"})
        body = self.rfile.read(size)
        server = self.server
        with server._lock:
            server.requests += 1
            server.in_flight += 1
            server.peak_in_flight = max(server.peak_in_flight, server.in_flight)
        try:
            request = json.loads(body)
            if not isinstance(request, dict):
                raise ValueError("the body must be a JSON object (a RunCodeRequest)")
            answer = server.run_code(request)
        except ValueError as e:
            return self._answer(422, {"detail": str(e)})
        finally:
            with server._lock:
                server.in_flight -= 1
        self._answer(200, answer)

    def _answer(self, code: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args):  # noqa: A002  one line per request is noise in a training log
        pass


def _positive(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name}={value!r}: must be a number > 0")
    return value


def _decoded(files: dict) -> dict[str, bytes]:
    if not isinstance(files, dict):
        raise ValueError("'files' must map file names to base64 contents")
    out = {}
    for name, data in files.items():
        if data is None:
            continue
        try:
            out[name] = base64.b64decode(data, validate=True)
        except (binascii.Error, TypeError):
            raise ValueError(f"files[{name!r}] is not base64") from None
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m rlflow.rewards.sandbox_server [--host H] [--port P]``, as ``rlflow sandbox serve``."""
    parser = argparse.ArgumentParser(prog="rlflow sandbox serve", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(argv)
    return serve(args.host, args.port)


def serve(host: str = "127.0.0.1", port: int = 8080) -> int:
    """Serve until interrupted; the first line printed names the url (port 0: the port picked)."""
    server = SandboxFusionServer((host, port))
    print(f"SandboxFusion-compatible server (rlflow's local sandbox) at {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
