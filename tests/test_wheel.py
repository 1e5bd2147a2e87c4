"""The wheel ships the run the README describes: built with `pip wheel`, installed into a fresh virtual environment
outside the checkout, `async-rl config` prints the default run (the structs' defaults, what configs/local.yaml
says) and the packaged configs resolve by name, with nothing of the checkout on the path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from async_rl.config_load import config_to_dict, load_config

REPO = Path(__file__).resolve().parent.parent
SOURCES = ["pyproject.toml", "README.md", "async_rl", "rollout", "replay", "learner"]  # what the Dockerfile copies


def _run(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # builds a wheel and a virtual environment: ~20 s
def test_the_wheel_installed_outside_the_checkout_runs_the_readme_default(tmp_path):
    source = tmp_path / "src"  # a copy: the build's build/ and *.egg-info stay out of the checkout
    source.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    built = _run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                  "-w", str(tmp_path / "wheels")], tmp_path, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "wheels").glob("async_rl-*.whl")
    venv = tmp_path / "venv"
    # the system's packages (torch, ...) are visible; async_rl must come from the wheel, not from them
    assert _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], tmp_path).returncode == 0
    python, cli = venv / "bin" / "python", venv / "bin" / "async-rl"
    installed = _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
                      str(wheel)], tmp_path)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    cwd = tmp_path / "user"  # a user's directory: no configs/ here
    cwd.mkdir()
    where = _run([str(python), "-c", "import async_rl; print(async_rl.__file__)"], cwd)
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout + where.stderr

    printed = _run([str(cli), "config"], cwd)
    assert printed.returncode == 0, printed.stderr
    default = yaml.safe_load(printed.stdout)
    # the README's default run: the entropy bonus, the success target with the version cap as a safety net only,
    # 64-token packed rows, W&B off, the trap env on the tiny model
    assert default["algo"]["entropy_coef"] == 0.2
    assert (default["run"]["target_success"], default["run"]["max_versions"]) == (0.8, 10_000)
    assert default["learner"]["pack_row_tokens"] == 64
    assert (default["wandb"]["mode"], default["env"]["name"], default["model"]["path"]) == ("disabled", "trap", "")
    assert default == config_to_dict(load_config(REPO / "configs" / "local.yaml"))  # the checkout's, key for key

    for name in ("local", "cluster", "smollm2"):  # the packaged configs, by name
        named = _run([str(cli), "config", "--config", name], cwd)
        assert named.returncode == 0, named.stderr
        assert yaml.safe_load(named.stdout) == config_to_dict(load_config(REPO / "configs" / f"{name}.yaml"))
    missing = _run([str(cli), "config", "--config", "configs/local.yaml"], cwd)  # no fallback to the defaults
    assert missing.returncode == 2 and "config file configs/local.yaml does not exist" in missing.stderr
