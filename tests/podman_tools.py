"""Root and podman's tools for the tests that run containers (test_podman.py, test_swe_podman.py): skipped with the
reason where they are missing, but under CI=true installed with apt (Debian's podman, buildah, runc, debootstrap),
and a failure fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import build_pod_image  # noqa: E402


def ensure_podman_tools() -> None:
    under_ci = os.environ.get("CI") == "true"
    if os.geteuid() != 0:
        reason = "needs root (rootful podman, debootstrap)"
        if under_ci:
            pytest.fail(reason)
        pytest.skip(reason)
    if build_pod_image.tools_missing():
        if not under_ci:
            pytest.skip(f"{', '.join(build_pod_image.tools_missing())} not installed: apt-get install "
                        f"{' '.join(build_pod_image.APT_PACKAGES)} (CI=true installs them)")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for argv in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *build_pod_image.APT_PACKAGES]):
            out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
            assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    os.environ.setdefault("CONTAINERS_CONF", build_pod_image.engine_env()["CONTAINERS_CONF"])  # runc, its limits
