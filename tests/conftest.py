"""Fixtures shared by test files: the real pretrained model, imported once per test run (it takes 40-90 s here),
also when pytest-xdist runs the suite in several worker processes (they share one import under a file lock), and
the README's warm start of it, run once for the two tests that start from it (xdist group "smollm2-chain"); a small
disk that fills; the session's pool of two real SGLang servers (tests/sglang_server.py), shared by the tests of the
xdist group "sglang" (test_sglang.py, test_weights.py's SGLang tests and the sglang_interrupt benchmark's quick form):
a server start costs 30-45 s of these 2 cores."""

import contextlib
import json
import os
import subprocess
import threading
from pathlib import Path

import pytest
from filelock import FileLock
from project_commands import docs_command, project_command
from sglang_server import Pool, build_venv, under_ci

REPO = Path(__file__).resolve().parent.parent
_no_lock = contextlib.nullcontext


def pytest_collection_modifyitems(config, items) -> None:
    """Slow tests first, in their own order (a stable sort): under xdist the workers start on the long ones and the
    short ones fill the end, instead of one worker running a five-minute test alone while the other idles. The slow
    tests that kill a server of the pool (marked `kills_sglang_server`) come after every other slow test, so that no
    later test of the pool waits for a killed server to start again (30-45 s a restart)."""
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None,
                                 item.get_closest_marker("kills_sglang_server") is not None))


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
    out, lock = _shared_dir(tmp_path_factory, request, "smollm2")
    with FileLock(str(lock)) if lock else _no_lock():
        if not out.exists():  # the import renames a staging directory into place: `out` is whole or absent
            out.parent.mkdir(exist_ok=True)
            _import_smollm2(out)
    return out


def _shared_dir(tmp_path_factory, request, name: str) -> tuple[Path, Path | None]:
    """A directory for a session fixture's product and the lock that guards it: under xdist in the run's temporary
    root that every worker shares, else (one process) the session's own, with no lock needed."""
    if not hasattr(request.config, "workerinput"):
        return tmp_path_factory.mktemp(name) / name, None
    root = tmp_path_factory.getbasetemp().parent
    return root / name / name, root / f"{name}.lock"


@pytest.fixture(scope="session")
def chain_warm_start(smollm2, tmp_path_factory, request) -> Path:
    """The README's warm-start recipe, its two printed commands as they are (`async-rl demos ...`, `async-rl sft
    ...`, plus the tests' `--max-steps 2`), run once per test run in a user's directory: `models/smollm2` the
    imported model, `configs/` the repository's; after it `runs/chain-demos.jsonl`, `models/smollm2-chain` and each
    command's JSON report (`demos.json`, `sft.json`). Its two users (the recipe's test and the real_model
    benchmark's quick form) share the xdist group "smollm2-chain": one SFT of SmolLM2 instead of two."""
    out, lock = _shared_dir(tmp_path_factory, request, "chain-warm")
    with FileLock(str(lock)) if lock else _no_lock():
        if (out / "sft.json").exists():
            return out
        out.mkdir(parents=True, exist_ok=True)
        for link, target in (("models/smollm2", smollm2), ("configs", REPO / "configs")):
            (out / link).parent.mkdir(exist_ok=True)
            if not (out / link).exists():
                (out / link).symlink_to(target)
        (out / "runs").mkdir(exist_ok=True)
        async_rl = project_command()
        demos = docs_command("README.md", "async-rl demos --config configs/smollm2-chain.yaml")
        sft = docs_command("README.md", "async-rl sft --model models/smollm2")
        done = subprocess.run([async_rl, *demos[1:]], cwd=out, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        (out / "demos.json").write_text(done.stdout.strip().splitlines()[-1])
        done = subprocess.run([async_rl, *sft[1:], "--max-steps", "2", "wandb.mode=disabled"], cwd=out,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        json.loads(done.stdout.strip().splitlines()[-1])
        (out / "sft.json").write_text(done.stdout.strip().splitlines()[-1])  # last: its presence says all is done
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
    yield from _server_pool(tmp_path_factory, "SGLang", "build_sglang_env.sh", [])


@pytest.fixture(scope="module")
def keyed_pool(tmp_path_factory) -> Pool:
    """One real SGLang server started closed: an API key, an admin key and TLS (tests/sglang_server.py
    `KeyedSGLangServer`), on the same tiny model (`xdist_group("sglang")`); stopped after its module, so that it
    does not sit beside the pool's two for the rest of the session."""
    from sglang_server import keyed_tls_server

    kind = keyed_tls_server(tmp_path_factory.mktemp("tls"))
    yield from _server_pool(tmp_path_factory, "SGLang", "build_sglang_env.sh", [], kind, count=1)


@pytest.fixture(scope="session")
def vllm_pool(tmp_path_factory) -> Pool:
    """The same for vLLM (`xdist_group("vllm")`; scripts/build_vllm_env.sh, about 5 min when missing), on a tiny
    model with 2 heads of 32 (vLLM's CPU attention has no kernel for the default's head dimension of 16)."""
    from vllm_server import VLLMServer

    yield from _server_pool(tmp_path_factory, "vLLM", "build_vllm_env.sh", VLLM_MODEL, VLLMServer)


@pytest.fixture(scope="module")
def vllm_tls_pool(tmp_path_factory) -> Pool:
    """One vLLM server speaking TLS with a certificate from a test CA (tests/vllm_server.py `tls_vllm_server`), on
    the pool's tiny model (`xdist_group("vllm")`); stopped after its module."""
    from vllm_server import tls_vllm_server

    kind = tls_vllm_server(tmp_path_factory.mktemp("vllm-tls"))
    yield from _server_pool(tmp_path_factory, "vLLM", "build_vllm_env.sh", VLLM_MODEL, kind, count=1)


@pytest.fixture(scope="session")
def vllm_lora_pool(tmp_path_factory) -> Pool:
    """One vLLM server that loads LoRA adapters (scripts/start_vllm_server.py --max-lora-rank 8), on the same tiny
    model: the `rollout.vllm.lora: adapter` tests' (`xdist_group("vllm")`)."""
    from vllm_server import VLLMLoraServer

    yield from _server_pool(tmp_path_factory, "vLLM", "build_vllm_env.sh", VLLM_MODEL, VLLMLoraServer, count=1)


# the tiny model vLLM's CPU kernels can run (heads of 32), with 512 positions (rows long enough for an update to
# land in: tests/test_vllm.py ROW_TOKENS)
VLLM_MODEL = ["model.num_heads=2", "model.num_kv_heads=1", "model.max_seq_len=512"]


def _server_pool(tmp_path_factory, name: str, script: str, model: list[str], kind=None, count: int = 2):
    from rollout_helpers import model_dir_for

    from async_rl.config_load import load_config

    venv, reason = build_venv(script)
    if venv is None:
        if under_ci():
            pytest.fail(f"no {name} server environment, and under CI (CI={os.environ['CI']}) the {name} tests must "
                        f"run: {reason}", pytrace=False)
        pytest.skip(f"no {name} server environment: {reason}")
    root = tmp_path_factory.mktemp(name.lower())
    model_dir = model_dir_for(load_config(None, [f"run.dir={root}", "run.name=base", *model]))
    servers = Pool(venv, model_dir, root, *([kind] if kind else []), count=count)
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


@pytest.fixture
def vllm_servers(vllm_pool: Pool) -> Pool:
    """The vLLM pool, both servers alive and at version 0."""
    vllm_pool.reset()
    return vllm_pool
