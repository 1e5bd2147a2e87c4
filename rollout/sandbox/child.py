"""The sandbox's child process: isolate itself, then run the agent's code and its tests, reporting each event.

Run by rollout/sandbox/parent.py as `python -I -S -B <this file>` (no site, no user path, no bytecode written):
standard library only, it imports nothing of the project. It reads its spec (code, tests, limits, the event
pipe's number and the token that signs each event) from stdin and, trusted and still privileged, applies, each
where this machine allows it, before the agent's code runs:

  rlimits           CPU seconds, address space, file size, processes (per uid), open files, no core files
  namespaces        a new network namespace (no interface up: no connection anywhere, 127.0.0.1 included); a
                    new mount namespace: the working directory, /tmp, /var/tmp, /dev/shm and /run/lock become
                    private size-capped tmpfs that vanish with the execution, /root and /home are hidden (the
                    interpreter's own prefix is bind-mounted back read-only); a new pid namespace with its own
                    /proc: the agent's code runs as its pid 1, sees and can signal only its own processes, and
                    when it exits the kernel kills whatever it left behind. Root: plain unshare(2); not root:
                    inside a new user namespace (where the kernel allows unprivileged ones)
  uid               as root: setgroups([]), setgid/setuid to the uid the parent claimed for this execution, so
                    it can write nowhere it was not given, cannot signal the worker, cannot read other
                    processes' environments, and RLIMIT_NPROC counts only its processes
  no_new_privs      setuid binaries cannot raise it back; the parent-death signal kills it if the worker dies
  audit             fallback only (no network namespace): an audit hook refuses sockets, process spawning,
                    ctypes, signals to other processes, writes outside the working directory and reads of
                    /proc/<other pid>; best effort, documented as such in docs/environments.md

Then it loads the setup and the code as a fresh `__main__` module and runs each test in a copy of its namespace,
each under a `test_s` alarm, and writes one JSON line per event (ready, load, start, test, output, done).
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import io
import json
import linecache
import os
import resource
import signal
import sys
import time
import traceback
from collections.abc import Callable

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWUSER, CLONE_NEWPID = 0x20000, 0x40000000, 0x10000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
LINUX_CAPABILITY_VERSION_3 = 0x20080522

# Imported before the uid drops when the stdlib is not readable by the sandbox uid (and cannot be bind-mounted).
PRELOADED = ("math", "cmath", "re", "collections", "itertools", "functools", "heapq", "bisect", "string", "random",
             "statistics", "fractions", "decimal", "copy", "typing", "hashlib", "operator", "datetime", "shutil",
             "struct", "array", "zlib", "textwrap", "unicodedata", "dataclasses", "enum", "pathlib")

# The audit-hook fallback's rules.
BLOCKED_IMPORTS = {"_socket", "socket", "_ssl", "ssl", "_posixsubprocess", "subprocess", "_ctypes", "ctypes",
                   "multiprocessing", "_multiprocessing", "asyncio", "pty"}
SPAWN = {"os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.fork", "os.forkpty", "subprocess.Popen",
         "os.startfile", "pty.spawn"}
# event -> the index (or indices) of its path arguments that must lie inside the working directory; None: refused
PATH_EVENTS: dict[str, int | tuple[int, ...] | None] = {
    "open": 0, "os.remove": 0, "os.rmdir": 0, "os.mkdir": 0, "os.rename": (0, 1), "os.replace": (0, 1),
    "os.symlink": (0, 1), "os.link": (0, 1), "os.chmod": 0, "os.chown": 0, "os.truncate": 0, "shutil.rmtree": 0,
    "os.utime": 0, "os.chdir": None, "os.chroot": None,
}

LIBC = ctypes.CDLL(None, use_errno=True)


class Report:
    """The events to the parent (each signed with the token the agent's code never sees), and what was set up."""

    def __init__(self, token: str, fd: int) -> None:
        self.token, self.fd = token, fd
        self.isolation: list[str] = []  # the mechanisms in force
        self.notes: list[str] = []  # those asked for that could not be set

    def emit(self, **event: object) -> None:
        event["token"] = self.token
        data = (json.dumps(event) + "\n").encode()
        try:
            while data:
                data = data[os.write(self.fd, data):]
        except OSError:
            pass


def cap(text: object, n: int) -> str:
    text = str(text)
    return text if len(text) <= n else text[: n - 20] + " ...[truncated]"


def libc_call(name: str, *args: object) -> None:
    if getattr(LIBC, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, name + ": " + os.strerror(err))


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else s.encode()

    libc_call("mount", enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))


def traversable(path: str) -> bool:
    """Whether every directory up to `path` can be entered by any uid."""
    path = os.path.realpath(path)
    while path != "/":
        try:
            if not os.stat(path).st_mode & 0o001:
                return False
        except OSError:
            return False
        path = os.path.dirname(path)
    return True


# -- isolation, in the order main() applies it


def set_rlimits(limits: dict, report: Report) -> None:
    for name, value in (
        ("RLIMIT_CORE", (0, 0)),
        ("RLIMIT_CPU", (limits["cpu_s"], limits["cpu_s"] + 1)),
        ("RLIMIT_AS", (limits["memory"], limits["memory"])),
        ("RLIMIT_FSIZE", (limits["fsize"], limits["fsize"])),
        ("RLIMIT_NOFILE", (limits["nofile"], limits["nofile"])),
        ("RLIMIT_NPROC", (limits["nproc"], limits["nproc"])),
    ):
        try:
            resource.setrlimit(getattr(resource, name), value)
        except (ValueError, OSError) as exc:
            report.notes.append("rlimit " + name + ": " + str(exc))
    report.isolation.append("rlimits")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails with EFBIG instead of killing


def unshare(root: bool, owner: int, report: Report) -> tuple[bool, bool]:
    """New network and mount namespaces (and a user namespace when not root), a pid namespace where allowed:
    (namespaces, pid namespace)."""
    base = CLONE_NEWNS | CLONE_NEWNET | (0 if root else CLONE_NEWUSER)
    pidns = False
    try:
        try:
            libc_call("unshare", base | CLONE_NEWPID)
            pidns = True
        except OSError:
            libc_call("unshare", base)
            report.notes.append("no pid namespace: background processes are killed by the parent only")
        if not root:
            gid = os.getgid()
            with open("/proc/self/setgroups", "w") as f:
                f.write("deny")
            with open("/proc/self/uid_map", "w") as f:
                f.write(f"{owner} {owner} 1")
            with open("/proc/self/gid_map", "w") as f:
                f.write(f"{gid} {gid} 1")
    except OSError as exc:
        report.notes.append("namespaces unavailable (" + str(exc) + "): audit-hook fallback")
        return False, False
    report.isolation.extend(["netns", "mountns"] + ([] if root else ["userns"]))
    return True, pidns


def become_pid1(report: Report) -> None:
    """Fork: the child goes on as pid 1 of the new pid namespace (it cannot signal, or with its own /proc see,
    anything outside, and when it exits the kernel kills every process left in the namespace); this process only
    waits for it and exits with its status."""
    child = os.fork()
    if child == 0:
        report.isolation.append("pidns")
        return
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except ChildProcessError:
            os._exit(1)
        except InterruptedError:
            continue
    os._exit(os.waitstatus_to_exitcode(status) % 256)


def private_mounts(spec: dict, owner: int, pidns: bool, report: Report) -> None:
    """Hide /root and /home (the interpreter's directories bind-mounted back read-only), private tmpfs for the
    working directory and the /tmp-like directories, and with a pid namespace its own /proc."""
    mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    hide = spec["hide"]
    expose = [p for p in spec["expose"] if any(p == h or p.startswith(h + "/") for h in hide)]
    handles = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in expose if os.path.isdir(p)}
    for d in hide:
        if os.path.isdir(d) and not os.path.islink(d):
            mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for p, fd in handles.items():
        os.makedirs(p, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC, None)
        mount(None, p, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
        os.close(fd)
    for d in spec["private_dirs"]:
        if os.path.isdir(d) and not os.path.islink(d):
            mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=8m,mode=1777")
    work = spec["workdir"]
    os.makedirs(work, exist_ok=True)
    gid = owner if spec["uid"] is not None else os.getgid()
    options = f"size={spec['limits']['disk_mb']}m,mode=0700,uid={owner},gid={gid}"
    mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, options)
    report.isolation.append("private-tmp")
    if pidns:
        try:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
            report.isolation.append("own-proc")
        except OSError as exc:
            report.notes.append("/proc of the host stays visible (" + str(exc) + ")")


def drop_uid(uid: int, namespaces: bool, report: Report) -> None:
    """As root: no supplementary groups, the execution's own gid and uid."""
    if not namespaces and not traversable(os.path.dirname(os.__file__)):
        # The standard library cannot be read by other uids and cannot be bind-mounted here: import the common
        # modules now; an agent's import of anything else fails once the uid is dropped.
        for m in PRELOADED:
            with contextlib.suppress(ImportError):
                __import__(m)
        report.notes.append("the stdlib is not readable by the sandbox uid: only preloaded modules importable")
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    report.isolation.append("uid")


def drop_capabilities(report: Report) -> None:
    """Not root, in a user namespace: drop the capabilities it gave."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    data = (ctypes.c_uint32 * 6)()
    try:
        libc_call("capset", ctypes.byref(Header(LINUX_CAPABILITY_VERSION_3, 0)), data)
    except OSError as exc:
        report.notes.append("capset: " + str(exc))


def no_new_privileges(report: Report) -> None:
    """Setuid binaries cannot regain privileges; the worker's death kills this process."""
    try:
        zero = ctypes.c_ulong(0)
        libc_call("prctl", PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), zero, zero, zero)
        libc_call("prctl", PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), zero, zero, zero)  # cleared by setuid
        if os.getppid() == 1:
            os._exit(1)  # the worker died before the death signal was armed
        report.isolation.append("no_new_privs")
    except OSError as exc:
        report.notes.append("prctl: " + str(exc))


class AuditHook:
    """The fallback without namespaces: refuse sockets, spawning, ctypes, signals to others, writes outside the
    working directory and reads of another process's /proc entry."""

    def __init__(self, work: str) -> None:
        self.me = os.getpid()
        self.work_real = os.path.realpath(work)

    def __call__(self, event: str, args: tuple) -> None:
        if event == "import" and args[0] in BLOCKED_IMPORTS:
            raise ImportError("sandbox: importing " + args[0] + " is blocked (no network, no processes)")
        if event.startswith("socket.") or event.startswith("ctypes.") or event in SPAWN:
            raise PermissionError("sandbox: " + event + " is blocked")
        if event in ("os.kill", "os.killpg") and args[0] not in (self.me, 0):
            raise PermissionError("sandbox: signalling another process is blocked")
        if event == "open":
            self.check_open(args)
        elif event in PATH_EVENTS:
            self.check_paths(event, args)

    def inside(self, path: object) -> bool:
        try:
            if isinstance(path, int):
                return True
            path = os.fsdecode(path)
        except TypeError:
            return True
        real = os.path.realpath(path)
        return real == self.work_real or real.startswith(self.work_real + "/")

    def check_open(self, args: tuple) -> None:
        path, mode = args[0], args[1]
        if isinstance(path, str | bytes) and os.fsdecode(path).startswith("/proc/"):
            parts = os.fsdecode(path).split("/")
            if len(parts) > 2 and parts[2] not in ("self", "thread-self", str(self.me)):
                raise PermissionError("sandbox: reading another process's /proc entry is blocked")
        flags = args[2] if len(args) > 2 else 0
        writing = (mode and any(c in str(mode) for c in "wax+")) or (flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        if writing and not self.inside(path):
            raise PermissionError("sandbox: writing outside the working directory is blocked")

    def check_paths(self, event: str, args: tuple) -> None:
        which = PATH_EVENTS[event]
        if which is None:
            raise PermissionError("sandbox: " + event + " is blocked")
        for i in which if isinstance(which, tuple) else (which,):
            if i < len(args) and not self.inside(args[i]):
                raise PermissionError("sandbox: " + event + " outside the working directory is blocked")


def install_audit_hook(work: str, report: Report) -> None:
    hook = AuditHook(work)
    for m in [m for m in sys.modules if m in BLOCKED_IMPORTS or m.startswith("ctypes.")]:
        del sys.modules[m]
    for name in ("ctypes", "LIBC"):  # not one global away from the agent's frames either
        globals().pop(name, None)
    sys.addaudithook(hook)
    report.isolation.append("audit")


def isolate(spec: dict, report: Report) -> None:
    """Everything above, each where this machine allows it; then into the working directory, niced."""
    limits = spec["limits"]
    root = os.geteuid() == 0
    uid = spec["uid"]
    owner = uid if uid is not None else os.getuid()
    set_rlimits(limits, report)
    namespaces, pidns = unshare(root, owner, report) if spec["namespaces"] else (False, False)
    if pidns:
        become_pid1(report)
    if namespaces:
        private_mounts(spec, owner, pidns, report)
    if root and uid is not None:
        drop_uid(uid, namespaces, report)
    if not root and namespaces:
        drop_capabilities(report)
    no_new_privileges(report)
    os.chdir(spec["workdir"])
    with contextlib.suppress(OSError):
        os.nice(limits["nice"])
    if not namespaces:
        install_audit_hook(spec["workdir"], report)


# -- the agent's code and its tests


class Capped(io.TextIOBase):
    """stdout or stderr of the agent's code, kept up to `limit` characters (the rest counted)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.parts: list[str] = []
        self.size, self.dropped = 0, 0

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        s = str(s)
        room = self.limit - self.size
        if room > 0:
            self.parts.append(s[:room])
            self.size += min(room, len(s))
        self.dropped += max(0, len(s) - max(room, 0))
        return len(s)

    def value(self) -> str:
        return "".join(self.parts)


class TestTimeout(BaseException):
    __test__ = False  # not a pytest test class


def on_alarm(signum: int, frame: object) -> None:
    raise TestTimeout()


def limited(fn: Callable[[], object], seconds: float) -> object:
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def tb_text(exc: BaseException) -> str:
    """The exception and its last three frames, this file's left out."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]
    lines = traceback.format_list(frames[-3:]) + traceback.format_exception_only(type(exc), exc)
    return "".join(lines).rstrip()


def register(name: str, source: str) -> None:
    """Let tracebacks show the lines of `source` under `name`."""
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)


def fresh_main() -> dict:
    """A fresh __main__ module for the agent's code (pickle, dataclasses and `import __main__` find it); this
    file's globals (the token's holder among them) are then not one import away, though reachable via frames."""
    module = type(sys)("__main__")
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = module
    return module.__dict__


def load(spec: dict, namespace: dict) -> str | None:
    """Run the setup then the code in `namespace`; the load error, or None."""
    test_s = spec["limits"]["test_s"]
    try:
        register("setup.py", spec["setup"])
        register("solution.py", spec["code"])
        limited(lambda: exec(compile(spec["setup"], "setup.py", "exec"), namespace), test_s)
        limited(lambda: exec(compile(spec["code"], "solution.py", "exec"), namespace), test_s)
    except TestTimeout:
        return f"TimeoutError: loading the code took more than {test_s:g} s"
    except SyntaxError as exc:
        return "".join(traceback.format_exception_only(type(exc), exc)).rstrip()
    except BaseException as exc:
        return tb_text(exc)
    return None


def explain(source: str, namespace: dict, test_s: float) -> str:
    """For a failed `assert a == b`: what `a` gave (or raised)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return ""
    test = tree.body[0].test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return ""
    try:
        got = limited(lambda: eval(compile(ast.Expression(test.left), "<test>", "eval"), namespace), test_s)
        return "\n  got: " + cap(repr(got), 300)
    except TestTimeout:
        return ""
    except BaseException as exc:
        return "\n  raised: " + cap(type(exc).__name__ + ": " + str(exc), 300)


def run_test(spec: dict, index: int, source: str, namespace: dict) -> tuple[str, str]:
    """One test in a copy of the solution's namespace: (status, detail)."""
    test_s = spec["limits"]["test_s"]
    name = f"test_{index}.py"
    try:
        register(name, source)
        limited(lambda: exec(compile(source, name, "exec"), dict(namespace)), test_s)
    except TestTimeout:
        return "timeout", f"took more than {test_s:g} s"
    except AssertionError as exc:
        detail = tb_text(exc)
        if spec["explain"]:
            detail += explain(source, dict(namespace), test_s)
        return "failed", detail
    except BaseException as exc:
        return "error", tb_text(exc)
    return "passed", ""


def run_agent_code(spec: dict, report: Report) -> None:
    limits = spec["limits"]
    signal.signal(signal.SIGALRM, on_alarm)
    stdout, stderr = Capped(limits["output_chars"]), Capped(limits["output_chars"])
    sys.stdout, sys.stderr = stdout, stderr
    namespace = fresh_main()
    load_error = load(spec, namespace)
    report.emit(event="load", ok=load_error is None, error=cap(load_error or "", limits["detail_chars"] * 2))
    if load_error is None:
        for i, test in enumerate(spec["tests"]):
            report.emit(event="start", index=i)
            t0 = time.perf_counter()
            status, detail = run_test(spec, i, test["source"], namespace)
            report.emit(event="test", index=i, status=status, detail=cap(detail, limits["detail_chars"]),
                        seconds=time.perf_counter() - t0)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    report.emit(event="output", stdout=stdout.value(), stderr=stderr.value(), dropped=stdout.dropped + stderr.dropped)


def main() -> None:
    spec = json.loads(sys.stdin.buffer.read())
    sys.stdin = io.StringIO("")
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)
    report = Report(spec["token"], spec["result_fd"])
    isolate(spec, report)
    report.emit(event="ready", isolation=report.isolation, notes=report.notes, pid=os.getpid())
    run_agent_code(spec, report)
    report.emit(event="done")
    os._exit(0)


if __name__ == "__main__":
    main()
