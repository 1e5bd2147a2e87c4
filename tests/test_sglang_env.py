"""The SGLang tests' server environment (scripts/build_sglang_env.sh, tests/conftest.py's `pool`): a build that fails
fails the SGLang tests under CI (env CI=true, set by whatever runs .ci/run, and by .ci/run itself), where a skip would
hide that no SGLang test ran; outside CI they skip, naming why. Runs without SGLang: the build is made to fail at once
(an interpreter that cannot make a venv)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def sglang_session(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """One SGLang test (it needs the pool) in a pytest of its own, whose server environment cannot be built."""
    environ = {k: v for k, v in os.environ.items() if k != "CI"}
    environ.update(ASYNC_RL_SGLANG_VENV=str(tmp_path / "venv"), ASYNC_RL_SGLANG_PYTHON="/bin/false", **env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "-rs",
         "tests/test_sglang.py", "-k", "test_a_stop_token_ends_the_row_and_is_kept"],
        cwd=REPO, env=environ, capture_output=True, text=True, timeout=300,
    )


@pytest.mark.parametrize("ci", ["true", "1"])
def test_a_failed_sglang_build_fails_the_sglang_tests_under_ci(tmp_path, ci):
    done = sglang_session(tmp_path, CI=ci)
    assert done.returncode != 0, done.stdout[-3000:]
    assert "1 error" in done.stdout and "skipped" not in done.stdout, done.stdout[-3000:]
    assert "scripts/build_sglang_env.sh failed" in done.stdout and "python -m venv failed" in done.stdout


def test_outside_ci_a_failed_sglang_build_skips_the_sglang_tests_saying_why(tmp_path):
    done = sglang_session(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "1 skipped" in done.stdout, done.stdout[-3000:]
    assert "no SGLang server environment: scripts/build_sglang_env.sh failed" in done.stdout
    assert "python -m venv failed" in done.stdout
    done = sglang_session(tmp_path, CI="false")  # CI set, but not on
    assert done.returncode == 0 and "1 skipped" in done.stdout, done.stdout[-3000:]
