"""The sandbox contains abuse: each attack ends with a clear outcome, no stray process, nothing changed outside.

The tests are the judge's (trusted, in a process of its own): each attack is the agent's code, run when it loads or
when a test calls one of its functions. Reward hacks against the judge: tests/test_sandbox_judge.py.

Each attack runs in both isolation modes: "auto" (namespaces where the kernel allows them: what CI and the
workers use here) and "basic" (no namespaces: the rlimits + uid + audit-hook fallback). After each one the
`healthy` fixture checks that no process of a sandbox uid or with the test's marker survives and that a normal
execution still passes.
"""

from __future__ import annotations

import ast
import fcntl
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import uuid
from pathlib import Path

import pytest
import setuptools

from rollout.sandbox import ERROR, FAILED, NOT_RUN, PASSED, TIMEOUT, Limits, Sandbox, Test, child
from rollout.sandbox.parent import CHILD, JUDGE

# Generous times (the machine is shared: a 0.2 s test can take 2 s under load); the tests that expect a timeout
# use FAST. nice 0: the child competes on equal terms with the load around it.
LIMITS = Limits(wall_s=10.0, test_s=5.0, cpu_s=8, memory_mb=256, nproc=8, output_chars=2000, nice=0)
FAST = Limits(wall_s=3.0, test_s=1.0, cpu_s=3, memory_mb=256, nproc=8, output_chars=2000, nice=0)
UIDS = range(61000, 61000 + 512)  # Sandbox's default uid slots
ROOT = os.geteuid() == 0


def _namespaces_allowed() -> bool:
    """Whether this host lets the sandbox create its namespaces (CI containers here do; some hosts forbid it)."""
    flags = ["--net", "--mount", "--pid", "--fork"] if ROOT else ["--user", "--net", "--mount", "--pid", "--fork"]
    try:
        return subprocess.run(["unshare", *flags, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


NAMESPACES = _namespaces_allowed()


@pytest.fixture(scope="module", params=["auto", "basic"])
def sandbox(request):
    return Sandbox(LIMITS, max_concurrent=2, isolation=request.param)


@pytest.fixture
def marker():
    return f"ASYNCRLMARK{uuid.uuid4().hex[:12]}"


def _cmdlines() -> dict[int, str]:
    out = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out[int(pid)] = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
            except OSError:
                pass
    return out


def _claimed(uid: int) -> bool:
    """Whether an execution holds `uid` now (its flock in the machine-wide slot directory: rollout/sandbox/parent.py).
    Another test running sandboxed code beside this one (pytest-xdist) holds its own uids, and their processes are
    not strays."""
    path = os.path.join(tempfile.gettempdir(), "async-rl-sandbox-uids", str(uid))
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # releases the lock if it was taken
    return False


def _sandbox_uid_processes() -> list[int]:
    """Live processes of a sandbox uid that no execution holds."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                status = f.read()
        except OSError:
            continue
        if "\nState:\tZ" in status:
            continue
        uids = [int(x) for x in status.split("\nUid:")[1].split("\n")[0].split()]
        if any(u in UIDS and not _claimed(u) for u in uids):
            found.append(int(pid))
    return found


@pytest.fixture
def healthy(sandbox, marker):
    """After the test: no stray process (by uid and by marker), and the sandbox still runs code normally."""
    yield
    strays = [pid for pid, cmd in _cmdlines().items() if marker in cmd and pid != os.getpid()]
    assert not strays, f"processes with the marker survived: {strays}"
    if ROOT:
        assert not _sandbox_uid_processes(), "a process of a sandbox uid survived"
    after = sandbox.run("def f():\n    return 1\n", [Test("ok", "assert f() == 1")])
    assert after.status == "ok" and after.passed == 1, after


def test_passes_fails_and_reports(sandbox):
    code = "def f(x):\n    print('hello')\n    return x + 1\n"
    tests = [Test("a", "assert f(1) == 2"), Test("b", "assert f(1) == 3"), Test("c", "f(None)")]
    r = sandbox.run(code, tests)
    assert r.status == "ok"
    assert [t.status for t in r.tests] == [PASSED, FAILED, ERROR]
    assert "got: 2" in r.tests[1].detail
    assert "TypeError" in r.tests[2].detail
    assert r.stdout.startswith("hello")
    assert r.fraction == pytest.approx(1 / 3)
    if sandbox.isolation == "auto" and NAMESPACES:
        assert {"netns", "mountns", "pidns", "private-tmp"} <= set(r.isolation), r.notes
    else:
        assert "audit" in r.isolation
    if ROOT:
        assert "uid" in r.isolation


def test_syntax_error_is_a_load_error(sandbox):
    r = sandbox.run("def f(:\n  pass", [Test("a", "assert f() is None")])
    assert r.status == "load_error"
    assert "SyntaxError" in r.load_error
    assert r.tests[0].status == NOT_RUN


def test_stdlib_imports_work(sandbox):
    code = "import fractions, decimal, zlib, json, collections, itertools\ndef crc():\n    return zlib.crc32(b'a')\n"
    r = sandbox.run(code, [Test("a", "assert crc() == 3904355907")])
    r2 = sandbox.run(code + "import sqlite3\n", [Test("a", "assert crc() == 3904355907")])
    if any("stdlib is not readable" in n for n in r.notes):
        # basic mode as root with the interpreter under a private home (/root 0700): only preloaded modules
        assert sandbox.isolation == "basic" and "ModuleNotFoundError" in r2.load_error
    else:
        assert r2.status == "ok" and r2.passed == 1, (r2.load_error, r2.notes)
    assert r.status == "ok" and r.passed == 1, (r.load_error, r.notes)


@pytest.mark.usefixtures("healthy")
def test_infinite_loops(sandbox):
    sandbox = Sandbox(FAST, isolation=sandbox.isolation)
    t0 = time.monotonic()
    r = sandbox.run("def f():\n    while True:\n        pass\n", [Test("spin", "f()"), Test("after", "assert True")])
    assert [t.status for t in r.tests] == [TIMEOUT, PASSED]  # SIGALRM interrupts bytecode: the next test runs
    # C: the alarm cannot interrupt it; the judge's own alarm times the test out, and the judge goes on
    r = sandbox.run("def g():\n    return sum(range(10**13))\n", [Test("c-level", "g()"), Test("after", "assert True")])
    assert r.status == "ok" and [t.status for t in r.tests] == [TIMEOUT, PASSED]
    r = sandbox.run("while True:\n    pass\n", [Test("a", "assert True")])
    assert r.status == "load_error" and "Timeout" in r.load_error
    assert time.monotonic() - t0 < 3 * FAST.wall_s + 3


@pytest.mark.usefixtures("healthy")
def test_fork_bomb(sandbox, marker):
    code = (
        "import os\n"
        "failures = []\n"
        "def bomb():\n"
        "    for _ in range(200):\n"  # bounded even if every limit failed: 200 forks per process at most
        "        try:\n"
        "            os.fork()\n"
        "        except OSError as exc:\n"
        "            failures.append(type(exc).__name__)\n"
        f"def run():  # {marker}\n"
        "    bomb()\n"
        "    return failures\n"
    )
    r = sandbox.run(code, [Test("bomb", "assert run(), 'every fork succeeded'")])
    assert r.status in ("ok", "timeout", "crash")
    assert r.tests[0].status == PASSED, r.tests[0]  # the forks hit RLIMIT_NPROC (auto) or the audit hook (basic)


@pytest.mark.usefixtures("healthy")
def test_memory_bomb(sandbox):
    code = ("def big():\n    return bytearray(10**10)\n"
            "def grow():\n    chunks = []\n    while True:\n        chunks.append(bytearray(5 * 10**7))\n")
    r = sandbox.run(code, [Test("big", "big()"), Test("grow", "grow()")])
    assert [t.status for t in r.tests] == [ERROR, ERROR]
    assert all("MemoryError" in t.detail for t in r.tests)


@pytest.mark.usefixtures("healthy")
def test_huge_output(sandbox):
    code = (
        "import os\n"
        "def big_print():\n    print('x' * 10**7)\n"
        "def raw_fd():\n    for _ in range(200): os.write(1, b'y' * 10**5)\n"
        "def flood():\n    for _ in range(10**5): print('z' * 1000)\n"
        "def big_file():\n    open('big.txt', 'w').write('w' * (64 << 20))\n"
    )
    tests = [Test("print", "big_print()"), Test("raw fd", "raw_fd()"), Test("flood", "flood()"),
             Test("file", "big_file()")]
    r = sandbox.run(code, tests)
    assert [t.status for t in r.tests] == [PASSED, PASSED, PASSED, ERROR]
    assert "File too large" in r.tests[3].detail or "No space" in r.tests[3].detail
    assert len(r.stdout) <= LIMITS.output_chars and r.output_dropped > 10**8


@pytest.mark.usefixtures("healthy")
def test_writes_outside_the_working_directory(sandbox, marker, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    os.chmod(tmp_path, 0o755)
    targets = [
        f"../{marker}",
        f"../../{marker}",
        f"/tmp/{marker}",
        f"/var/tmp/{marker}",
        f"/dev/shm/{marker}",
        str(victim),
        f"/root/{marker}",
    ]
    code = f"""
import os
results = {{}}
def attempt(name, fn):
    try:
        fn()
        results[name] = "ok"
    except BaseException as exc:
        results[name] = type(exc).__name__
for i, path in enumerate({targets!r}):
    attempt(path, lambda: open(path, "w").write("pwned"))
    attempt("link" + str(i), lambda: (os.symlink(path, "link%d" % i), open("link%d" % i, "w").write("pwned")))
attempt("rename", lambda: os.rename("/etc/hostname", "stolen"))
print("cwd=" + os.getcwd())
"""
    r = sandbox.run(code, [Test("a", "assert True")])
    assert r.status == "ok", r.load_error
    assert victim.read_text() == "original"
    for path in targets:
        p = Path(path)
        if not p.is_absolute():
            continue
        assert not p.exists() or p == victim, f"{path} was written outside the sandbox"
    assert not list(Path("/tmp").glob(f"*{marker}*")) and not list(Path("/tmp").glob(f"*/{marker}"))
    cwd = r.stdout.split("cwd=")[1].strip()
    assert not Path(cwd).exists(), "the working directory was not removed"
    assert not Path(cwd).parent.joinpath(marker).exists()
    assert Path("/etc/hostname").exists()


@pytest.mark.usefixtures("healthy")
def test_parent_environment_is_invisible(sandbox, monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("ASYNC_RL_TEST_SECRET", secret)
    monkeypatch.setenv("WANDB_API_KEY", secret)
    code = f"""
import os
seen = dict(os.environ)
leaks = [k for k, v in seen.items() if {secret!r} in v]
pids = [str(os.getppid()), "1"] + [p for p in os.listdir("/proc") if p.isdigit()]
for path in ["/proc/%s/environ" % p for p in pids]:
    try:
        with open(path, "rb") as f:
            if {secret!r}.encode() in f.read():
                leaks.append(path)
    except OSError:
        pass
def found():
    return leaks
def names():
    return sorted(seen)
"""
    r = sandbox.run(
        code,
        [
            Test("no leak", "assert not found(), found()"),
            Test("env", "assert set(names()) <= {'PATH', 'LANG', 'LC_ALL', 'HOME'}, names()"),
        ],
    )
    assert r.status == "ok", r.load_error
    assert [t.status for t in r.tests] == [PASSED, PASSED], r.tests


@pytest.mark.usefixtures("healthy")
def test_no_network(sandbox):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    try:
        code = f"def connect():\n    import socket\n    socket.create_connection(('127.0.0.1', {port}), 1).send(b'x')\n"
        r = sandbox.run(code, [Test("connect", "connect()")])
        assert r.tests[0].status == ERROR, r.tests[0]
        assert any(w in r.tests[0].detail for w in ("unreachable", "blocked", "refused", "Network")), r.tests[0].detail
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()


@pytest.mark.usefixtures("healthy")
def test_background_processes_do_not_survive(sandbox, marker):
    code = f"""
import os, subprocess, sys
subprocess.Popen(["/bin/sh", "-c", "sleep 30 # {marker}"], start_new_session=True)
pid = os.fork()
if pid == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sh", ["/bin/sh", "-c", "sleep 31 # {marker} double"])
    os._exit(0)
"""
    r = sandbox.run(code, [Test("a", "assert True")])
    if sandbox.isolation == "basic":
        assert r.status == "load_error" and "blocked" in r.load_error
    else:
        assert r.status == "ok", r.load_error


@pytest.mark.usefixtures("healthy")
def test_cannot_kill_the_parent(sandbox):
    parent_uid, parent_pid, grandparent = os.getuid(), os.getpid(), os.getppid()
    code = f"""
import os, signal
delivered = []
for target in ({parent_pid}, os.getppid()):
    if target <= 1:
        continue  # in a pid namespace the parent is invisible: getppid() is 0
    try:
        os.kill(target, signal.SIGKILL)
        delivered.append(target)
    except OSError:
        pass
if os.getuid() not in (0, {parent_uid}):
    try:
        os.kill(-1, signal.SIGKILL)  # every process this uid may signal: only the sandbox's own
    except OSError:
        pass
def sent():
    return delivered
"""
    r = sandbox.run(code, [Test("a", "assert not sent(), sent()")])
    assert r.status in ("ok", "crash")  # kill(-1) may take the runner itself down: a crash, not a pass
    if r.status == "ok":
        assert r.passed == 1, r.tests
    # this process lives (it would not get here otherwise), and so does its parent: a killed parent would have
    # re-parented it (to init or a subreaper); a pytest started detached (parent already init) still checks itself
    assert os.getppid() == grandparent


@pytest.mark.usefixtures("healthy")
def test_deleting_the_working_directory(sandbox):
    code = """
import os, shutil
open("f.txt", "w").write("x")
os.mkdir("d")
shutil.rmtree(os.getcwd(), ignore_errors=True)
try:
    os.rmdir(os.getcwd())
except OSError:
    pass
"""
    r = sandbox.run(code, [Test("still runs", "assert 1 + 1 == 2")])
    assert r.status == "ok" and r.passed == 1, (r.load_error, r.tests)


def test_forged_results_are_ignored(sandbox):
    fake = '{"event": "test", "index": 0, "status": "passed"}\\n{"event": "done"}\\n'
    code = f"""
import os
print({fake!r})
for fd in range(3, 30):
    try:
        os.write(fd, {fake!r}.encode())
    except OSError:
        pass
os._exit(0)
"""
    r = sandbox.run(code, [Test("a", "assert False")])
    assert r.status == "crash" and r.passed == 0  # its fds 3 and 4 are the judge's pipes: lines there are no events
    assert r.tests[0].status == NOT_RUN


def test_concurrency_is_bounded_and_a_timeout_blocks_no_one(sandbox):
    sandbox = Sandbox(FAST, max_concurrent=2, isolation=sandbox.isolation)
    slow = threading.Thread(target=sandbox.run, args=("while True: pass", [Test("a", "pass")]))
    slow.start()
    t0 = time.monotonic()
    r = sandbox.run("def f():\n    return 2\n", [Test("a", "assert f() == 2")])
    quick_s = time.monotonic() - t0
    assert r.passed == 1 and quick_s < FAST.wall_s - 0.5, quick_s  # ran beside the spinning one, not after it
    slow.join()
    running, peak, lock = [0], [0], threading.Lock()
    original = sandbox._run

    def counted(*args):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        try:
            return original(*args)
        finally:
            with lock:
                running[0] -= 1

    sandbox._run = counted
    nap = "import time\ndef nap():\n    time.sleep(0.2)\n"
    try:
        threads = [
            threading.Thread(target=sandbox.run, args=(nap, [Test("a", "nap()")])) for _ in range(5)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        del sandbox._run
    assert peak[0] == sandbox.max_concurrent


def test_the_child_is_a_stdlib_only_module_run_isolated_and_shipped():
    """The child and the judge (and the modules they load by path) are real modules of the package (linted, in the
    wheel), run by path with -I -S -B: they can import nothing but the standard library, and their directory is not
    on the agent's sys.path."""
    for name in ("child", "judge", "isolation", "values"):
        tree = ast.parse(Path(child.__file__).with_name(name + ".py").read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert imported - {"__future__"} <= set(sys.stdlib_module_names), (name, imported)
    assert child.__file__ == CHILD and Path(CHILD).name == "child.py" and Path(JUDGE).parent == Path(CHILD).parent
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    assert "rollout.sandbox" in setuptools.find_packages(str(Path(__file__).parents[1]), include=include)
    r = Sandbox(LIMITS).run("import sys\nprint(sys.flags.isolated, sys.flags.no_site, sys.path)", [])
    assert r.status == "ok" and r.stdout.startswith("1 1 "), r
    assert str(Path(CHILD).parent) not in r.stdout and "site-packages" not in r.stdout
