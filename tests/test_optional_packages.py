"""tests/optional_packages.py: a test module whose optional package is missing is skipped, naming the package and
its extra, and under CI (env CI=true) fails instead, so that no module goes quiet there. Each case is a pytest of
its own on a module that needs a package no one installs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
MODULE = '''
from optional_packages import require

require("async_rl_no_such_package", "nonexistent-extra")


def test_never_runs():
    pass
'''


def session(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_needs_a_package.py").write_text(MODULE)
    environ = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        environ["CI"] = ci
    environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "-rs",
         str(tmp_path / "test_needs_a_package.py")],
        cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize("ci", ["true", "1"])
def test_a_missing_package_fails_its_module_under_ci_naming_it(tmp_path, ci):
    done = session(tmp_path, ci)
    assert done.returncode != 0, done.stdout[-3000:]
    assert "1 error in" in done.stdout and " skipped in" not in done.stdout, done.stdout[-3000:]
    assert "async_rl_no_such_package is not installed" in done.stdout
    assert "pip install -e '.[nonexistent-extra]'" in done.stdout


def test_a_missing_package_skips_its_module_outside_ci_naming_it(tmp_path):
    done = session(tmp_path, None)
    assert done.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, done.stdout[-3000:]  # skipped, not failed
    assert "1 skipped" in done.stdout and "async_rl_no_such_package is not installed" in done.stdout
