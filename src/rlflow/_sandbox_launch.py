"""The sandbox launcher: run by :mod:`rlflow.sandbox` as ``python -I -S _sandbox_launch.py CONFIG_JSON``.

Standard library only, and never imports rlflow (it must start in milliseconds). It applies every
isolation layer the kernel offers, runs the program as its child, and reports on the file descriptor
``status_fd``: exit code or signal, CPU seconds, peak memory, and which layers held.

Layers (each applied when available; ``layers`` in the report lists those that held):

- ``userns``: a new user, network and mount namespace. No network interface but a loopback that is
  down; the process count below is counted for this sandbox alone. Root first makes its *real* uid
  ``nobody`` (keeping effective uid 0 for file access), because the kernel exempts real uid 0 from
  the process limit.
- ``tmpfs``: the working folder is a size-limited tmpfs (a disk quota), in that mount namespace.
- ``nproc``: at most ``max_processes`` tasks (processes and threads), RLIMIT_NPROC.
- ``rlimits``: CPU seconds (SIGXCPU, then SIGKILL one second later), address space, file size,
  open files, no core dumps.
- ``landlock``: writes only inside the working folder (and /dev/null); reads only beneath
  ``read_paths`` (the interpreter's folders and system folders); TCP bind/connect refused (ABI 4);
  no signals to, and no abstract unix sockets of, processes outside the sandbox (ABI 6).
- ``seccomp``: ``socket()``, ``io_uring``, ``ptrace``, ``process_vm_*``, ``bpf`` and
  ``perf_event_open`` fail with an error; foreign system-call ABIs (x32, i386) are refused.
- ``reaper``: the launcher is a child subreaper: when the program ends, or on SIGTERM from the
  parent, every descendant (even one that called ``setsid``) is killed before the report.
"""

import ctypes
import json
import os
import platform
import resource
import signal
import struct
import sys
import time

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_REC, MS_PRIVATE, MS_NOSUID, MS_NODEV = 0x4000, 0x40000, 0x2, 0x4
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER = 38, 22, 36
NOBODY = 65534

# Landlock (include/uapi/linux/landlock.h)
LL_CREATE, LL_ADD_RULE, LL_RESTRICT = 444, 445, 446
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_WRITE_DIR_V1 = sum(1 << b for b in range(4, 13))  # remove dir/file, make char/dir/reg/sock/fifo/block/sym
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX, SCOPE_SIGNAL = 1 << 0, 1 << 1

# seccomp: (audit arch, {name: number}) per machine
SECCOMP_ARCH = {
    "x86_64": (0xC000003E, {"socket": 41, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
                            "bpf": 321, "perf_event_open": 298, "io_uring_setup": 425}),
    "aarch64": (0xC00000B7, {"socket": 198, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
                             "bpf": 280, "perf_event_open": 241, "io_uring_setup": 425}),
}
EACCES, EPERM, ENOSYS = 13, 1, 38

libc = ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def write_file(path, text):
    with open(path, "w") as f:
        f.write(text)


def enter_namespaces(box, disk_mb):
    """New user + network + mount namespace; a tmpfs on ``box`` holding the staged files."""
    uid, gid = os.geteuid(), os.getegid()
    if uid == 0:  # the kernel never applies RLIMIT_NPROC to real uid 0: make the real uid nobody
        os.setresgid(NOBODY, gid, gid)
        os.setresuid(NOBODY, uid, uid)
    _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS), "unshare")
    write_file("/proc/self/setgroups", "deny")
    write_file("/proc/self/uid_map", f"{uid} {uid} 1")
    write_file("/proc/self/gid_map", f"{gid} {gid} 1")
    layers = ["userns"]
    try:
        _check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
        staged = read_tree(box)
        options = f"size={int(disk_mb)}m,mode=0700".encode()
        _check(libc.mount(b"tmpfs", box.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options), "mount tmpfs")
        write_tree(box, staged)
        layers.append("tmpfs")
    except OSError:
        pass  # the run goes on without a disk quota; the report says so
    return layers


def read_tree(root):
    files = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, root)] = (f.read(), os.stat(path).st_mode & 0o777)
    return files


def write_tree(root, files):
    for rel, (data, mode) in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, mode)


def collect(cfg):
    """Copy the files the caller asked for from the folder (a tmpfs only this namespace sees) to ``out``."""
    limit = cfg["max_file_mb"] * 2**20
    for name in cfg["collect"]:
        src = os.path.realpath(os.path.join(cfg["box"], name))
        if not src.startswith(os.path.realpath(cfg["box"]) + os.sep) or not os.path.isfile(src):
            continue
        if os.path.getsize(src) <= limit:
            dst = os.path.join(cfg["out"], name)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with open(src, "rb") as f, open(dst, "wb") as g:
                g.write(f.read(limit + 1)[:limit])


def process_count(uid):
    """Tasks (threads included) of ``uid`` now, from /proc (for the limit without a user namespace)."""
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                if int(fields["Uid"].split()[0]) == uid:
                    count += int(fields.get("Threads", "1"))
            except (OSError, KeyError, ValueError):
                continue
    return count


def set_limits(cfg):
    """The program's own resource limits (applied in the child, before exec)."""
    cpu = max(1, int(-(-cfg["cpu_s"] // 1)))  # whole seconds, rounded up
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    memory = int(cfg["memory_mb"] * 2**20)
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    size = int(cfg["max_file_mb"] * 2**20)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["max_open_files"], cfg["max_open_files"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def landlock(box, read_paths):
    """Writes only in ``box``, reads only beneath ``read_paths``; returns the ABI used, or 0."""
    abi = libc.syscall(LL_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return 0
    write = FS_WRITE_FILE | FS_WRITE_DIR_V1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
    handled_fs = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR | write | (FS_IOCTL_DEV if abi >= 5 else 0)
    handled_net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL if abi >= 6 else 0
    attr = struct.pack("QQQ", handled_fs, handled_net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = _check(libc.syscall(LL_CREATE, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0)), "landlock ruleset")
    file_rights = FS_EXECUTE | FS_READ_FILE | FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0) | (
        FS_IOCTL_DEV if abi >= 5 else 0)
    rules = [(p, FS_EXECUTE | FS_READ_FILE | FS_READ_DIR) for p in read_paths]
    rules += [(box, handled_fs), ("/dev/null", FS_READ_FILE | FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0)
                                  | (FS_IOCTL_DEV if abi >= 5 else 0))]
    for path, rights in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a read path that does not exist here
        if not os.path.isdir(path):
            rights &= file_rights
        rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd), 12)
        _check(libc.syscall(LL_ADD_RULE, ruleset, 1, rule, 0), f"landlock rule {path}")
        os.close(fd)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(libc.syscall(LL_RESTRICT, ruleset, 0), "landlock restrict")
    os.close(ruleset)
    return abi


def seccomp():
    """Refuse networking and process-inspection system calls; True when the filter is on."""
    arch = SECCOMP_ARCH.get(platform.machine())
    if arch is None:
        return False
    audit_arch, numbers = arch

    def stmt(code, k):
        return struct.pack("HBBI", code, 0, 0, k)

    def jump(code, k, jt, jf):
        return struct.pack("HBBI", code, jt, jf, k)

    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, errno = 0x7FFF0000, 0x00050000
    prog = [stmt(ld, 4), jump(jeq, audit_arch, 1, 0), stmt(ret, errno | ENOSYS), stmt(ld, 0)]
    if audit_arch == 0xC000003E:  # x32 system calls share the x86_64 audit arch: refuse them
        prog += [jump(jge, 0x40000000, 0, 1), stmt(ret, errno | ENOSYS)]
    for name, nr in numbers.items():
        prog += [jump(jeq, nr, 0, 1), stmt(ret, errno | (EACCES if name == "socket" else EPERM))]
    prog.append(stmt(ret, allow))
    filters = ctypes.create_string_buffer(b"".join(prog))
    fprog = struct.pack("HxxxxxxP", len(prog), ctypes.addressof(filters))
    fprog_buf = ctypes.create_string_buffer(fprog, len(fprog))
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(2), ctypes.c_void_p(ctypes.addressof(fprog_buf)), 0, 0), "seccomp")
    return True


def descendants():
    """Pids of every live descendant of this process (children files of each task)."""
    found, todo = [], [os.getpid()]
    while todo:
        pid = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def kill_all():
    """SIGKILL every descendant and reap until none is left (orphans re-parent to us: we are a subreaper)."""
    for _ in range(10000):
        for pid in descendants():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            return
        time.sleep(0.001)


def child(cfg, report_fd, layers_fd):
    """In the forked child: limits, Landlock, seccomp, then exec the program.

    The layers that held are written to ``layers_fd`` (close-on-exec, so the launcher reads to EOF).
    A required layer that did not hold ends the child (exit 125) before any untrusted code runs.
    """
    os.close(report_fd)
    os.chdir(cfg["box"])
    set_limits(cfg)
    layers = []
    if cfg["landlock"] and landlock(cfg["box"], cfg["read_paths"]):
        layers.append("landlock")
    if cfg["seccomp"] and seccomp():
        layers.append("seccomp")
    os.write(layers_fd, json.dumps(layers).encode())
    missing = [x for x in cfg["require"] if x in ("landlock", "seccomp") and x not in layers]
    if missing:
        os.write(2, f"rlflow sandbox: required isolation unavailable: {', '.join(missing)}\n".encode())
        os._exit(125)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])


def read_all(fd):
    chunks = []
    while True:
        try:
            data = os.read(fd, 4096)
        except InterruptedError:
            continue
        if not data:
            os.close(fd)
            return b"".join(chunks)
        chunks.append(data)


def main():
    cfg = json.loads(sys.argv[1])
    report_fd = cfg["status_fd"]
    report = {"layers": [], "notes": []}
    stop = {"signal": None}

    def on_term(signum, frame):  # the parent's wall-time limit (or Ctrl-C): end everything, then report
        stop["signal"] = signum
        kill_all()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if cfg["namespaces"]:
        try:
            report["layers"] += enter_namespaces(cfg["box"], cfg["disk_mb"])
        except OSError as e:
            report["notes"].append(f"no user namespace ({e})")
    _check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "subreaper")
    report["layers"].append("reaper")
    nproc = cfg["max_processes"] + 1  # + this launcher
    if "userns" in report["layers"]:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        report["layers"].append("nproc")
    elif os.getuid() != 0:  # counted with the user's other processes: approximate
        nproc += process_count(os.getuid())
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        report["layers"].append("nproc-approx")
    missing = [x for x in cfg["require"] if x in ("userns", "tmpfs", "nproc") and x not in report["layers"]]
    if missing:  # refuse before any untrusted code runs
        os.write(report_fd, json.dumps(report).encode())
        return
    read_fd, write_fd = os.pipe()
    os.set_inheritable(write_fd, False)
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_fd)
            child(cfg, report_fd, write_fd)
        except BaseException as e:  # noqa: BLE001 - a failure to start is reported; nothing runs unsandboxed
            os.write(2, f"rlflow sandbox: cannot start {cfg['argv'][0]}: {e}\n".encode())
        os._exit(126)
    os.close(write_fd)
    layers = read_all(read_fd)
    if layers:
        report["layers"] += json.loads(layers)
    while True:
        try:
            _, status, usage = os.wait4(pid, 0)
            break
        except InterruptedError:
            continue
        except ChildProcessError:  # reaped by the SIGTERM handler
            status, usage = None, None
            break
    report["wall_s"] = time.monotonic() - start
    kill_all()
    if cfg["collect"]:
        try:
            collect(cfg)
        except OSError as e:
            report["notes"].append(f"collecting files failed: {e}")
    if status is not None:
        if os.WIFSIGNALED(status):
            report["signal"] = os.WTERMSIG(status)
        else:
            report["exit_code"] = os.WEXITSTATUS(status)
        report["cpu_s"] = usage.ru_utime + usage.ru_stime
        report["max_rss_mb"] = usage.ru_maxrss / 1024
    report["stopped_by"] = stop["signal"]
    os.write(report_fd, json.dumps(report).encode())
    os.close(report_fd)


if __name__ == "__main__":
    main()
