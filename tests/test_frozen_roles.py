"""Roles frozen rather than killed, and a worker that never finishes (issue 39, Build 2), in real `async-rl train`
runs: a rollout worker SIGSTOPped until its leases expire, then SIGCONTed; the learner SIGSTOPped until its batch is
requeued, then SIGCONTed; a worker on the replay's socket that takes leases and heartbeats but never sends an outcome.
Each run must reach its budget with every invariant of tests/test_faults.py (no acked record lost, no item trained
twice, the ledger exact, no process left). tests/test_replay_frozen.py checks the same rules in the replay core."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq
from test_faults import FAULT_RUN, check_run, killed_on_failure, wait_for_versions

from async_rl.config_load import load_config
from async_rl.protocol import LOGPROB, TOKEN, Heartbeat, LeaseGrant, LeaseRequest, StageRecord, pack
from async_rl.transport import connect_dealer, poll, receive, send

pytestmark = pytest.mark.slow

MAX_VERSIONS = 24


def start(tmp_path: Path, *overrides: str, max_versions: int = MAX_VERSIONS) -> tuple[subprocess.Popen, Path]:
    args = [sys.executable, "-m", "launch.cli", "train", f"run.dir={tmp_path}", "run.name=t", *FAULT_RUN,
            f"run.max_versions={max_versions}", "run.metrics_every_s=1", *overrides]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), tmp_path / "t"


def finish(launcher: subprocess.Popen) -> tuple[str, str]:
    with killed_on_failure(launcher):
        out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err[-3000:]
    return out, err


def pid_of(run_dir: Path, role: str) -> int:
    return json.loads((run_dir / "processes.json").read_text())[role]


def wait_for_log(path: Path, text: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return True
        time.sleep(0.05)
    return False


def role_lines(run_dir: Path, role: str) -> list[dict]:
    path = run_dir / "metrics" / f"{role}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def test_a_rollout_worker_frozen_past_its_lease_is_refused_nothing_and_recovers(tmp_path):
    """SIGSTOP rollout-0 until the replay gives up its leases, then SIGCONT: the groups it held were finalized over
    their finished members; what it sends late for them is acked as a duplicate and stored nowhere; it goes on to
    new leases; the run reaches its budget with every invariant."""
    # The other worker goes on meanwhile: the run must outlast the freezes (v0 to v80 took 9 s beside other tests).
    versions = 200
    launcher, run_dir = start(tmp_path, "replay.lease_timeout_s=2", "rollout.heartbeat_s=0.5",
                              "rollout.max_inflight=8", max_versions=versions)
    try:
        wait_for_versions(run_dir, 3, launcher)
        worker = pid_of(run_dir, "rollout-0")
        # Only a worker that holds leases is given up. It is frozen once it has trajectories in flight (on a loaded
        # machine it can still be starting when the run reaches v3), and frozen again if it held none at that
        # moment (waiting on admission, between groups), as the learner's test does.
        deadline = time.monotonic() + 120
        lines = run_dir / "metrics" / "rollout-0.jsonl"
        while not (lines.exists() and any(line.get("in_flight") for line in role_lines(run_dir, "rollout-0"))):
            assert launcher.poll() is None and time.monotonic() < deadline, "rollout-0 never had work in flight"
            time.sleep(0.05)
        for _ in range(10):
            os.kill(worker, signal.SIGSTOP)
            try:
                expired = wait_for_log(run_dir / "logs" / "replay.log", "worker rollout-0 silent", 5)
            finally:
                os.kill(worker, signal.SIGCONT)
            if expired or launcher.poll() is not None:
                break
            time.sleep(0.3)
        assert expired, "the worker never held a lease while frozen"
        lines_at_thaw = len(role_lines(run_dir, "rollout-0"))
    finally:
        _, err = finish(launcher)
    assert "rollout-0 died" not in err, "the thawed worker did not crash"
    numbers = check_run(run_dir, versions)
    replay = role_lines(run_dir, "replay")[-1]  # the replay's own counters, to its end
    # Its late records: for a member of a group still open (late_records) or of one that closed once every member
    # was abandoned (closed_group_resends), acked as duplicates either way.
    late = replay["late_records"] + replay["closed_group_resends"]
    assert replay["trajectories_abandoned"] > 0 and late > 0, replay
    # The thawed worker went on: it finished more trajectories after the thaw than it held when it froze (8).
    after = role_lines(run_dir, "rollout-0")[lines_at_thaw:]
    assert sum(line["trajectories_finished"] for line in after) > 8, after
    assert after[-1]["duplicate_acks"] > 0, "its late records were acked as duplicates"
    print(json.dumps({"fault": "SIGSTOP rollout-0", **numbers, "late_records": late}))


def test_a_learner_frozen_past_its_batch_ack_timeout_trains_nothing_twice(tmp_path):
    """SIGSTOP the learner until the replay requeues the batch it holds, then SIGCONT: its late ack takes the items
    still queued, so they are not served (and trained) again; versions go on from where it stopped. Outcome-only:
    every item is a correction, so none of the batch is superseded meanwhile (an immediate whose group finalized
    while it was requeued is carried by its correction instead: replay/serving.py)."""
    launcher, run_dir = start(tmp_path, "replay.batch_ack_timeout_s=2", "algo.updates=outcome-only")
    replay_log = run_dir / "logs" / "replay.log"
    try:
        wait_for_versions(run_dir, 5, launcher)
        learner = pid_of(run_dir, "learner")
        for _ in range(10):  # frozen between two requests (nothing in flight), it is thawed and frozen again
            requeues = replay_log.read_text().count("not acked within")
            os.kill(learner, signal.SIGSTOP)
            try:
                deadline, requeued = time.monotonic() + 6, False
                while not requeued and time.monotonic() < deadline:
                    requeued = replay_log.read_text().count("not acked within") > requeues
                    time.sleep(0.05)
            finally:
                os.kill(learner, signal.SIGCONT)
            if requeued:
                break
            time.sleep(0.3)
        assert requeued, "the learner never held a batch while frozen"
    finally:
        finish(launcher)
    numbers = check_run(run_dir, MAX_VERSIONS)  # among them: no item trained twice, versions 1..MAX in order
    assert role_lines(run_dir, "replay")[-1]["late_batch_acks"] >= 1
    assert "late ack of batch" in replay_log.read_text()
    latest = json.loads((run_dir / "weights" / "latest.json").read_text())
    assert latest["version"] == MAX_VERSIONS, "the published versions never went back"
    print(json.dumps({"fault": "SIGSTOP learner", **numbers}))


class StuckWorker:
    """A worker with a bug, on the replay's socket: it asks for a group whenever it may, sends one stage record of
    member 0, heartbeats, and never sends an outcome."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.socket = connect_dealer(self.context, endpoint, "rollout-stuck")
        self.grants: list[LeaseGrant] = []
        self.stop = threading.Event()
        self.msg_ids = itertools.count(1)
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        session, open_request, next_heartbeat = time.time_ns(), None, 0.0
        while not self.stop.is_set():
            if open_request is None:
                open_request = next(self.msg_ids)
                send(self.socket, LeaseRequest(worker_id="rollout-stuck", msg_id=open_request, session=session))
            if time.monotonic() >= next_heartbeat:
                next_heartbeat = time.monotonic() + 0.5
                send(self.socket, Heartbeat(worker_id="rollout-stuck", session=session))
            while poll(self.socket, 0.05):
                reply = receive(self.socket)[1]
                if getattr(reply, "msg_id", None) == open_request:
                    open_request = None
                    time.sleep(0.05)  # a denied request is asked again soon, a granted one at once
                if isinstance(reply, LeaseGrant):
                    self.grants.append(reply)
                    send(self.socket, self.record(reply))

    def record(self, grant: LeaseGrant) -> StageRecord:
        return StageRecord(
            msg_id=next(self.msg_ids), worker_id="rollout-stuck", group_id=grant.group_id,
            trajectory_id=f"{grant.group_id}/stuck-0", member=0, task_id="stuck", stage_index=0,
            observation_tokens=pack([1, 2, 3], TOKEN), action_tokens=pack([4, 5], TOKEN),
            behaviour_logprobs=pack([-1.0, -1.0], LOGPROB), policy_versions=pack([grant.policy_version] * 2, TOKEN),
            stage_reward=0.0, terminal=False,
        )

    def __enter__(self) -> StuckWorker:
        self.thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.context.destroy(linger=0)


def test_a_worker_that_never_finishes_holds_at_most_max_open_groups_and_the_run_goes_on(tmp_path):
    """A stuck worker beside a real one: past replay.max_open_groups its oldest groups are given up, so the groups
    waiting for outcomes stay at most the cap (the replay's metrics line, every second), and the real worker's
    groups keep training to the budget."""
    # The real worker alone holds up to ~8 groups here (8 trajectories, then their judges). 100 versions: the stuck
    # worker's share of admission falls when the machine is loaded (16 grants in 60 versions at a load of 5-7)
    cap, versions = 12, 100
    launcher, run_dir = start(tmp_path, f"replay.max_open_groups={cap}", "rollout.workers=1",
                              "rollout.max_inflight=8", max_versions=versions)
    try:
        wait_for_versions(run_dir, 1, launcher)
        with StuckWorker(load_config(run_dir / "config.yaml").replay.endpoint) as stuck:
            wait_for_versions(run_dir, versions, launcher, timeout_s=400)
            grants = len(stuck.grants)
    finally:
        finish(launcher)
    numbers = check_run(run_dir, versions)
    held = [line["leases_held"] for line in role_lines(run_dir, "replay")]
    assert grants > cap + 4, f"the stuck worker got {grants} groups: too few to show the bound"
    assert max(held) <= cap, held
    replay = role_lines(run_dir, "replay")[-1]
    assert replay["groups_given_up"] >= grants - cap, replay
    print(json.dumps({"fault": "stuck worker", **numbers, "stuck_grants": grants, "leases_held_max": max(held),
                      "groups_given_up": replay["groups_given_up"]}))
