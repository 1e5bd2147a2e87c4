"""The checker of benchmarks/chaos.py: reads a soaked run's records and verifies its history.

What it reads: the learner's metrics.jsonl (with `learner.log_item_ids`: the item ids each version trained) and
summary.json, and the replay's whole write-ahead log as the harness archived it (every snapshot and segment file
copied each time the replay was down, and at the end: `replay.compact_every` is set high enough that only a
start compacts, and a start deletes only files the archive already holds). The archive is replayed from its first
snapshot through every segment into a fresh ReplayService (replay/wal.py's own recovery), with every closed
group's ledger residual recorded on the way; its final state must equal what the run's own log rebuilds.

What it verifies (`check`, which returns the numbers and the list of violations):
- the run reached its target: the surviving lineage (tests/test_faults.py `surviving_lineage`) is versions
  1..target without a gap, and summary.json says max_versions at the target;
- from outside the replay, the workers' journals (rollout/ack_journal.py: what each sent and what the replay
  acked) joined with the learner's per-item log (async_rl/evidence.py) over the surviving lineage (`join_evidence`):
  every acknowledged stage trained (by at most one immediate and one correction item), still pending, or given up
  by a named rule (counted by reason); none lost; nothing trained twice; no trained span that no worker sent;
- what truncating tears cut (the kept copies in OUT/torn/, `cut_by_tears`): the acknowledged records and batches
  among the cut frames, so the join can name them and a batch the log forgot explains its items' second training;
- no item id trained twice in the surviving lineage nor both trained and still queued (unless a tear cut its batch);
- every group closed in the whole history has a ledger residual < 1e-6 (and every metrics line's too);
- no process of the run is left (tests/test_faults.py `processes_of`).
The replay's cumulative counters (env_steps, trajectories_finished, groups_started never going back) are reported as
a signal only. `python benchmarks/chaos_check.py OUT` checks a finished soak again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from test_faults import metrics, processes_of, surviving_lineage  # noqa: E402

from async_rl.config import Config  # noqa: E402
from async_rl.config_load import load_run_config  # noqa: E402
from async_rl.protocol import BatchAck, BatchRequest, Outcome, StageRecord, decode  # noqa: E402
from replay.group import Group  # noqa: E402
from replay.log_format import HEADER, SEGMENT, SNAPSHOT, Received, entry_decoder, read_frames, snapshot_decoder  # noqa: E402
from replay.server import apply_entry, build_service  # noqa: E402
from replay.service import ReplayService  # noqa: E402
from replay.wal import ReplayLog, comparable  # noqa: E402
from rollout.ack_journal import read_journal  # noqa: E402

ACKED = ("env_steps", "trajectories_finished", "groups_started")
RESIDUAL_BOUND = 1e-6


def archive_log(replay_dir: Path, archive: Path) -> int:
    """Copy the replay's snapshot and segment files into `archive` (a newer copy of a file replaces the older one:
    called while the replay is down, each is then whole); returns how many files were copied."""
    archive.mkdir(parents=True, exist_ok=True)
    copied = 0
    for path in sorted(replay_dir.iterdir()) if replay_dir.is_dir() else []:
        if SEGMENT.fullmatch(path.name) or SNAPSHOT.fullmatch(path.name):
            shutil.copyfile(path, archive / path.name)
            copied += 1
    return copied


def rebuild(directory: Path, config: Config) -> ReplayService:
    """The replay a log directory rebuilds (replay/wal.py's recovery, on a copy: recovery cuts a torn tail off)."""
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "log"
        shutil.copytree(directory, copy, ignore=shutil.ignore_patterns("lock"))
        service = build_service(config)
        log = ReplayLog(copy, fsync=False)
        try:
            log.recover(service, apply_entry)
        finally:
            log.close()
    return service


@dataclass
class Fates:
    """What the replay's history (the archive replayed) did with each record, for the join's reasons: what it
    stored, whom it abandoned and why, which corrections it made and dropped and why, which groups it closed."""

    stored: set[tuple[str, int, int]] = field(default_factory=set)  # (group, member, stage) stored
    abandoned: dict[tuple[str, int], str] = field(default_factory=dict)  # (group, member) -> the replay's reason
    # (group, member) -> the stages its correction credits
    corrected: dict[tuple[str, int], set[int]] = field(default_factory=dict)
    dropped: dict[tuple[str, int, int], str] = field(default_factory=dict)  # (group, member, stage) -> why
    closed: set[str] = field(default_factory=set)
    leased: set[str] = field(default_factory=set)  # every group the history made
    replay_trained: set[tuple[str, int, int]] = field(default_factory=set)  # immediates the replay counted trained
    residuals: list[float] = field(default_factory=list)


@contextlib.contextmanager
def recording(fates: Fates) -> Iterator[None]:
    """The replay's own methods wrapped to note what they did in `fates` (restored on the way out)."""
    from replay.rollback import Rollback
    from replay.serving import Serving

    originals = {(Group, "__init__"): Group.__init__, (Group, "residual"): Group.residual,
                 (Group, "add_stage"): Group.add_stage,
                 (Group, "finalize"): Group.finalize, (Group, "record_trained"): Group.record_trained,
                 (ReplayService, "_abandon"): ReplayService._abandon,
                 (Serving, "_drop_correction"): Serving._drop_correction, (Serving, "_untrained"): Serving._untrained,
                 (Rollback, "_undo"): Rollback._undo, (Rollback, "_unfinalize"): Rollback._unfinalize}
    untrained = [False]

    def init(self: Group, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        originals[(Group, "__init__")](self, *args, **kwargs)
        fates.leased.add(self.group_id)

    def residual(self: Group) -> float:
        value = originals[(Group, "residual")](self)
        fates.residuals.append(value)
        fates.closed.add(self.group_id)
        return value

    def add_stage(self: Group, record, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        fates.stored.add((self.group_id, record.member, record.stage_index))
        return originals[(Group, "add_stage")](self, record, *args, **kwargs)

    def finalize(self: Group, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        items = originals[(Group, "finalize")](self, *args, **kwargs)
        for queued in items:
            fates.corrected.setdefault((self.group_id, queued.member), set()).update(queued.credit)
        return items

    def record_trained(self: Group, queued) -> None:  # noqa: ANN001
        if queued.kind == "immediate":
            fates.replay_trained.update((self.group_id, queued.member, k) for k in queued.credit)
        originals[(Group, "record_trained")](self, queued)

    def abandon(self: ReplayService, group: Group, i: int, reason: str) -> None:
        fates.abandoned.setdefault((group.group_id, i), reason)
        originals[(ReplayService, "_abandon")](self, group, i, reason)

    def drop(self, group, queued, now):  # noqa: ANN001, ANN202
        why = "the learner refused its step (trained=False)" if untrained[0] else "past the correction bound"
        for k in queued.credit:
            fates.dropped.setdefault((queued.group_id, queued.member, k), why)
        return originals[(Serving, "_drop_correction")](self, group, queued, now)

    def not_trained(self, batch, now):  # noqa: ANN001, ANN202
        untrained[0] = True
        try:
            return originals[(Serving, "_untrained")](self, batch, now)
        finally:
            untrained[0] = False

    def undo(self, undone):  # noqa: ANN001, ANN202 - a rollback takes trained immediates back
        for queued in undone:
            if queued.kind == "immediate":
                fates.replay_trained.difference_update((queued.group_id, queued.member, k) for k in queued.credit)
        return originals[(Rollback, "_undo")](self, undone)

    def unfinalize(self, group) -> None:  # noqa: ANN001 - its corrections withdrawn: only the next finalize's count
        for key in [key for key in fates.corrected if key[0] == group.group_id]:
            del fates.corrected[key]
        originals[(Rollback, "_unfinalize")](self, group)

    wrappers = {"__init__": init, "residual": residual, "add_stage": add_stage, "finalize": finalize,
                "record_trained": record_trained, "_abandon": abandon, "_drop_correction": drop,
                "_untrained": not_trained, "_undo": undo, "_unfinalize": unfinalize}
    for (owner, name) in originals:
        setattr(owner, name, wrappers[name])
    try:
        yield
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)


def replay_history(run_dir: Path, archive: Path, final: Path) -> tuple[ReplayService, Fates, bool]:
    """The archive replayed from its first snapshot: (the service at the end, what it did with each record, whether
    its final state equals the one the run's own log, `final`, rebuilds)."""
    config = load_run_config(run_dir)
    snapshots = sorted(p for p in archive.iterdir() if SNAPSHOT.fullmatch(p.name))
    if not snapshots:
        raise AssertionError(f"{archive}: no snapshot archived")
    fates = Fates()
    with tempfile.TemporaryDirectory() as scratch:
        history = Path(scratch)  # the first snapshot and every segment
        for path in [snapshots[0], *(p for p in archive.iterdir() if SEGMENT.fullmatch(p.name))]:
            shutil.copyfile(path, history / path.name)
        logging.disable(logging.CRITICAL)  # the rebuilds repeat the run's log lines
        try:
            with recording(fates):
                service = rebuild(history, config)
            same = comparable(service) == comparable(rebuild(final, config))
        finally:
            logging.disable(logging.NOTSET)
    return service, fates, same


# --- the join: the workers' journals against the learner's log ----------------------------------------------


def load_journals(run_dir: Path) -> tuple[dict[tuple[str, int], dict], dict[str, dict], int]:
    """Every worker's journal (rollout/ack_journal.py): (the stages sent, by (trajectory, stage), the outcomes sent, by
    trajectory, the lines that could not be read). Each entry gains "w", the worker whose journal holds it, and
    "acked", whether the replay acknowledged it."""
    stages: dict[tuple[str, int], dict] = {}
    outcomes: dict[str, dict] = {}
    bad = 0
    for path in sorted((run_dir / "acks").glob("*.jsonl")):
        lines, unreadable = read_journal(path)
        bad += unreadable
        acked = {line["m"] for line in lines if line["k"] == "ack"}
        for line in lines:
            line["w"], line["acked"] = path.stem, line["m"] in acked
            if line["k"] == "stage":
                stages.setdefault((line["t"], line["s"]), line)
            elif line["k"] == "outcome":
                outcomes.setdefault(line["t"], line)
    return stages, outcomes, bad


@dataclass
class Cut:
    """What truncating tears cut from the replay's log (the pre-tear copies chaos_pods.tear_log kept): the acked
    stage records and outcomes among the frames cut, and the versions whose BatchAck was cut."""

    tears: int = 0
    bytes_cut: int = 0
    frames_cut: int = 0
    records: set[int] = field(default_factory=set)  # msg ids of stage records and outcomes
    # the versions whose batch the log forgot: its BatchAck (or the BatchRequest that served it) was cut
    batch_versions: set[int] = field(default_factory=set)
    details: list[str] = field(default_factory=list)
    epochs: set[int] = field(default_factory=set)  # the epochs whose last entries were cut (each segment is one's)


def cut_by_tears(faults: list[dict], torn: Path) -> Cut:
    """Read each truncating tear of the faults (detail "truncate <segment> <size> -> <offset>") against its kept copy:
    every frame that ended past the offset is gone from the log (a frame the cut went through is dropped whole by
    the rebuild, as a torn tail)."""
    cut = Cut()
    copies = sorted(torn.iterdir()) if torn.is_dir() else []
    tears = [f["detail"].split() for f in faults if f.get("detail", "").startswith("truncate ")]
    for words, copy in zip(tears, copies, strict=False):
        name, offset = words[1], int(words[4])
        if not copy.name.endswith(name):
            cut.details.append(f"{copy.name}: does not match the tear of {name}")
            continue
        data = copy.read_bytes()
        payloads, _ = read_frames(data)
        position = 0
        cut.tears += 1
        snapshot = torn.parent / "replay-archive" / name.replace("wal-", "snapshot-").replace(".log", ".msgpack")
        if snapshot.exists():  # the snapshot a start wrote as its segment began: that start's epoch
            frames, _ = read_frames(snapshot.read_bytes())
            cut.epochs.add(snapshot_decoder.decode(frames[0]).state.epoch)
        cut.bytes_cut += len(data) - offset
        for payload in payloads:
            position += HEADER.size + len(payload)
            if position <= offset:
                continue
            cut.frames_cut += 1
            entry = entry_decoder.decode(payload)
            if not isinstance(entry, Received):
                continue
            try:
                message = decode(entry.message)
            except Exception:  # noqa: BLE001 - a frame the replay itself refused
                continue
            if isinstance(message, StageRecord | Outcome):
                cut.records.add(message.msg_id)
            elif isinstance(message, BatchAck):  # the version its step made: the learner's line of that version
                cut.batch_versions.add(message.policy_version)
            elif isinstance(message, BatchRequest):  # a batch served from the cut: trained at the next version
                cut.batch_versions.add(message.policy_version + 1)
    return cut


@dataclass
class Join:
    """The join's verdict, by acked stage record (its items: its immediate and its member's correction)."""

    acked_stages: int = 0
    acked_outcomes: int = 0
    sent_not_acked: int = 0  # stages sent that no ack reached (the worker killed, cut off or stopped first)
    sent_not_acked_trained: int = 0  # ... of them trained all the same (the replay had logged them)
    trained: int = 0  # acked stages with an item trained (once) in the surviving lineage
    pending: int = 0  # not trained, and still in the replay's final state (queued, in flight, its group open)
    given_up: Counter = field(default_factory=Counter)  # reason -> acked stages given up by it
    lost: list[str] = field(default_factory=list)  # acked, never trained, not pending, no rule gave it up
    trained_twice: list[str] = field(default_factory=list)  # a stage an item kind trained twice, unexplained
    retrained_after_cut: int = 0  # trained twice after a torn write cut the first training's batch ack
    without_sender: list[str] = field(default_factory=list)  # an item's trained span no worker's journal holds
    items_trained: int = 0
    journal_lines_unreadable: int = 0

    def numbers(self) -> dict:
        return {"acked_stages_journalled": self.acked_stages, "acked_outcomes_journalled": self.acked_outcomes,
                "stages_sent_not_acked": self.sent_not_acked,
                "stages_sent_not_acked_but_trained": self.sent_not_acked_trained,
                "acked_stages_trained": self.trained, "acked_stages_pending": self.pending,
                "acked_stages_given_up": dict(sorted(self.given_up.items())),
                "acked_stages_lost": len(self.lost), "stages_trained_twice": len(self.trained_twice),
                "stages_retrained_after_a_cut_batch_ack": self.retrained_after_cut,
                "spans_trained_without_sender": len(self.without_sender),
                "journal_lines_unreadable": self.journal_lines_unreadable}

    def problems(self) -> list[str]:
        found = []
        lost = "acknowledged stage record(s) lost (acked, never trained, not pending, no rule gave them up)"
        for what, cases in ((lost, self.lost), ("stage(s) trained twice by items of one kind", self.trained_twice),
                            ("trained span(s) no worker sent", self.without_sender)):
            if cases:
                found.append(f"{len(cases)} {what}: {cases[:5]}")
        return found


def trained_spans(surviving: list[dict], stages: dict[tuple[str, int], dict],
                  join: Join) -> dict[tuple[str, int, str], list[int]]:
    """(trajectory, stage, kind) -> the versions that trained it, from the learner's per-item log; a span that maps
    to no stage a worker journalled as sent in the item's trajectory, or whose tokens' hash differs, goes to
    `join.without_sender`."""
    trained: dict[tuple[str, int, str], list[int]] = {}
    layouts: dict[str, dict[int, int] | None] = {}
    for line in surviving:
        for item_id, kind, group_id, trajectory, runs in line.get("items", []):
            join.items_trained += 1
            if trajectory not in layouts:
                layouts[trajectory] = _layout(trajectory, stages)
            starts = layouts[trajectory]
            for start, end, digest in runs:
                k = None if starts is None else starts.get(start)
                record = None if k is None else stages[(trajectory, k)]
                if record is None or record["g"] != group_id or start + record["a"] != end or record["h"] != digest:
                    join.without_sender.append(f"v{line['version']} item {item_id} {trajectory} [{start}, {end})")
                    continue
                trained.setdefault((trajectory, k, kind), []).append(line["version"])
    return trained


def _layout(trajectory: str, stages: dict[tuple[str, int], dict]) -> dict[int, int] | None:
    """Where each journalled stage's action tokens start in an item of `trajectory` (stage 0 on, as long as the
    journal holds every stage before it): start -> stage."""
    starts, offset, k = {}, 0, 0
    while (trajectory, k) in stages:
        record = stages[(trajectory, k)]
        starts[offset + record["o"]] = k
        offset += record["o"] + record["a"]
        k += 1
    return starts or None


def join_evidence(stages: dict[tuple[str, int], dict], outcomes: dict[str, dict], surviving: list[dict],
                  fates: Fates | None, pending: set[tuple[str, int, int]], open_groups: set[str],
                  cut: Cut | None = None) -> Join:
    """Every acked stage (the workers' journals) against the learner's surviving lineage: trained once, pending
    (`pending`: (group, member, stage) of the items in the replay's final queue or in flight; `open_groups`: its
    groups still open), or given up by a rule of the replay's history (`fates`) or a torn write (`cut`); and no
    trained span without a journalled stage of the same tokens."""
    cut = cut or Cut()
    join = Join(acked_stages=sum(1 for r in stages.values() if r.get("acked", True)),
                acked_outcomes=sum(1 for r in outcomes.values() if r.get("acked", True)))
    trained = trained_spans(surviving, stages, join)
    for (trajectory, k), record in sorted(stages.items()):
        g, i = record["g"], record["i"]
        name = f"{trajectory} stage {k} (msg {record['m']}, {record['w']})"
        counts = {kind: trained.get((trajectory, k, kind), []) for kind in ("immediate", "correction")}
        if not record.get("acked", True):  # sent, never acked: the replay promised nothing; trained at most once
            join.sent_not_acked += 1
            join.sent_not_acked_trained += any(counts.values())
            if any(len(versions) > 1 for versions in counts.values()):
                join.trained_twice.append(f"{name} (never acked): {counts}")
            continue
        twice = [kind for kind, versions in counts.items() if len(versions) > 1]
        if twice:
            if all(min(counts[kind]) in cut.batch_versions for kind in twice):
                join.retrained_after_cut += 1
            else:
                join.trained_twice.append(f"{name}: {counts}")
        if any(counts.values()):
            join.trained += 1
            continue
        if (g, i, k) in pending or g in open_groups:
            join.pending += 1
            continue
        reason = _given_up(g, i, k, record, fates, cut)
        if reason is None:
            join.lost.append(name)
        else:
            join.given_up[reason] += 1
    return join


def _granted_in_a_cut(group_id: str, fates: Fates, cut: Cut) -> bool:
    """Whether `group_id` (`e<epoch>.g<n>`) was leased in the part of its epoch's log a tear cut: its epoch's last
    entries were cut and the history made every group of that epoch below n but not it. A restarted replay takes a
    record for a group of an earlier epoch it does not know for a resend after the group closed, and acks it."""
    match = re.fullmatch(r"e(\d+)\.g(\d+)", group_id)
    if match is None or int(match.group(1)) not in cut.epochs:
        return False
    epoch, n = int(match.group(1)), int(match.group(2))
    known = [int(m.group(2)) for m in (re.fullmatch(r"e(\d+)\.g(\d+)", g) for g in fates.leased)
             if m is not None and int(m.group(1)) == epoch]
    return n > max(known, default=-1)


def _given_up(g: str, i: int, k: int, record: dict, fates: Fates | None, cut: Cut) -> str | None:
    """The rule that gave an acked, untrained, not pending stage up, or None (then it was lost)."""
    if record["m"] in cut.records:
        return "cut from the log by a torn write"
    if fates is None:
        return None
    if (g, i) in fates.abandoned:
        reason = fates.abandoned[(g, i)]
        return "member abandoned: " + ("its lease expired" if "lease" in reason else
                                       "its worker restarted" if "restarted" in reason else
                                       "by its worker" if "by its worker" in reason else reason)
    if (g, i, k) not in fates.stored:
        if g not in fates.leased and _granted_in_a_cut(g, fates, cut):
            return "its group's lease was cut from the log by a torn write (its records then acked as a closed group's)"
        return None  # acked, yet the history never stored it: lost
    if (g, i, k) in fates.dropped:
        return "correction dropped: " + fates.dropped[(g, i, k)]
    if g in fates.closed and k not in fates.corrected.get((g, i), set()) and (g, i, k) not in fates.replay_trained:
        return "no credit left to train (its correction's C was 0 and its immediate was not trained)"
    return None


def check(run_dir: Path, archive: Path, final: Path, target: int) -> tuple[dict, list[str]]:
    """The invariants of the module's docstring for the run in `run_dir` (its replay's log archived in `archive`,
its last state in `final`; the soak's faults.jsonl and torn/ beside `archive`) and its budget `target`: (the numbers,
the violations found; none when it passed)."""
    problems: list[str] = []
    work = archive.parent
    lines = metrics(run_dir)
    surviving, died = surviving_lineage(lines)
    versions = [line["version"] for line in surviving]
    if versions != list(range(1, target + 1)):
        gaps = sorted(set(range(1, target + 1)) - set(versions))
        problems.append(f"the surviving lineage is not versions 1..{target}: missing {gaps[:20]}, last {versions[-1:]}")
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    if summary.get("stop_reason") != "max_versions" or summary.get("versions") != target:
        problems.append(f"summary.json: {summary.get('stop_reason')} at {summary.get('versions')}, not the target")
    trained = [item for line in surviving for item in line["item_ids"]]
    first_trained: dict[int, int] = {}  # item id -> the version that first trained it
    again: list[int] = []  # the version each second training of an item id first trained it at
    for line in surviving:
        for item in line["item_ids"]:
            if item in first_trained:
                again.append(first_trained[item])
            else:
                first_trained[item] = line["version"]
    service, fates, same = replay_history(run_dir, archive, final)
    stats = service.stats_snapshot()
    # The replay's own counters, an extra signal only (a truncating tear makes them go back, as it should):
    went_back = 0
    for key in ACKED:
        counts = [line[key] for line in lines]
        went_back += sum(max(0, a - b) for a, b in zip(counts, counts[1:], strict=False))
        went_back += max(0, max(counts, default=0) - getattr(stats, key))
    if not same:
        problems.append("the archived log's final state differs from the run's own log: the archive is incomplete")
    queued = [*service.queue, *(q for batch in service.in_flight.values() for q in batch.items)]
    pending_ids = {q.item_id for q in queued}
    # The evidence from outside the replay: the workers' journals joined with the learner's per-item log.
    faults = ([json.loads(line) for line in (work / "faults.jsonl").read_text().splitlines()]
              if (work / "faults.jsonl").exists() else [])
    cut = cut_by_tears(faults, work / "torn")
    twice = sum(1 for version in again if version not in cut.batch_versions)  # the rest: their batch was cut
    if twice:
        problems.append(f"{twice} item id(s) trained twice in the surviving lineage")
    both = {item for item in pending_ids & set(trained) if first_trained[item] not in cut.batch_versions}
    if both:
        problems.append(f"{len(both)} item(s) both trained and still pending")
    stages, outcomes, unreadable = load_journals(run_dir)
    if not stages:
        problems.append(f"no worker ack journal under {run_dir / 'acks'}: nothing to join")
    if surviving and not any("items" in line for line in surviving):
        problems.append("the learner's metrics lines have no per-item record (learner.log_item_ids)")
    pending = {(q.group_id, q.member, k) for q in queued for k in q.credit}
    open_groups = set(service.groups)
    join = join_evidence(stages, outcomes, surviving, fates, pending, open_groups, cut)
    join.journal_lines_unreadable = unreadable
    problems += join.problems()
    worst = max([*fates.residuals, *(line["ledger_residual_max"] for line in lines)], default=0.0)
    if not worst < RESIDUAL_BOUND:  # NaN-aware
        problems.append(f"ledger residual {worst} >= {RESIDUAL_BOUND}")
    stray = processes_of(run_dir)
    if stray:
        problems.append(f"processes of the run still running: {[p.pid for p in stray]}")
    numbers = {
        "versions": versions[-1] if versions else 0, "target": target, "versions_died": len(died),
        "records_acked": stats.env_steps, "trajectories_finished": stats.trajectories_finished,
        "groups_started": stats.groups_started, "groups_closed_checked": len(fates.residuals),
        "items_trained": len(trained), "items_pending": len(pending_ids), "items_trained_twice": twice,
        "item_ids_trained_again_after_a_cut_batch": len(again) - twice,
        **join.numbers(),
        "records_lost": len(join.lost), "trained_without_sender": len(join.without_sender),
        "replay_counters_went_back": went_back,
        "torn_log_truncations": cut.tears, "torn_log_bytes_cut": cut.bytes_cut,
        "torn_log_frames_cut": cut.frames_cut, "torn_log_acked_records_cut": len(cut.records),
        "torn_log_batches_forgotten": len(cut.batch_versions),
        "torn_checkpoints_truncated": sum(1 for f in faults if "truncated" in f.get("detail", "")),
        **checkpoint_resumes(work),
        "worst_residual": worst, "rollbacks": stats.rollbacks,
        "items_rolled_back": stats.items_rolled_back, "trajectories_abandoned": stats.trajectories_abandoned,
        "late_records": stats.late_records, "late_batch_acks": stats.late_batch_acks,
        "groups_given_up": stats.groups_given_up, "workers_restarted": stats.workers_restarted,
        "credit_dropped": stats.credit_dropped, "immediate_skipped_stale": stats.immediate_skipped_stale,
        "credit_dropped_by_fault": drops_by_fault(work, faults, fates),
    }
    return numbers, problems


RESUMED_PAST = re.compile(r"resuming from checkpoint v\d+ .*; skipped: (.*)$")
VERSIONS = re.compile(r"versions (\d+)\.\.(\d+)")


def checkpoint_resumes(work: Path) -> dict[str, int]:
    """What the learner's restarts reported of the checkpoints they could not use (logs/learner.log): how many
    resumes went past a damaged newest checkpoint (its files not matching its manifest: a truncation the nemesis
    made, or a save the full disk cut short), and the versions past the checkpoint they resumed from (their updates
    lost from the weights, or trained again: the learner's log says which). The lineage check and the join then
    show every item of those versions trained once in the surviving lineage."""
    path = work / "logs" / "learner.log"
    resumes = versions = truncated = 0
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        match = RESUMED_PAST.search(line)
        if match:
            resumes += 1
            span = VERSIONS.search(line)
            versions += int(span.group(2)) - int(span.group(1)) + 1 if span else 0
            truncated += "(torn)" in match.group(1)
    return {"resumes_past_a_damaged_checkpoint": resumes, "resumes_past_a_truncated_file": truncated,
            "versions_past_the_checkpoint_resumed": versions}


DROPPED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) WARNING "
                     r".*correction of (\S+) dropped: past the correction bound")
STARTED = re.compile(r"^--- chaos: start \d+ at ([\d.]+)")


def drops_by_fault(work: Path, faults: list[dict], fates: Fates | None = None) -> dict[str, int]:
    """The credit the replay dropped (`credit_dropped`: stages), put down to the fault in effect when it was
    dropped. Each dropped correction is a warning in the replay's log (`correction of <trajectory> dropped`, with
    its wall time, across all its processes), worth the stages its member's correction credited (`fates`, 1 when
    the history does not know it). The fault in effect: the one injected last before it among those not yet
    recovered from (injected, and no learner version yet after its heal), else "none in effect". The window's start
    on the wall clock is taken from the soak's summary, or else from the pods' restarts (a kill's heal is its pod's
    restart, logged with its wall time)."""
    log_path = work / "logs" / "replay.log"
    if not log_path.exists():
        return {}
    start = _window_start(work, faults)
    counts: Counter[str] = Counter()
    spans = [(f["injected_at"], (f["healed_at"] or f["injected_at"]) + (f["recovery_s"] or 60.0), f["kind"])
             for f in faults if f.get("injected_at") is not None]
    for line in log_path.read_text(errors="replace").splitlines():
        match = DROPPED.match(line)
        if not match:
            continue
        group, _, member = match.group(2).rpartition("/")
        stages = len(fates.corrected.get((group, int(member)), ())) if fates is not None and member.isdigit() else 0
        if start is None:
            counts["unknown (no window start)"] += stages or 1
            continue
        when = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - start
        active = [(at, kind) for at, until, kind in spans if at <= when <= until]
        kind = max(active)[1] if active else ("before the window" if when < 0 else "none in effect")
        counts[kind] += stages or 1
    return dict(sorted(counts.items()))


def _window_start(work: Path, faults: list[dict]) -> float | None:
    summary = work / "summary.json"
    if summary.exists():
        known = json.loads(summary.read_text()).get("window_start_unix")
        if known is not None:
            return float(known)
    estimates = []
    for role in {f["target"] for f in faults if f["kind"] in ("kill", "torn") and f.get("healed_at") is not None}:
        path = work / "logs" / f"{role}.log"
        starts = [float(m.group(1)) for m in map(STARTED.match, path.read_text(errors="replace").splitlines()) if m] \
            if path.exists() else []
        heals = sorted(f["healed_at"] for f in faults if f["target"] == role and f["kind"] in ("kill", "torn")
                       and f.get("healed_at") is not None)
        later = starts[-len(heals):] if heals and len(starts) >= len(heals) else []
        estimates += [wall - heal for wall, heal in zip(later, heals, strict=False)]
    return statistics.median(estimates) if estimates else None


def main(argv: list[str] | None = None) -> int:
    """Check a finished soak again: `python benchmarks/chaos_check.py OUT` (OUT: the soak's directory)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    work = args.out.resolve()
    target = json.loads((work / "summary.json").read_text())["target"]
    numbers, problems = check(work / "run", work / "replay-archive", work / "volumes" / "replay", target)
    print(json.dumps({"passed": not problems, "problems": problems, **numbers}))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
