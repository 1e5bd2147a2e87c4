"""The chaos soak's short form, as docs/results.md ("Chaos soak") prints it: the pod roles in network namespaces
under a seeded nemesis (every kind of fault: kill, pause, partition, slow link, full disk, torn log or checkpoint),
then benchmarks/chaos_check.py's verdict on the run's history, joined from the workers' ack journals and the
learner's per-item log (tests/test_chaos_check.py shows the join catching each failure on hand-made journals). The
long form is the same command with `--minutes 50 --gap-s 2.5 --seed 7` (docs/results.md says how long it last ran).

Needs root (network namespaces, tmpfs, `tc`); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from netns import namespaces_unavailable

REPO = Path(__file__).resolve().parent.parent
COMMAND = "python benchmarks/chaos.py --minutes 1 --gap-s 4 --seed 1"
KINDS = ("kill", "pause", "partition", "slow", "disk", "torn")


def _unavailable() -> str | None:
    return namespaces_unavailable() or (None if shutil.which("tc") else "iproute2's `tc` is not installed")


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))]


def test_the_documented_command_is_the_one_run_here():
    assert f"`{COMMAND}`" in (REPO / "docs" / "results.md").read_text()


def test_the_short_chaos_soak_loses_nothing_and_trains_nothing_twice(tmp_path):
    """Slow (~1.5 min; 13 faults here): at least 10 faults, every kind among them; the checker passes: every stage
    record a worker journalled as acknowledged is trained once, pending or given up by a named rule; none is trained
    twice; nothing trained that no worker sent."""
    argv = [sys.executable, *shlex.split(COMMAND)[1:], "--out", str(tmp_path / "chaos")]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.stdout.strip(), done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0 and summary["passed"], (summary["problems"], done.stderr[-3000:])
    assert summary["faults"] >= 10 and all(summary["faults_by_kind"][kind] >= 1 for kind in KINDS), summary
    # The evidence from outside the replay: the workers' ack journals joined with the learner's per-item log.
    assert summary["acked_stages_journalled"] > 0 and summary["acked_stages_trained"] > 0, summary
    assert summary["acked_stages_lost"] == 0 and summary["records_lost"] == 0
    assert summary["stages_trained_twice"] == 0 and summary["items_trained_twice"] == 0
    assert summary["spans_trained_without_sender"] == 0 and summary["journal_lines_unreadable"] == 0
    accounted = (summary["acked_stages_trained"] + summary["acked_stages_pending"]
                 + sum(summary["acked_stages_given_up"].values()))
    assert accounted == summary["acked_stages_journalled"], summary  # every acked stage has exactly one fate
    assert summary["worst_residual"] < 1e-6 and summary["versions"] == summary["target"]
    assert summary["groups_closed_checked"] > 0 and summary["records_acked"] > 0
