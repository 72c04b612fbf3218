"""An HTTP proxy on 127.0.0.1 that forwards to a real server and injects failures: a fault injector for the
server rollout's retry tests, not a stand-in for the server (every answer the client accepts is the server's)."""

from __future__ import annotations

import http.server
import threading
import time
import urllib.error
import urllib.request
from collections import Counter


class FaultProxy:
    """Forwards every request to ``upstream``. ``faults(path, body, seen)`` decides, per request, what goes
    wrong (``seen``: how often this exact request arrived before): ``None`` (forward), an HTTP status to answer
    instead, ``("slow", seconds)``: forward it, but answer only after ``seconds`` (longer than the client
    waits, so the client retries while the server has done the work), ``("hang", seconds)``: forward nothing
    and answer nothing for ``seconds`` (a hung server), or ``"drop"``: close the connection unanswered (a
    server that died with the request)."""

    def __init__(self, upstream: str, faults):
        self.upstream, self.faults, self.seen, self.lock = upstream.rstrip("/"), faults, Counter(), threading.Lock()
        self.injected, self.closed = 0, threading.Event()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                self.forward(None)

            def do_POST(self):
                self.forward(self.rfile.read(int(self.headers.get("Content-Length", 0))))

            def forward(self, body):
                with proxy.lock:
                    key = (self.path, body)
                    seen = proxy.seen[key]
                    proxy.seen[key] += 1
                fault = proxy.faults(self.path, body, seen)
                if isinstance(fault, int):
                    proxy.injected += 1
                    return self.answer(fault, b'{"error": "injected"}')
                if fault == "drop" or (fault is not None and fault[0] == "hang"):
                    proxy.injected += 1
                    if fault != "drop":
                        proxy.closed.wait(fault[1])  # a hang ends when the proxy closes
                    self.close_connection = True
                    return None
                req = urllib.request.Request(f"{proxy.upstream}{self.path}", data=body, method=self.command,
                                             headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=120) as up:
                        status, data = up.status, up.read()
                except urllib.error.HTTPError as e:
                    status, data = e.code, e.read()
                except OSError:  # the upstream is gone (killed): its answer too
                    self.close_connection = True
                    return None
                if fault is not None:  # ("slow", seconds): the work is done, the answer comes too late
                    proxy.injected += 1
                    time.sleep(fault[1])
                try:
                    self.answer(status, data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting

            def answer(self, status, data):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.closed.set()
        self.server.shutdown()
        self.server.server_close()
