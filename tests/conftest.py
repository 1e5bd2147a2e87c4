"""Fixtures shared by test files: the real pretrained model, imported once per session (it takes 40-90 s here)."""

import shutil
import subprocess
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct imported through `async-rl model import` as docs/models.md prints it, in bf16 (the
    learner and the built-in engine upcast to fp32 when they load it)."""
    async_rl = shutil.which("async-rl") or pytest.fail("the async-rl command is not on PATH (pip install -e '.[test]')")
    out = tmp_path_factory.mktemp("import") / "smollm2"
    done = subprocess.run([async_rl, "model", "import", "smollm2-135m-instruct", str(out), "--dtype", "bf16"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(out)
    assert "renders no tools" in done.stderr  # the shipped tools template replaced SmolLM2's, and the log says so
    return out
