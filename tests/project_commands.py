"""The project's commands for the tests: where `async-rl` is (beside the interpreter running them first, then on PATH),
and a command line as a page of the docs prints it."""

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


REPO = Path(__file__).resolve().parent.parent


def docs_command(page: str, start: str) -> list[str]:
    """The first line of `page` (relative to the repository) that starts with `start`, split as a shell would (no
    quoting)."""
    text = (REPO / page).read_text()
    line = next(line for line in text.splitlines() if line.startswith(start))
    return line.split("#")[0].split()
