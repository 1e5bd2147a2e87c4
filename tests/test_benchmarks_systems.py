"""The systems and vs-TRL benchmarks run end to end in their --quick form and end with their JSON line.

Only completion and the JSON keys are asserted: the numbers depend on the machine and go in docs/results.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def run_quick(script: str, timeout_s: float) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--quick"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s,
    )
    assert result.returncode == 0, f"{script} exited {result.returncode}:\n{result.stderr[-3000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_systems_quick():
    """Slow: four measured parts, each alternating ours and a baseline in rounds (the replay's fills 10^3 and 10^4
    records; the learner part trains real steps; the durable part fsyncs)."""
    headline = run_quick("systems.py", timeout_s=600)
    assert {"transport_ratio", "learner_ratio", "replay_scale_ratio", "bytes_per_token", "durable_ratio"} <= (
        headline.keys())


@pytest.mark.skipif(
    importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None,
    reason="TRL is not installed: vs_trl needs the bench extra (pip install -e '.[bench]')",
)
def test_vs_trl_quick():
    """Slow: async-rl and TRL's GRPOTrainer each train the same tiny model to 0.8 success (one seed)."""
    headline = run_quick("vs_trl.py", timeout_s=600)
    assert {"time_to_target_ratio", "samples_ratio"} <= headline.keys()


def test_gpu_learner_quick():
    """The GPU learner benchmark's --quick form runs on whatever device there is (here the CPU); on a GPU it
    reports peak memory and MFU too."""
    headline = run_quick("gpu_learner.py", timeout_s=300)
    assert {"device", "parameters", "ours_tokens_per_s", "ratio", "same_math_ratio", "peak_gib", "mfu"} <= (
        headline.keys())
    assert headline["ours_tokens_per_s"] > 0 and headline["ratio"] > 0
