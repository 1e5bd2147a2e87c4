"""Fixtures shared by test files: the real pretrained model, imported once per test run (it takes 40-90 s here),
also when pytest-xdist runs the suite in several worker processes (they share one import under a file lock); a small
disk that fills; the session's pool of two real SGLang servers (tests/sglang_server.py), shared by the tests of the
xdist group "sglang" (test_sglang.py and the sglang_interrupt benchmark's quick form): a server start costs 30-45 s
of these 2 cores."""

import os
import subprocess
import threading
from pathlib import Path

import pytest
from filelock import FileLock
from project_commands import project_command
from sglang_server import Pool, build_venv, under_ci


def pytest_collection_modifyitems(config, items) -> None:
    """Slow tests first, in their own order (a stable sort): under xdist the workers start on the long ones and the
    short ones fill the end, instead of one worker running a five-minute test alone while the other idles."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _import_smollm2(out: Path) -> None:
    async_rl = project_command()
    done = subprocess.run([async_rl, "model", "import", "smollm2-135m-instruct", str(out), "--dtype", "bf16"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(out)
    assert "renders no tools" in done.stderr  # the shipped tools template replaced SmolLM2's, and the log says so


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory, request) -> Path:
    """SmolLM2-135M-Instruct imported through `async-rl model import` as docs/models.md prints it, in bf16 (the
    learner and the built-in engine upcast to fp32 when they load it). Under xdist the first worker that needs it
    imports it into the run's shared temporary root; the others wait on the lock and reuse that directory."""
    if not hasattr(request.config, "workerinput"):  # one process (no xdist worker): its own session directory
        out = tmp_path_factory.mktemp("import") / "smollm2"
        _import_smollm2(out)
        return out
    root = tmp_path_factory.getbasetemp().parent  # shared by this run's workers
    out = root / "import" / "smollm2"
    with FileLock(str(root / "smollm2.lock")):
        if not out.exists():  # the import renames a staging directory into place: `out` is whole or absent
            out.parent.mkdir(exist_ok=True)
            _import_smollm2(out)
    return out


@pytest.fixture
def small_disk(tmp_path: Path, request):
    """A real filesystem that fills: a tmpfs of `request.param` (default 2m; parametrize it indirectly for another
    size), unmounted after the test; skipped, saying why, where mounting is not allowed (it needs root)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    size = getattr(request, "param", "2m")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture(scope="session")
def pool(tmp_path_factory) -> Pool:
    """Two real SGLang servers on the tiny model's version-0 directory, started once per worker process (mark the
    tests that use them `xdist_group("sglang")` so that one worker starts them). A server venv that cannot be built
    fails them under CI (env CI=true: a skip would hide that no SGLang test ran) and skips them elsewhere, naming
    why (tests/test_sglang_env.py)."""
    from async_rl.config_load import load_config
    from rollout.prepare import prepare_model_dir

    venv, reason = build_venv()
    if venv is None:
        if under_ci():
            pytest.fail(f"no SGLang server environment, and under CI (CI={os.environ['CI']}) the SGLang tests must "
                        f"run: {reason}", pytrace=False)
        pytest.skip(f"no SGLang server environment: {reason}")
    root = tmp_path_factory.mktemp("sglang")
    model_dir = prepare_model_dir(load_config(None, [f"run.dir={root}", "run.name=base"]))
    servers = Pool(venv, model_dir, root)
    yield servers
    stops = [threading.Thread(target=server.stop) for server in servers.servers]
    for stop in stops:
        stop.start()
    for stop in stops:
        stop.join()


@pytest.fixture
def servers(pool: Pool) -> Pool:
    """The pool, both servers alive (a killed one started again) and at version 0."""
    pool.reset()
    return pool
