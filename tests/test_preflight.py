"""`async-rl train` refuses what it can before creating anything (and before importing torch, unless a device is set
to cuda): exit 2, one line naming the path or the key, nothing on disk."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", "train", "wandb.mode=disabled", *overrides],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )


def test_a_missing_model_path_is_reported_at_once_and_creates_nothing(tmp_path):
    runs = tmp_path / "runs"
    done = train(tmp_path, f"run.dir={runs}", f"model.path={tmp_path / 'no-such-model'}")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"async-rl train: model.path: {tmp_path / 'no-such-model'} is not a Hugging Face model directory "
        "(no config.json)"
    )
    assert not runs.exists() and sorted(tmp_path.iterdir()) == []


def test_a_run_dir_under_a_file_is_reported_at_once_and_creates_nothing(tmp_path):
    (tmp_path / "file").write_text("")
    done = train(tmp_path, f"run.dir={tmp_path / 'file' / 'runs'}")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"async-rl train: run.dir: cannot create the run directory {tmp_path / 'file' / 'runs' / 'local'}: "
        f"{tmp_path / 'file'} is not a directory"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_an_unwritable_run_dir_is_reported_at_once_and_creates_nothing(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        done = train(tmp_path, f"run.dir={locked / 'runs'}")
    finally:
        locked.chmod(0o700)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"async-rl train: run.dir: cannot create the run directory {locked / 'runs'}")
    assert f"{locked} is not writable" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert list(locked.iterdir()) == []


def test_the_writability_probe_names_the_path_when_the_filesystem_refuses(tmp_path, monkeypatch):
    """The same refusal in-process, for hosts where the tests run as root (which may write anywhere)."""
    from async_rl.config_load import config_from_dict
    from async_rl.errors import ConfigError
    from launch import preflight

    def refuse(**_):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(preflight.tempfile, "mkdtemp", refuse)
    config = config_from_dict({"run": {"dir": str(tmp_path / "runs")}})
    with pytest.raises(ConfigError, match=f"cannot create the run directory {tmp_path / 'runs' / 'local'}: "
                                          f"{tmp_path} is not writable"):
        preflight.preflight(config)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU here: cuda is not refused")
@pytest.mark.parametrize("key", ["learner.device", "rollout.device"])
def test_cuda_without_a_gpu_is_refused_at_once_and_creates_nothing(tmp_path, key):
    """A worker that found out for itself would exit 2 and be restarted to the same error while the learner trained
    on nothing until run.max_wall_s (seen: exit 0 after the wall-clock budget, 0 env steps)."""
    runs = tmp_path / "runs"
    done = train(tmp_path, f"run.dir={runs}", f"{key}=cuda")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"async-rl train: {key}: cuda was asked for but torch sees no CUDA device (set auto or cpu)")
    assert sorted(tmp_path.iterdir()) == []


def test_rollout_device_is_the_torch_engines_alone(tmp_path):
    """rollout.device sets where the built-in engine runs; an SGLang run's servers have their own GPUs, so the
    setting is not checked there."""
    from async_rl.config_load import config_from_dict
    from async_rl.errors import ConfigError
    from launch import preflight

    sglang = config_from_dict({"run": {"dir": str(tmp_path / "a")},
                               "rollout": {"engine": "sglang", "device": "cuda",
                                           "sglang": {"urls": ["http://127.0.0.1:1"]}}})
    preflight.preflight(sglang)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="rollout.device: cuda"):
            preflight.preflight(config_from_dict({"run": {"dir": str(tmp_path / "b")}, "rollout": {"device": "cuda"}}))
    with pytest.raises(ConfigError, match="rollout.device"):
        config_from_dict({"rollout": {"device": "gpu"}})


def test_a_role_stopped_by_a_config_error_is_not_restarted(tmp_path):
    """`env.name=coding` at the default model.max_seq_len (256): every HumanEval statement leaves no room for an
    action, the worker stops with a ConfigError naming the key (exit CONFIG_EXIT_CODE), and the run stops at once
    with that line in the log tail, without restarting the worker into the same error (it used to, 3 times, and
    before that the run went on abandoning until run.max_wall_s, exit 0)."""
    runs = tmp_path / "runs"
    done = train(tmp_path, f"run.dir={runs}", "run.name=c", "env.name=coding", "run.max_wall_s=120")
    assert done.returncode == 1, done.stderr[-2000:]
    assert "rollout-0 died (exit code 78) on a config error, not restarted" in done.stderr
    assert "model.max_seq_len: 256 tokens leave no room for an action after the first observation of env" in (
        done.stderr)
    assert "restart 1 of" not in done.stderr
