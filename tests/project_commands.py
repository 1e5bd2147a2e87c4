"""Where the tests find the project's commands (`async-rl`): beside the interpreter running them first, then on PATH."""

import shutil
import sys
from pathlib import Path

import pytest


def project_command(name: str = "async-rl") -> str:
    """The console script `name` that pip installed with this interpreter's packages (`.venv/bin/python -m pytest`
    finds `.venv/bin/async-rl` without the venv activated), else the one on PATH; the test fails if neither exists."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    return found or pytest.fail(f"the {name} command is neither beside {sys.executable} nor on PATH "
                                "(pip install -e '.[test]')")
