"""The durable replay (docs/architecture.md, "A durable replay"): the write-ahead log rebuilds the core exactly,
a torn tail is dropped, ids carry the replay's epoch, compaction bounds the log, and a real replay process killed
with SIGKILL and started again loses no acknowledged record."""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import yaml
import zmq
from disk_helpers import fill
from test_replay import (
    LEARNER,
    WORKER,
    Worker,
    ack_batch,
    make_config,
    outcome_messages,
    request_batch,
    stage_records,
)

from async_rl.config import Config
from async_rl.config_load import config_to_dict
from async_rl.errors import ConfigError
from async_rl.protocol import Ack, Batch, BatchAck, Error, EvalReport, Heartbeat, LeaseGrant, encode
from learner.replay_client import ReplayClient
from learner.settings import LearnerSettings
from replay.log_format import LogFormatError, Received, Ticked, Undecodable, WalError
from replay.server import apply_entry, build_service, handle_safely, start_log
from replay.service import ReplayService
from replay.wal import ReplayLog, WalWriteError, comparable
from rollout.link import ReplayLink

REPO = Path(__file__).resolve().parent.parent


class Logged:
    """A ReplayService whose inputs go to a ReplayLog the way `replay.server.run` writes them: every message and
    undecodable frame, every tick that changed the state, one commit per call (a poll round)."""

    def __init__(self, config: Config, directory: Path, compact_every: int = 100_000) -> None:
        self.service = build_service(config)
        self.wal = ReplayLog(directory, fsync=False, compact_every=compact_every)
        self.wal.recover(self.service, apply_entry)
        self.service.start_epoch(self.service.epoch + 1, 0.0)
        assert start_log(self.wal, self.service, lambda: 0.0, threading.Event())

    def handle(self, identity: bytes, message, now: float) -> list:
        self.wal.append(Received(identity, now, encode(message)))
        replies = handle_safely(self.service, identity, message, now)
        self._commit(now)
        return replies

    def tick(self, now: float) -> list:
        replies = self.service.tick(now)
        if self.service.tick_changed:
            self.wal.append(Ticked(now))
        self._commit(now)
        return replies

    def reject_frame(self, identity: bytes | None, detail: str, now: float) -> list:
        self.wal.append(Undecodable(identity, detail, now))
        replies = self.service.reject_frame(identity, detail)
        self._commit(now)
        return replies

    def _commit(self, now: float) -> None:
        self.wal.commit()
        if self.wal.due():
            self.wal.compact(self.service, now)


def rebuilt(config: Config, directory: Path) -> tuple[ReplayService, ReplayLog]:
    service = build_service(config)
    wal = ReplayLog(directory, fsync=False)
    wal.recover(service, apply_entry)
    return service, wal


def only(replies: list, identity: bytes):
    mine = [message for peer, message in replies if peer == identity]
    assert len(mine) == 1, replies
    return mine[0]


def scripted_run(logged: Logged) -> None:
    """Leases, records, outcomes, batches and acks, a refused record, an undecodable frame, a lease expiry, a
    stage-group timeout, a batch requeued after its ack timeout (and its late ack refused), a parked request."""
    worker, other = Worker(), Worker("worker-1")
    grants = [only(logged.handle(WORKER, worker.lease(), 0.0), WORKER) for _ in range(2)]
    lost = only(logged.handle(b"worker-1", other.lease(), 0.0), b"worker-1")
    assert all(isinstance(g, LeaseGrant) for g in [*grants, lost])
    for message in stage_records(worker, grants[0]):
        assert isinstance(only(logged.handle(WORKER, message, 1.0), WORKER), Ack)
    logged.handle(b"worker-1", other.stage(lost, 0, 0, 1.0), 1.0)  # then worker-1 falls silent
    logged.handle(WORKER, msgspec.structs.replace(worker.stage(grants[1], 0, 0, 1.0), stage_reward=math.nan), 1.5)
    logged.reject_frame(b"fuzzer", "malformed message: garbage", 1.6)
    logged.handle(WORKER, worker.stage(grants[1], 1, 0, 0.5), 2.0)
    first = only(logged.handle(LEARNER, _request(1, 0), 2.0), LEARNER)
    assert isinstance(first, Batch) and first.items
    logged.tick(7.0)  # batch_ack_timeout_s: first goes back to the queue
    second = only(logged.handle(LEARNER, _request(3, 0), 8.0), LEARNER)
    assert isinstance(only(logged.handle(LEARNER, _ack(2, first, 1), 8.0), LEARNER), Error)  # its items went again
    assert isinstance(only(logged.handle(LEARNER, _ack(4, second, 1), 9.0), LEARNER), Ack)
    for message in outcome_messages(worker, grants[0]):
        logged.handle(WORKER, message, 10.0)
    logged.handle(WORKER, Heartbeat(worker_id="worker-0", group_ids=[grants[1].group_id]), 11.0)
    logged.tick(52.0)  # worker-1's lease expired (silent since t=1); grants[1]'s stage group 0 timed out
    assert logged.handle(LEARNER, _request(5, 1, min_items=100, max_wait_s=60.0), 61.0) == [], "parked"
    logged.tick(61.5)


def _request(msg_id: int, version: int, min_items: int = 1, max_wait_s: float = 0.0):
    from async_rl.protocol import BatchRequest

    return BatchRequest(learner_id="learner", msg_id=msg_id, policy_version=version, max_tokens=10**6,
                        min_items=min_items, max_wait_s=max_wait_s)


def _ack(msg_id: int, batch: Batch, version: int) -> BatchAck:
    return BatchAck(learner_id="learner", msg_id=msg_id, batch_id=batch.batch_id, policy_version=version)


SCRIPT_CONFIG = {"replay": {"batch_ack_timeout_s": 5.0, "lease_timeout_s": 50.0}}


@pytest.mark.parametrize("compact_every", [100_000, 7])
def test_the_core_rebuilt_from_its_log_equals_the_original(tmp_path: Path, compact_every: int):
    config = make_config(**SCRIPT_CONFIG)
    logged = Logged(config, tmp_path / "replay", compact_every)
    scripted_run(logged)
    original = logged.service
    stats = original.stats_snapshot()
    assert stats.trajectories_abandoned >= 2 and stats.rejected.keys() >= {"nonfinite_reward", "undecodable",
                                                                            "batch_not_in_flight"}
    assert len(original.queue) and original.parked and original.groups, "a state worth rebuilding"
    logged.wal.close()

    service, wal = rebuilt(config, tmp_path / "replay")
    assert comparable(service) == comparable(original)
    assert service.stats_snapshot() == stats
    assert [q.item for q in service.queue] == [q.item for q in original.queue]
    # Both go on alike: the same batch, the same acks, the same closed groups and residual.
    for s in (original, service):
        s.start_epoch(2, 62.0)
    batches = [request_batch(s, version=1, now=62.0, max_wait_s=0.0) for s in (original, service)]
    assert batches[0] == batches[1] and batches[0] is not None
    for s, batch in zip((original, service), batches, strict=True):
        assert isinstance(ack_batch(s, batch, version=2, now=63.0), Ack)
    assert comparable(service) == comparable(original)
    wal.close()


def test_a_torn_tail_is_dropped_and_the_rest_rebuilds(tmp_path: Path):
    config = make_config()
    logged = Logged(config, tmp_path / "replay")
    worker = Worker()
    grant = only(logged.handle(WORKER, worker.lease(), 0.0), WORKER)
    records = stage_records(worker, grant)
    for record in records[:3]:
        logged.handle(WORKER, record, 1.0)
    expected = comparable(logged.service)
    logged.handle(WORKER, records[3], 1.0)
    logged.wal.close()
    segment = next((tmp_path / "replay").glob("wal-*.log"))
    data = segment.read_bytes()
    segment.write_bytes(data[:-5])  # the last entry's write was cut short

    service, wal = rebuilt(config, tmp_path / "replay")
    assert comparable(service) == expected and wal.dropped_bytes > 0
    assert service.stats_snapshot().env_steps == 3
    wal.close()

    segment.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # a corrupt last byte: the checksum catches it
    service, wal = rebuilt(config, tmp_path / "replay")
    assert comparable(service) == expected
    wal.close()


def test_each_start_is_a_new_epoch_and_old_ids_stay_valid_for_rebuilt_groups(tmp_path: Path):
    config = make_config()
    logged = Logged(config, tmp_path / "replay")
    worker = Worker()
    before = only(logged.handle(WORKER, worker.lease(), 0.0), WORKER)
    records = stage_records(worker, before)
    for record in records[:4]:  # stage group 0 complete: four immediate items
        logged.handle(WORKER, record, 1.0)
    served = only(logged.handle(LEARNER, _request(1, 0), 1.0), LEARNER)
    logged.wal.close()

    restarted = Logged(config, tmp_path / "replay")  # what run() does on a start
    service = restarted.service
    assert service.epoch == 2 and before.group_id.startswith("e1.")
    after = only(restarted.handle(WORKER, Worker("worker-1").lease(), 2.0), WORKER)
    assert after.group_id.startswith("e2.") and after.group_id != before.group_id, "a new group, a new id"
    # The batch in flight at the crash stays in flight: the learner trained it, and its ack counts (requeued, its
    # items would be trained twice).
    late = only(restarted.handle(LEARNER, _ack(2, served, 1), 2.0), LEARNER)
    assert isinstance(late, Ack), "in flight at the crash: its ack still counts"
    resent = only(restarted.handle(WORKER, records[0], 2.0), WORKER)
    assert resent == Ack(msg_id=records[0].msg_id, duplicate=True), "a pre-crash resend names the rebuilt group"
    for record in records[4:]:
        assert isinstance(only(restarted.handle(WORKER, record, 2.0), WORKER), Ack)
    again = only(restarted.handle(LEARNER, _request(3, 1), 3.0), LEARNER)
    served_ids = {i.item_id for i in served.items}
    assert again.items and not served_ids & {i.item_id for i in again.items}, "nothing of the acked batch again"
    assert {i.item_id >> 32 for i in served.items} == {1} and {i.item_id >> 32 for i in again.items} == {2}, \
        "item ids carry the epoch that made them"
    assert again.batch_id >> 32 == 2 and served.batch_id >> 32 == 1
    restarted.wal.close()


def test_a_second_replay_on_the_same_log_is_refused_and_an_unusable_dir_is_named(tmp_path: Path):
    wal = ReplayLog(tmp_path / "replay")
    with pytest.raises(WalError, match="another replay process"):
        ReplayLog(tmp_path / "replay")
    wal.close()
    ReplayLog(tmp_path / "replay").close()
    (tmp_path / "file").write_text("")
    with pytest.raises(WalError, match=r"replay.durable: cannot keep the replay's log in .*file/replay"):
        ReplayLog(tmp_path / "file" / "replay")


def test_compaction_bounds_the_log_over_a_long_run_and_the_state_rebuilds(tmp_path: Path):
    config = make_config(algo={"groups_per_step": 1000})
    logged = Logged(config, tmp_path / "replay", compact_every=200)
    worker, msg_ids = Worker(), iter(range(10**6))
    sizes, version, batches = [], 0, []

    def send(identity: bytes, message, now: float) -> None:
        batches.extend(reply for _, reply in logged.handle(identity, message, now) if isinstance(reply, Batch))

    for n in range(150):  # 14 log entries a group: about 2100 in all
        grant = only(logged.handle(WORKER, worker.lease(), n), WORKER)
        for message in [*stage_records(worker, grant, version), *outcome_messages(worker, grant)]:
            send(WORKER, message, n)
        send(LEARNER, _request(next(msg_ids), version), n)
        while batches:
            version += 1
            send(LEARNER, _ack(next(msg_ids), batches.pop(), version), n)
        sizes.append(logged.wal.size_bytes())
    assert logged.service.counters.groups_closed >= 140 and logged.wal.segment > 5
    assert max(sizes[50:]) <= 1.5 * max(sizes[:50]), f"the log grows: {sizes[::15]}"
    expected = comparable(logged.service)
    logged.wal.close()
    service, wal = rebuilt(config, tmp_path / "replay")
    assert comparable(service) == expected
    names = sorted(p.name for p in (tmp_path / "replay").glob("*"))
    n = wal.segment
    assert names == ["lock", f"snapshot-{n - 1:08d}.msgpack", f"snapshot-{n:08d}.msgpack", f"wal-{n - 1:08d}.log",
                     f"wal-{n:08d}.log"], "two snapshots, their segments (the previous ones for a fallback), the lock"
    wal.close()


def test_the_log_settings_are_validated_by_their_dotted_key():
    from async_rl.config_load import config_from_dict
    from async_rl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"replay.compact_every: expected int >= 1, got 0"):
        config_from_dict({"replay": {"compact_every": 0}})
    with pytest.raises(ConfigError, match=r"replay.durable: expected bool"):
        config_from_dict({"replay": {"durable": "sometimes"}})


# --- a real replay process, killed and started again ----------------------------------------------------------


def start_replay(config_path: Path, log_path: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with open(log_path, "ab") as log_file:
        return subprocess.Popen([sys.executable, "-m", "launch.cli", "replay", "--config", str(config_path)],
                                cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_a_sigkilled_replay_restarted_with_the_same_config_loses_no_acked_record(tmp_path: Path):
    """Real processes and sockets: a rollout link and a learner client (this process) against `async-rl replay`,
    SIGKILLed mid-run and started again with the same command; the clients re-send what was not acknowledged."""
    groups, group_size, stages = 12, 4, 3
    config = make_config(
        run={"dir": str(tmp_path), "name": "run"},
        # A batch the learner client did not take (it answers a request older than the client's last 8, sent while
        # the replay was down) waits batch_ack_timeout_s before it is served again: keep that short.
        replay={"endpoint": f"ipc://{tmp_path}/replay.ipc", "batch_ack_timeout_s": 4.0},
        rollout={"ack_timeout_s": 0.5},
        # checkpoint_every 0: groups close at once (this learner client reports no checkpoints, so with learner
        # checkpoints on the replay would hold every group open for a rollback that cannot come)
        learner={"request_timeout_s": 2.0, "min_batch_items": 1, "batch_wait_s": 0.0, "checkpoint_every": 0,
                 "publish_endpoint": f"ipc://{tmp_path}/weights.ipc"},  # not used by the replay; a pod needs one
        algo={"groups_per_step": 100},
    )
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config_to_dict(config)))
    replay_log = tmp_path / "replay.log"
    process = start_replay(config_path, replay_log)
    context = zmq.Context()
    from async_rl.transport import connect_dealer

    link = ReplayLink(connect_dealer(context, config.replay.endpoint, "rollout-0"), "rollout-0", 0.5, 0.5)
    client = ReplayClient(context, config.replay.endpoint, "learner-0", config.learner.request_timeout_s)
    worker = Worker("rollout-0")
    worker.msg_ids = iter(range(10**6, 10**7))  # the link's own ids are not used: the messages come built
    granted: list[LeaseGrant] = []
    sent = acked_before_kill = 0
    killed_at = None
    residual, version = 0.0, 0

    def pump() -> None:
        nonlocal sent, acked_before_kill, killed_at, process
        assert process.poll() is None, "the replay died:\n" + replay_log.read_text()[-3000:]
        for reply in link.handle_replies(0.0):
            assert isinstance(reply, LeaseGrant), reply
            granted.append(reply)
            for message in [*stage_records_of(worker, reply, group_size, stages),
                            *[worker.outcome(reply, i, stages, float(i % 2)) for i in range(group_size)]]:
                link.send_reliably(message)
                sent += 1
        if link.lease_request is None and len(granted) < groups:
            link.request_lease()
        link.tick([g.group_id for g in granted])
        if killed_at is None and len(granted) >= groups // 2:
            acked_before_kill = sent - len(link.unacked)
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)
            killed_at = time.monotonic()
            process = start_replay(config_path, replay_log)  # the same command, the same config

    deadline = time.monotonic() + 120
    last_batch = time.monotonic()

    def done() -> bool:  # everything sent and acknowledged, and the learner idle past batch_ack_timeout_s
        idle = time.monotonic() - last_batch > config.replay.batch_ack_timeout_s + 2.0
        finished = len(granted) == groups and not link.unacked and idle
        return finished or time.monotonic() > deadline

    try:
        request = LearnerSettings.from_config(config).client.request
        while (batch := client.next_batch(version, request, done, pump)) is not None:
            version += 1
            client.ack(batch, version)
            residual = max(residual, batch.stats.ledger_residual_max)
            last_batch = time.monotonic()
        assert time.monotonic() < deadline, "the run did not finish:\n" + replay_log.read_text()[-3000:]
        assert killed_at is not None and acked_before_kill > 0
        assert link.resends > 0, "the link re-sent what the killed replay had not acknowledged"
    finally:
        link.socket.close(linger=0)
        client.close()
        context.term()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0, replay_log.read_text()[-3000:]
    text = replay_log.read_text()
    assert "rebuilt the replay from" in text and "epoch 2" in text

    service, wal = rebuilt(config, config.run_dir / "replay")  # the state the replay left in its log
    wal.close()
    stats = service.stats_snapshot()
    assert stats.groups_closed == groups and not service.groups and not service.in_flight, stats
    assert stats.env_steps == groups * group_size * stages, "every stage record counted once"
    assert stats.trajectories_finished == groups * group_size and stats.trajectories_abandoned == 0
    assert "unknown_group" not in stats.rejected, stats.rejected
    assert max(residual, stats.ledger_residual_max) < 1e-9, "the ledger invariant holds across the restart"


def stage_records_of(worker: Worker, grant: LeaseGrant, group_size: int, stages: int) -> list:
    return [worker.stage(grant, i, k, float((i + k) % 2), terminal=k == stages - 1)
            for k in range(stages) for i in range(group_size)]


def _session_request(msg_id: int, version: int, session: int, checkpoint: int):
    from async_rl.protocol import BatchRequest

    return BatchRequest(learner_id="learner", msg_id=msg_id, policy_version=version, max_tokens=20, min_items=1,
                        max_wait_s=0.0, session=session, checkpoint=checkpoint)


@pytest.mark.parametrize("compact_every", [100_000, 5])
def test_a_learner_rollback_and_the_guard_s_state_rebuild_from_the_log(tmp_path: Path, compact_every: int):
    """The state of resume-after-crash (sessions, reported checkpoint, the journal of undoable acks, rollbacks) and
    of the correction guard is in the log and in its snapshots: the rebuilt core equals the original."""
    config = make_config(learner={"checkpoint_every": 2}, algo={"max_staleness": 100, "max_correction_staleness": 100})
    logged = Logged(config, tmp_path / "replay", compact_every)
    worker = Worker()
    grants = [only(logged.handle(WORKER, worker.lease(), 0.0), WORKER) for _ in range(2)]
    for grant in grants:
        for message in stage_records(worker, grant):
            logged.handle(WORKER, message, 1.0)
    msg_id = 100
    for version, checkpoint in enumerate((0, 0, 2)):  # the learner reports its checkpoint at v2 before its third step
        msg_id += 2
        batch = only(logged.handle(LEARNER, _session_request(msg_id, version, 1, checkpoint), 2.0 + version), LEARNER)
        assert isinstance(batch, Batch) and batch.items, batch
        ack = _ack(msg_id + 1, batch, version + 1)
        assert isinstance(only(logged.handle(LEARNER, ack, 3.5 + version), LEARNER), Ack)
    for message in outcome_messages(worker, grants[0]):
        logged.handle(WORKER, message, 6.0)
    # SIGKILL after v3; a new learner process comes back at its checkpoint, v2: the v3 ack is undone.
    logged.handle(LEARNER, _session_request(200, 2, 2, 2), 7.0)
    logged.tick(8.0)
    original = logged.service
    assert original.counters.rollbacks == 1 and original.counters.items_rolled_back > 0
    assert original.learner_session == 2 and original.checkpointed == 2
    logged.wal.close()

    service, wal = rebuilt(config, tmp_path / "replay")
    assert comparable(service) == comparable(original)
    assert service.stats_snapshot() == original.stats_snapshot()
    assert [q.item for q in service.queue] == [q.item for q in original.queue]
    wal.close()


# --- a log written before the replay was split by job (tests/data/replay_log_v1, written by the replay of cceb674) ---

OLD_RUN = REPO / "tests" / "data" / "replay_log_v1"
OLD_FORMAT = ("replay log format 1 (written before the replay was split by job); this build reads format 2 only: "
              "resume it with the async-rl version that wrote it, or move its replay/ directory away")


def test_a_log_written_before_the_split_is_refused_naming_its_format_and_ours(tmp_path: Path):
    shutil.copytree(OLD_RUN / "replay", tmp_path / "replay")
    wal = ReplayLog(tmp_path / "replay", fsync=False)
    with pytest.raises(LogFormatError, match=re.escape(OLD_FORMAT)) as refused:
        wal.recover(build_service(make_config()), apply_entry)
    assert isinstance(refused.value, ConfigError), "a restart would meet it again: async-rl train does not restart"
    wal.close()
    for path in (OLD_RUN / "replay").iterdir():
        assert (tmp_path / "replay" / path.name).read_bytes() == path.read_bytes(), "nothing of the old log changed"


def test_resume_of_a_run_whose_log_is_from_before_the_split_says_so_and_starts_nothing(tmp_path: Path):
    run_dir = tmp_path / "replay_log_v1"
    shutil.copytree(OLD_RUN, run_dir)
    resumed = subprocess.run([sys.executable, "-m", "launch.cli", "train", "--resume", str(run_dir)],
                             capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert f"async-rl train: {run_dir / 'replay' / 'snapshot-00000002.msgpack'}: {OLD_FORMAT}" in resumed.stderr
    assert "Traceback" not in resumed.stderr and not (run_dir / "logs").exists(), "no role was started"


# --- a full disk, a corrupt snapshot (docs/architecture.md, "A durable replay") ----------------------------------


def big_report(worker: Worker, size: int = 2000) -> EvalReport:
    """A message larger than a page: its entry needs a new page of the log file, so a full disk refuses it."""
    return EvalReport(worker_id=worker.worker_id, msg_id=next(worker.msg_ids), policy_version=0,
                      metrics={f"metric_{i}": float(i) for i in range(size)})


def test_a_full_disk_refuses_a_commit_whole_and_it_goes_in_once_space_is_back(small_disk: Path):
    config = make_config()
    logged = Logged(config, small_disk / "replay")
    worker = Worker()
    grant = only(logged.handle(WORKER, worker.lease(), 0.0), WORKER)
    for record in stage_records(worker, grant)[:3]:
        logged.handle(WORKER, record, 1.0)
    segment = small_disk / "replay" / f"wal-{logged.wal.segment:08d}.log"
    durable = segment.stat().st_size
    filler = fill(small_disk)

    report = big_report(worker)
    logged.wal.append(Received(WORKER, 2.0, encode(report)))
    handle_safely(logged.service, WORKER, report, 2.0)
    with pytest.raises(WalWriteError, match=rf"{re.escape(str(segment))}: could not write 1 entries .*ENOSPC"):
        logged.wal.commit()
    assert segment.stat().st_size == durable, "nothing of the refused write stays in the log"
    with pytest.raises(WalWriteError):
        logged.wal.commit()  # still full: refused again, still whole
    filler.unlink()
    assert logged.wal.commit(), "the same entries, written once space came back"
    logged.handle(WORKER, stage_records(worker, grant)[3], 3.0)
    expected = comparable(logged.service)
    logged.wal.close()
    service, wal = rebuilt(config, small_disk / "replay")
    assert comparable(service) == expected and wal.dropped_bytes == 0
    assert service.state.outcomes.latest_eval["metric_1999"] == 1999.0
    wal.close()


def test_a_snapshot_the_full_disk_refused_leaves_the_log_going_on_in_its_segment(small_disk: Path):
    config = make_config(**SCRIPT_CONFIG)
    logged = Logged(config, small_disk / "replay")
    scripted_run(logged)
    directory = small_disk / "replay"
    before = sorted(p.name for p in directory.iterdir())
    filler = fill(small_disk)
    segment = logged.wal.segment
    refused = rf"snapshot-{segment + 1:08d}.msgpack: could not write a snapshot .*ENOSPC"
    with pytest.raises(WalWriteError, match=refused):
        logged.wal.compact(logged.service, 62.0)
    assert sorted(p.name for p in directory.iterdir()) == before, "no temporary, no new segment left behind"
    assert logged.wal.segment == segment and not logged.wal.due()
    filler.unlink()
    worker = Worker("worker-2")
    only(logged.handle(b"worker-2", worker.lease(), 63.0), b"worker-2")  # into the segment that goes on
    expected = comparable(logged.service)
    logged.wal.close()
    service, wal = rebuilt(config, directory)
    assert comparable(service) == expected
    wal.close()


def test_a_replay_whose_disk_fills_holds_its_acks_and_resumes_when_space_comes_back(small_disk: Path, tmp_path,
                                                                                     caplog):
    """A real replay loop and socket: at ENOSPC it logs the file and the errno, sends no ack for what it could not
    write, does not die, and acks it once the disk takes it; the log then holds everything acknowledged."""
    from async_rl.transport import connect_dealer, receive, send
    from replay import server

    config = make_config(run={"dir": str(small_disk), "name": "run"},
                         replay={"endpoint": f"ipc://{tmp_path}/replay.ipc", "lease_timeout_s": 2.0})
    service, stop = build_service(config), threading.Event()
    ticks, ticked, tick = [0], threading.Condition(), service.tick

    def counted_tick(now: float) -> list:  # the loop's timer rounds, to wait on
        replies = tick(now)
        with ticked:
            ticks[0] += 1
            ticked.notify_all()
        return replies

    service.tick = counted_tick  # type: ignore[method-assign]
    thread = threading.Thread(target=server.run, args=(config, stop, service), daemon=True)
    thread.start()
    context = zmq.Context()
    dealer = connect_dealer(context, config.replay.endpoint, "worker-0")
    worker = Worker()

    def reply(timeout_s: float):
        if not dealer.poll(int(timeout_s * 1000)):
            return None
        return receive(dealer)[1]

    try:
        send(dealer, worker.lease())
        assert isinstance(reply(10.0), LeaseGrant)
        filler = fill(small_disk)
        report = big_report(worker)
        with caplog.at_level(logging.ERROR, logger="async_rl.replay"):
            send(dealer, report)
            assert reply(3.0) is None, "no ack for an input the disk did not take"
            assert thread.is_alive(), "the replay holds, it does not die"
            held = [r.getMessage() for r in caplog.records if "the replay holds" in r.getMessage()]
            assert held and "ENOSPC" in held[0] and str(config.run_dir / "replay" / "wal-") in held[0], held
        filler.unlink()
        assert reply(10.0) == Ack(msg_id=report.msg_id), "acked once the disk took it"
        with ticked:  # a few rounds of timers after the hold (each one past the lease, had the hold counted)
            after = ticks[0]
            assert ticked.wait_for(lambda: ticks[0] >= after + 3, 10), "the replay loop stopped ticking"
    finally:
        stop.set()
        thread.join(timeout=20)
        dealer.close(linger=0)
        context.term()
    assert not thread.is_alive()
    assert service.counters.trajectories_abandoned == 0, "the time held does not count against the lease (2 s)"
    expected = comparable(service)
    rebuilt_service, wal = rebuilt(config, config.run_dir / "replay")
    assert comparable(rebuilt_service) == expected, "everything acknowledged is in the log"
    assert rebuilt_service.state.outcomes.latest_eval["metric_1999"] == 1999.0
    wal.close()


def corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if how == "torn" else
                     data[:-10] + bytes([data[-10] ^ 0x01]) + data[-9:])


@pytest.mark.parametrize("how", ["torn", "flipped"])
def test_a_corrupt_snapshot_falls_back_to_the_one_before_and_its_segments(tmp_path: Path, caplog, how: str):
    config = make_config(**SCRIPT_CONFIG)
    directory = tmp_path / "replay"
    logged = Logged(config, directory)
    worker = Worker()
    grant = only(logged.handle(WORKER, worker.lease(), 0.0), WORKER)
    records = stage_records(worker, grant)
    for record in records[:4]:
        logged.handle(WORKER, record, 1.0)
    logged.wal.close()
    logged = Logged(config, directory)  # a restart: its epoch in segment 1, then snapshot 2
    for record in records[4:]:
        logged.handle(WORKER, record, 2.0)
    after = only(logged.handle(b"worker-1", Worker("worker-1").lease(), 2.0), b"worker-1")
    assert after.group_id.startswith("e2.")
    expected = comparable(logged.service)
    logged.wal.close()

    newest = directory / "snapshot-00000002.msgpack"
    corrupt(newest, how)
    with caplog.at_level(logging.WARNING, logger="async_rl.replay.wal"):
        service, wal = rebuilt(config, directory)
    assert comparable(service) == expected, "snapshot 1 + segments 1 and 2 are what snapshot 2 held, and more"
    assert any("corrupt snapshot" in r.getMessage() and "falling back to snapshot 1" in r.getMessage()
               for r in caplog.records)
    assert not newest.exists() and (directory / "snapshot-00000002.msgpack.corrupt").exists()
    wal.close()
    restarted = Logged(config, directory)  # and it starts again from there
    assert restarted.service.epoch == 3
    restarted.wal.close()


def test_a_corrupt_snapshot_with_nothing_to_fall_back_to_says_what_to_do(tmp_path: Path):
    config = make_config()
    Logged(config, tmp_path / "replay").wal.close()
    corrupt(tmp_path / "replay" / "snapshot-00000001.msgpack", "flipped")
    with pytest.raises(WalError, match=r"snapshot-00000001.msgpack: corrupt snapshot .* no older snapshot to fall "
                                       r"back to: restore .* from a backup, or move it away"):
        rebuilt(config, tmp_path / "replay")
