"""Run untrusted code: a program or a Python source, with limits, no network, in a throw-away folder.

Shared by the code-execution reward (:class:`rlflow.rewards.CodeReward`) and tools that execute model-written
code (a Python-executor tool in an agent loop). One call is one fresh process tree::

    from rlflow.sandbox import Limits, Sandbox

    box = Sandbox(Limits(wall_s=5, cpu_s=2, memory_mb=256))
    result = box.run_python("print(int(input()) * 2)", stdin="21")
    result.status, result.stdout        # ("ok", "42\\n")
    box.run(["/bin/sh", "-c", "ls"], files={"data.txt": "..."})   # any program

A program that loops, forks without end, allocates without end, floods its output, writes outside its
folder or opens a socket gets a :class:`SandboxResult` saying so (``status``), never an exception
and never harm to the caller: sandboxes are data, like a reward's score.

How each limit holds (Linux; the launcher ``rlflow/_sandbox_launch.py`` applies what the kernel offers
and reports it in ``SandboxResult.layers``):

========================  =========================================================================
limit                     mechanism
========================  =========================================================================
wall time                 the caller's clock; the launcher then kills the whole process tree
CPU time                  RLIMIT_CPU (whole seconds, rounded up): SIGXCPU, then SIGKILL
memory                    RLIMIT_AS per process (address space, so slightly above resident memory)
processes                 RLIMIT_NPROC, counted in the sandbox's own user namespace ("nproc")
output                    stdout + stderr read by the caller, cut at ``max_output_bytes``
files                     RLIMIT_FSIZE per file; a tmpfs of ``disk_mb`` as the folder ("tmpfs")
network                   seccomp refuses ``socket()``; a network namespace without interfaces; Landlock
                          refuses TCP bind/connect
file system               Landlock: writes only in the folder, reads only beneath ``read_paths``
other processes           Landlock signal scoping; seccomp refuses ptrace and process_vm_*
leftovers                 the launcher is a subreaper and kills every descendant when the program ends
========================  =========================================================================

``Sandbox.isolation()`` runs one probe and returns the layers that hold on this machine. With
``require=`` (default ``("landlock", "seccomp")``) a run whose machine cannot provide a required layer
fails with status ``"sandbox_error"`` before any untrusted code runs.
"""

from __future__ import annotations

import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

LAUNCHER = Path(__file__).with_name("_sandbox_launch.py")
# What any program may read: system binaries and libraries, the few /etc files the C library and Python
# use, harmless devices. Not /etc as a whole (shadow, keys), not /dev (disks), not /proc (other processes).
SYSTEM_READ_PATHS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/opt", "/etc/ld.so.cache", "/etc/ld.so.conf",
                     "/etc/ld.so.conf.d", "/etc/localtime", "/etc/passwd", "/etc/group", "/etc/nsswitch.conf",
                     "/etc/alternatives", "/etc/ssl", "/etc/mime.types", "/dev/null", "/dev/zero", "/dev/full",
                     "/dev/random", "/dev/urandom", "/sys/devices/system/cpu")
_PYTHON_PATHS = ("import json, site, sys, sysconfig; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, "
                 "*sysconfig.get_paths().values(), *site.getsitepackages()]))")
STATUSES = ("ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "signal", "sandbox_error")
_MEMORY_MARKERS = ("MemoryError", "std::bad_alloc", "Cannot allocate memory", "out of memory")


@dataclass(frozen=True)
class Limits:
    """What one run may use. Every field must be > 0.

    Args:
        wall_s: wall-clock seconds before the whole process tree is killed (status ``"timeout"``).
        cpu_s: CPU seconds per process (RLIMIT_CPU, rounded up to whole seconds; ``"cpu_limit"``).
        memory_mb: address space per process in MiB (RLIMIT_AS; ``"memory_limit"`` when it shows).
        max_processes: processes and threads at once, the program included (``fork`` fails beyond).
        max_output_bytes: stdout + stderr kept; more ends the run (``"output_limit"``).
        max_file_mb: the largest file the program may write (RLIMIT_FSIZE).
        max_open_files: open file descriptors per process (RLIMIT_NOFILE).
        disk_mb: size of the tmpfs folder, where the machine allows one.
    """

    wall_s: float = 10.0
    cpu_s: float = 10.0
    memory_mb: int = 512
    max_processes: int = 16
    max_output_bytes: int = 1 << 20
    max_file_mb: int = 16
    max_open_files: int = 64
    disk_mb: int = 64

    def __post_init__(self):
        bad = {k: v for k, v in self.__dict__.items() if not (isinstance(v, (int, float)) and v > 0)}
        if bad:
            raise ValueError(f"Limits: every limit must be a number > 0, got {bad}")


@dataclass(frozen=True)
class SandboxResult:
    """What happened.

    ``status`` is one of ``"ok"`` (exit 0), ``"error"`` (another exit code), ``"timeout"`` (wall time),
    ``"cpu_limit"``, ``"memory_limit"``, ``"output_limit"``, ``"signal"`` (killed by another signal) or
    ``"sandbox_error"`` (the sandbox could not run the program; ``stderr`` says why).
    ``layers`` lists the isolation layers that held (see the module docs).
    """

    status: str
    exit_code: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0
    cpu_s: float = 0.0
    max_rss_mb: float = 0.0
    truncated: bool = False
    files: dict[str, bytes] = field(default_factory=dict)
    layers: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Sandbox:
    """Runs programs under :class:`Limits`; thread-safe (each run is its own process tree and folder).

    Args:
        limits: the default limits of every run (a run may pass its own).
        python: the interpreter for :meth:`run_python` (default: this one).
        read_paths: folders the program may read besides the system folders and the interpreter's.
        env: environment variables for the program (added to a minimal ``PATH``/``HOME``/``TMPDIR``/``LANG``).
        require: layers that must hold, else the run ends as ``"sandbox_error"`` before the program starts:
            any of ``"landlock"`` (file system), ``"seccomp"`` (no sockets), ``"userns"``, ``"nproc"``,
            ``"tmpfs"``. Default ``("landlock", "seccomp")``: no network, no write outside the folder.
        namespaces: try a user/network/mount namespace (process counting, tmpfs quota, no interfaces).
        workdir_root: where the throw-away folders are made (default: the system temp folder).
    """

    def __init__(self, limits: Limits | None = None, *, python: str | None = None,
                 read_paths: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 require: tuple[str, ...] = ("landlock", "seccomp"), namespaces: bool = True,
                 workdir_root: str | None = None):
        known = ("landlock", "seccomp", "userns", "nproc", "tmpfs")
        unknown = [r for r in require if r not in known]
        if unknown:
            raise ValueError(f"Sandbox: unknown layer(s) in require: {unknown}; choose from {known}")
        self.limits = limits or Limits()
        self.python = python or sys.executable
        self.read_paths = tuple(read_paths)
        self.env = dict(env or {})
        self.require, self.namespaces = tuple(require), namespaces
        self.workdir_root = workdir_root

    def __repr__(self) -> str:
        return f"Sandbox({self.limits}, require={self.require})"

    # ------------------------------------------------------------------ runs
    def run_python(self, code: str, *, stdin: str | bytes = "", args: list[str] = (),
                   files: dict[str, str | bytes] | None = None, limits: Limits | None = None,
                   collect: tuple[str, ...] = ()) -> SandboxResult:
        """Run Python source ``code`` (saved as ``main.py`` in the folder) with ``args`` and ``stdin``."""
        staged = {"main.py": code, **(files or {})}
        argv = [self.python, "-E", "-s", "-B", "main.py", *map(str, args)]
        return self.run(argv, stdin=stdin, files=staged, limits=limits, collect=collect,
                        read_paths=_python_paths(self.python))

    def run(self, argv: list[str], *, stdin: str | bytes = "", files: dict[str, str | bytes] | None = None,
            limits: Limits | None = None, collect: tuple[str, ...] = (),
            read_paths: tuple[str, ...] = ()) -> SandboxResult:
        """Run ``argv`` (``argv[0]``: a path, or a name found on ``PATH``) in a fresh folder holding ``files``.

        ``collect`` names files to read back from the folder afterwards (``SandboxResult.files``; at most
        ``max_file_mb`` each). The folder is deleted afterwards, whatever happened.
        """
        limits = limits or self.limits
        exe = argv[0] if os.sep in argv[0] else shutil.which(argv[0])
        if exe is None:
            return SandboxResult("sandbox_error", stderr=f"rlflow sandbox: no program {argv[0]!r} on PATH")
        root = Path(tempfile.mkdtemp(prefix="rlflow-sandbox-", dir=self.workdir_root))
        try:
            box = root / "box"
            box.mkdir()
            for name, content in (files or {}).items():
                path = (box / name).resolve()
                if box.resolve() not in path.parents:
                    why = f"rlflow sandbox: file name {name!r} leaves the folder"
                    return SandboxResult("sandbox_error", stderr=why)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(content.encode() if isinstance(content, str) else content)
            reads = tuple(dict.fromkeys((*SYSTEM_READ_PATHS, *read_paths, *self.read_paths,
                                         str(Path(exe).resolve().parent))))
            return self._launch([exe, *argv[1:]], box, stdin, limits, reads, collect)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def isolation(self) -> tuple[str, ...]:
        """The layers that hold on this machine (one probe run of ``/bin/true``, cached per setting)."""
        return _probe(self.namespaces)

    # ------------------------------------------------------------------ internals
    def _launch(self, argv, box: Path, stdin, limits: Limits, reads, collect) -> SandboxResult:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(box), "TMPDIR": str(box), "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", **self.env}
        status_read, status_write = os.pipe()
        config = {"argv": list(argv), "env": env, "box": str(box), "read_paths": list(reads), "status_fd": status_write,
                  "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb, "max_processes": limits.max_processes,
                  "max_file_mb": limits.max_file_mb, "max_open_files": limits.max_open_files,
                  "disk_mb": limits.disk_mb, "namespaces": self.namespaces, "landlock": True, "seccomp": True,
                  "require": list(self.require), "collect": list(collect), "out": str(box.parent / "out")}
        start = time.monotonic()
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", str(LAUNCHER), json.dumps(config)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=(status_write,), start_new_session=True, cwd=str(box))
        except OSError as e:
            os.close(status_read)
            return SandboxResult("sandbox_error", stderr=f"rlflow sandbox: cannot start the launcher: {e}")
        finally:
            os.close(status_write)
        data = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
        out, err, report, why = _communicate(proc, data, status_read, limits, start)
        files = _collect(box.parent / "out", collect) if collect else {}
        return _result(why, proc.returncode, out, err, report, time.monotonic() - start, limits, files, self.require)


def _communicate(proc: subprocess.Popen, data: bytes, status_fd: int, limits: Limits, start: float):
    """Feed stdin, read stdout/stderr/status until all close; stop the tree on wall time or output flood."""
    sel = selectors.DefaultSelector()
    buffers = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    status = bytearray()
    status_file = os.fdopen(status_fd, "rb", buffering=0)
    for f in (proc.stdout, proc.stderr, status_file):
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    if data:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    sent, why, stopped_at, killed_at = 0, None, None, None
    while sel.get_map():
        now = time.monotonic()
        if why is None and now - start > limits.wall_s:
            why, stopped_at = "timeout", now
            _stop(proc)
        if stopped_at is not None and killed_at is None and now - stopped_at > 2.0:
            _kill_session(proc)  # the launcher did not finish within 2 s of the stop: kill its session
            killed_at = now
        if killed_at is not None and now - killed_at > 2.0:
            break  # a process outside the session still holds the pipes: stop reading, never hang the caller
        timeout = max(0.0, limits.wall_s - (now - start)) if why is None else 0.1
        for key, _ in sel.select(timeout):
            f = key.fileobj
            if f is proc.stdin:
                try:
                    sent += os.write(f.fileno(), data[sent : sent + 65536])
                except (BrokenPipeError, OSError):
                    sent = len(data)
                if sent >= len(data):
                    sel.unregister(f)
                    f.close()
                continue
            try:
                chunk = os.read(f.fileno(), 65536)
            except OSError:
                chunk = b""
            if not chunk:
                sel.unregister(f)
                continue
            if f is status_file:
                status += chunk
                continue
            buffers[f] += chunk
            if len(buffers[proc.stdout]) + len(buffers[proc.stderr]) > limits.max_output_bytes and why is None:
                why, stopped_at = "output_limit", time.monotonic()
                _stop(proc)
    for f in (proc.stdin, proc.stdout, proc.stderr, status_file):
        if not f.closed:
            f.close()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        proc.wait()
    try:
        report = json.loads(bytes(status)) if status else {}
    except ValueError:
        report = {}
    return bytes(buffers[proc.stdout]), bytes(buffers[proc.stderr]), report, why


def _stop(proc: subprocess.Popen) -> None:
    """Ask the launcher to kill the program's whole tree and report (it handles SIGTERM)."""
    try:
        proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _collect(out: Path, names) -> dict[str, bytes]:
    """The files the launcher copied out of the folder (it checked names and sizes)."""
    return {name: (out / name).read_bytes() for name in names if (out / name).is_file()}


def _result(why, returncode, out, err, report, wall, limits: Limits, files, require) -> SandboxResult:
    text_out, text_err = out.decode(errors="replace"), err.decode(errors="replace")
    max_out = limits.max_output_bytes
    truncated = len(out) + len(err) > max_out
    if truncated:
        text_out, text_err = text_out[:max_out], text_err[: max(0, max_out - len(text_out))]
    layers = tuple(report.get("layers", ()))
    common = dict(exit_code=report.get("exit_code"), signal=report.get("signal"), stdout=text_out, stderr=text_err,
                  wall_s=wall, cpu_s=report.get("cpu_s", 0.0), max_rss_mb=report.get("max_rss_mb", 0.0),
                  truncated=truncated, files=files, layers=layers)
    if not report:  # the launcher was killed (it did not end within 2 s of the stop) or could not start
        return SandboxResult(why or "sandbox_error", **(common | {"stderr": f"rlflow sandbox: the launcher "
                                                                            f"failed (exit {returncode})\n{text_err}"}))
    missing = [r for r in require if r not in layers]
    if missing:  # the launcher or its child refused to run the program (nothing untrusted ran)
        note = f"rlflow sandbox: required isolation unavailable on this machine: {', '.join(missing)}\n"
        return SandboxResult("sandbox_error", **(common | {"stderr": note + text_err}))
    if why is not None:
        return SandboxResult(why, **common)
    if report.get("exit_code") == 126 and "rlflow sandbox: cannot start" in text_err:
        return SandboxResult("sandbox_error", **common)
    sig = report.get("signal")
    if sig in (signal.SIGXCPU,) or (sig == signal.SIGKILL and report.get("cpu_s", 0) >= int(-(-limits.cpu_s // 1))):
        return SandboxResult("cpu_limit", **common)
    if report.get("exit_code") == 0:
        return SandboxResult("ok", **common)
    if any(m in text_err for m in _MEMORY_MARKERS):
        return SandboxResult("memory_limit", **common)
    return SandboxResult("signal" if sig is not None else "error", **common)


@functools.lru_cache(maxsize=None)
def _python_paths(python: str) -> tuple[str, ...]:
    """What an interpreter reads: its prefixes, standard library and site-packages (asked once per interpreter).

    Not ``sys.path`` as a whole: its first entry is the caller's script folder, which may hold the data.
    """
    try:
        out = subprocess.run([python, "-I", "-c", _PYTHON_PATHS], capture_output=True, text=True, timeout=60).stdout
        paths = json.loads(out)
    except (OSError, ValueError, subprocess.SubprocessError):
        paths = []
    paths.append(str(Path(python).resolve().parent))
    return tuple(dict.fromkeys(p for p in paths if p and os.path.isabs(p)))


@functools.lru_cache(maxsize=None)
def _probe(namespaces: bool) -> tuple[str, ...]:
    box = Sandbox(Limits(wall_s=30, cpu_s=5), require=(), namespaces=namespaces)
    return box.run(["/bin/true"]).layers

