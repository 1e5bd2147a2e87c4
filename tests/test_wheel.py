"""The wheel ships the run the README describes: built with `pip wheel` from what pyproject.toml packages, installed
into a fresh virtual environment outside the checkout that sees no install of the checkout, `async-rl config` prints
the default run (the structs' defaults, what configs/local.yaml says) and the packaged configs resolve by name."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml
from setuptools import find_namespace_packages

from async_rl.config_load import config_to_dict, load_config

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def packages() -> list[str]:
    """The top-level packages of the wheel, found as setuptools finds them: [tool.setuptools.packages.find]'s
    include patterns (namespaces on, pyproject's default) over the checkout."""
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted({name.split(".")[0] for name in find_namespace_packages(where=str(REPO), include=include)})


def sources() -> list[str]:
    """What the build reads: pyproject.toml, the readme it names and the packages."""
    return ["pyproject.toml", PYPROJECT["project"]["readme"], *packages()]


def _run(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def venv_with_the_dependencies_only(venv: Path) -> Path:
    """A virtual environment without pip or system site-packages whose one .pth file lists this interpreter's
    site-packages directories: their packages (torch, msgspec, pip, ...) import, but the .pth files inside them are
    not read, so an editable install of the checkout there (its path or finder .pth) cannot leak in. Its python."""
    assert _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], venv.parent).returncode == 0
    python = venv / "bin" / "python"
    (own,) = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                  venv.parent).stdout.split()
    ours = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    (Path(own) / "dependencies.pth").write_text("".join(f"{path}\n" for path in ours))
    return python


def test_the_wheel_is_built_from_the_packages_pyproject_names():
    """Every top-level package of the checkout (a directory with an __init__.py) is one pyproject's find includes: a
    new role left out of the include list would be left out of the wheel and the image. The image copies and its
    build context sends all that the wheel is built from."""
    assert packages() == sorted(init.parent.name for init in REPO.glob("*/__init__.py"))
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text().splitlines()
    copied = {name for line in dockerfile if line.startswith("COPY ") and "--from" not in line
              for name in line.split()[1:-1]}
    sent = {line[1:] for line in (REPO / "deploy" / "Dockerfile.dockerignore").read_text().splitlines()
            if line.startswith("!")}
    assert set(sources()) <= copied and set(sources()) <= sent, (sources(), copied, sent)


@pytest.mark.slow  # builds a wheel and a virtual environment: ~5 s
def test_the_wheel_installed_outside_the_checkout_runs_the_readme_default(tmp_path):
    source = tmp_path / "src"  # a copy: the build's build/ and *.egg-info stay out of the checkout
    source.mkdir()
    for name in sources():
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    built = _run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                  "-w", str(tmp_path / "wheels")], tmp_path, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "wheels").glob("async_rl-*.whl")
    with zipfile.ZipFile(wheel) as archive:  # PEP 561: the package says it is typed
        assert "async_rl/py.typed" in archive.namelist()
        # the swe judge's pytest plugin is loaded by path, not imported: package data, not a package
        assert "rollout/sandbox/pytest_plugin/async_rl_outcomes.py" in archive.namelist()
    venv = tmp_path / "venv"
    python, cli = venv_with_the_dependencies_only(venv), venv / "bin" / "async-rl"
    installed = _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
                      str(wheel)], tmp_path)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    cwd = tmp_path / "user"  # a user's directory: no configs/ here
    cwd.mkdir()
    names = packages()
    where = _run([str(python), "-c", f"import {', '.join(names)}\n"
                  f"for package in ({', '.join(names)}): print(package.__path__[0])"], cwd)
    assert where.returncode == 0, where.stderr
    assert all(Path(line).is_relative_to(venv) for line in where.stdout.split()), where.stdout  # from the wheel

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
