"""A test module's optional package or platform: where it is missing the module is skipped, naming why; under CI
(env CI=true, tests/sglang_server.py `under_ci`) it fails instead, naming the package and the extra that installs it,
since a skip there would hide that none of its tests ran (.ci/run installs every extra the tests use)."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
from sglang_server import under_ci


def require(module: str, extra: str) -> ModuleType:
    """`module` imported, a package of pyproject's `extra`: missing, the calling test module is skipped, or under CI
    fails, naming both."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        reason = f"{module} is not installed ({exc}): pip install -e '.[{extra}]'"
    skip_module(reason, expected=False)
    raise AssertionError("unreachable")  # skip_module raises


def skip_module(reason: str, expected: bool) -> None:
    """Skip the calling test module for `reason`; under CI fail it instead unless the skip is `expected` there (a
    condition the module was written to skip on, such as a GPU for the fork server)."""
    if under_ci() and not expected:
        pytest.fail(f"under CI every test module must run, and this one would be skipped: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)
