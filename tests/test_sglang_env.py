"""The server test environments (scripts/build_sglang_env.sh and build_vllm_env.sh, tests/conftest.py's `pool` and
`vllm_pool`): a build that fails fails those tests under CI (env CI=true, set by whatever runs .ci/run, and by
.ci/run itself), where a skip would hide that none of them ran; outside CI they skip, naming why. Runs without the
servers: the build is made to fail at once (an interpreter that cannot make a venv)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# name in messages, the env variables' infix, one test that needs the pool
KINDS = {"SGLang": ("SGLANG", "tests/test_sglang.py", "test_a_stop_token_ends_the_row_and_is_kept"),
         "vLLM": ("VLLM", "tests/test_vllm.py", "test_a_stop_token_ends_the_vllm_row_and_is_kept")}


def server_session(tmp_path: Path, kind: str, **env: str) -> subprocess.CompletedProcess:
    """One test of `kind`'s pool in a pytest of its own, whose server environment cannot be built."""
    infix, path, test = KINDS[kind]
    environ = {k: v for k, v in os.environ.items() if k != "CI"}
    environ.update({f"ASYNC_RL_{infix}_VENV": str(tmp_path / "venv"), f"ASYNC_RL_{infix}_PYTHON": "/bin/false"},
                   **env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "-rs", path, "-k", test],
        cwd=REPO, env=environ, capture_output=True, text=True, timeout=300,
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ci", ["true", "1"])
def test_a_failed_server_build_fails_its_tests_under_ci(tmp_path, ci, kind):
    done = server_session(tmp_path, kind, CI=ci)
    script = f"build_{KINDS[kind][0].lower()}_env.sh"
    assert done.returncode != 0, done.stdout[-3000:]
    assert "1 error" in done.stdout and "skipped" not in done.stdout, done.stdout[-3000:]
    assert f"scripts/{script} failed" in done.stdout and "python -m venv failed" in done.stdout


@pytest.mark.parametrize("kind", KINDS)
def test_outside_ci_a_failed_server_build_skips_its_tests_saying_why(tmp_path, kind):
    done = server_session(tmp_path, kind)
    script = f"build_{KINDS[kind][0].lower()}_env.sh"
    assert done.returncode == 0, done.stdout[-3000:]
    assert "1 skipped" in done.stdout, done.stdout[-3000:]
    assert f"no {kind} server environment: scripts/{script} failed" in done.stdout
    assert "python -m venv failed" in done.stdout
    done = server_session(tmp_path, kind, CI="false")  # CI set, but not on
    assert done.returncode == 0 and "1 skipped" in done.stdout, done.stdout[-3000:]
