"""The agent's process isolates itself here, trusted and still privileged, before any of the agent's code runs.

Loaded by rollout/sandbox/child.py (by path: standard library only). `isolate(spec, report)` applies, each where
this machine allows it:

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
                    /proc/<other pid>; best effort, no security boundary (docs/environments.md). With
                    `require_namespaces` in the spec there is no fallback: `isolate` returns False and the
                    agent's code is never loaded.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import sys

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
    """What was set up: the mechanisms in force and those asked for that could not be set."""

    def __init__(self) -> None:
        self.isolation: list[str] = []
        self.notes: list[str] = []


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
    # `binds` (the shell sandbox, rollout/sandbox/shell.py): host directories that stay visible at their own path,
    # writable or not, even under a private tmpfs; one of them is then the working directory (no tmpfs over it)
    binds = [(p, bool(w), os.open(p, os.O_PATH | os.O_DIRECTORY)) for p, w in spec.get("binds", [])]
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
    for p, writable, fd in binds:
        os.makedirs(p, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC, None)
        mount(None, p, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | (0 if writable else MS_RDONLY), None)
        os.close(fd)
    work = spec["workdir"]
    if not binds:
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


def isolate(spec: dict, report: Report) -> bool:
    """Everything above, each where this machine allows it; then into the working directory, niced. False: the
    spec requires namespaces and this machine gave none (nothing of the agent's may run then)."""
    limits = spec["limits"]
    root = os.geteuid() == 0
    uid = spec["uid"]
    owner = uid if uid is not None else os.getuid()
    set_rlimits(limits, report)
    namespaces, pidns = unshare(root, owner, report) if spec["namespaces"] else (False, False)
    if spec.get("require_namespaces") and not namespaces:
        report.notes.append("namespaces are required: the code was not run")
        return False
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
    if not namespaces and spec.get("audit", True):  # a shell (no Python of the agent's here) has no audit hook
        install_audit_hook(spec["workdir"], report)
    return True
