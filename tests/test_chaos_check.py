"""The soak checker's join (benchmarks/chaos_check.py) on hand-made worker journals and learner logs: each failure
it exists for is caught (an acknowledged record lost, a stage trained twice, a span trained that no worker sent),
each legitimate fate is counted by its reason; the worker's ack journal survives its kill; a truncating tear of the
replay's log is read back to the records it cut."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from chaos_check import Cut, Fates, cut_by_tears, join_evidence, load_journals  # noqa: E402
from chaos_pods import tear_log  # noqa: E402

from async_rl.evidence import token_hash, trained_item  # noqa: E402
from async_rl.protocol import TOKEN, BatchAck, StageRecord, TrainItem, encode  # noqa: E402
from replay.log_format import Received, frame, read_frames  # noqa: E402
from rollout.ack_journal import AckJournal, entry, journal_path, read_journal  # noqa: E402

OBS, ACT = [7, 8], [[11, 12], [21], [31, 32, 33]]  # every stage's observation is OBS; its action ACT[k]


def tokens(values: list[int]) -> bytes:
    return np.asarray(values, TOKEN).tobytes()


def record(group: str, member: int, k: int, msg_id: int, action: list[int] | None = None) -> StageRecord:
    action = ACT[k] if action is None else action
    return StageRecord(msg_id=msg_id, worker_id="rollout-0", group_id=group, trajectory_id=f"{group}/{member}",
                       member=member, task_id="t", stage_index=k, observation_tokens=tokens(OBS),
                       action_tokens=tokens(action), behaviour_logprobs=np.zeros(len(action), "<f4").tobytes(),
                       policy_versions=tokens([0] * len(action)), stage_reward=None, terminal=k == len(ACT) - 1)


def item(item_id: int, kind: str, group: str, member: int, through: int, credited: list[int],
         actions: list[list[int]] | None = None) -> list:
    """The learner's log entry of an item over stages 0..through, training the stages in `credited`."""
    actions = actions or ACT
    sequence, mask = [], []
    for k in range(through + 1):
        sequence += OBS + actions[k]
        mask += [0] * len(OBS) + [int(k in credited)] * len(actions[k])
    n = len(sequence)
    train = TrainItem(item_id=item_id, kind=kind, group_id=group, trajectory_id=f"{group}/{member}",
                      tokens=tokens(sequence), loss_mask=np.asarray(mask, "u1").tobytes(),
                      advantages=np.zeros(n, "<f8").tobytes(), behaviour_logprobs=np.zeros(n, "<f4").tobytes(),
                      policy_versions=tokens([0] * n))
    return trained_item(train)


def journals(tmp_path: Path, records: list[StageRecord], unacked: frozenset[int] = frozenset()) -> tuple[dict, dict]:
    path = journal_path(tmp_path, "rollout-0")
    journal = AckJournal(path)
    for message in records:
        journal.sent(message)
        if message.msg_id not in unacked:
            journal.acked(message)
    journal.close()
    stages, outcomes, bad = load_journals(tmp_path)
    assert bad == 0
    return stages, outcomes


def closed(group: str, members: range, stages: int) -> Fates:
    """The history of a closed group whose every stage was stored and whose corrections credit every stage."""
    fates = Fates(closed={group})
    for i in members:
        fates.corrected[(group, i)] = set(range(stages))
        fates.stored.update((group, i, k) for k in range(stages))
    return fates


def two_members(tmp_path: Path, unacked: frozenset[int] = frozenset()) -> tuple[dict, dict]:
    return journals(tmp_path, [record("e1.g0", i, k, 100 + 10 * i + k) for i in range(2) for k in range(3)], unacked)


def clean_lineage() -> list[dict]:
    """Every stage of both members trained once by its immediate and once by its member's correction."""
    return [{"version": 1, "items": [item(1, "immediate", "e1.g0", i, 0, [0]) for i in range(2)]},
            {"version": 2, "items": [item(2 + i, "immediate", "e1.g0", i, k, [k]) for i in range(2)
                                     for k in (1, 2)]},
            {"version": 3, "items": [item(9 + i, "correction", "e1.g0", i, 2, [0, 1, 2]) for i in range(2)]}]


def test_a_clean_history_passes(tmp_path):
    stages, outcomes = two_members(tmp_path)
    join = join_evidence(stages, outcomes, clean_lineage(), closed("e1.g0", range(2), 3), set(), set())
    assert join.problems() == [] and join.trained == 6 and join.acked_stages == 6


def test_an_acknowledged_record_never_trained_is_reported_lost(tmp_path):
    stages, outcomes = two_members(tmp_path)
    lineage = clean_lineage()
    stage_2_starts = len(OBS) * 3 + len(ACT[0]) + len(ACT[1])
    lineage[1]["items"] = [i for i in lineage[1]["items"] if (i[3], i[4][0][0]) != ("e1.g0/1", stage_2_starts)]
    lineage[2]["items"] = [lineage[2]["items"][0]]  # and member 1's correction: no item trained stage 2 of member 1
    join = join_evidence(stages, outcomes, lineage, closed("e1.g0", range(2), 3), set(), set())
    assert len(join.lost) == 1 and "e1.g0/1 stage 2" in join.lost[0], join.lost
    assert any("lost" in p for p in join.problems())
    # The same record with the replay's history never having stored it (a log that lost it): lost as well.
    fates = closed("e1.g0", range(2), 3)
    fates.stored.discard(("e1.g0", 1, 2))
    assert len(join_evidence(stages, outcomes, lineage, fates, set(), set()).lost) == 1
    # ... and not lost when the replay still holds it, or a rule gave it up (counted by reason):
    assert join_evidence(stages, outcomes, lineage, fates, {("e1.g0", 1, 2)}, set()).problems() == []
    fates.abandoned[("e1.g0", 1)] = "lease of worker rollout-0 expired"
    given_up = join_evidence(stages, outcomes, lineage, fates, set(), set())
    assert given_up.problems() == [] and given_up.given_up == {"member abandoned: its lease expired": 1}


def test_a_stage_sent_but_never_acked_may_be_trained_and_is_not_owed(tmp_path):
    """The replay logged and served it, its ack never reached the worker (killed first): trained, not a span without
    a sender; untrained, not a loss (the replay promised nothing)."""
    stages, outcomes = two_members(tmp_path, unacked=frozenset({112}))
    join = join_evidence(stages, outcomes, clean_lineage(), closed("e1.g0", range(2), 3), set(), set())
    assert join.problems() == [] and join.sent_not_acked == join.sent_not_acked_trained == 1 and join.trained == 5
    lineage = clean_lineage()
    lineage[1]["items"] = [i for i in lineage[1]["items"] if i[3] != "e1.g0/1"]
    lineage[2]["items"] = [lineage[2]["items"][0]]
    join = join_evidence(stages, outcomes, lineage, closed("e1.g0", range(2), 3), set(), set())
    assert [name.split(" (")[0] for name in join.lost] == ["e1.g0/1 stage 1"]  # acked: owed
    assert join.sent_not_acked == 1 and join.sent_not_acked_trained == 0  # stage 2, never acked: not owed


def test_a_stage_trained_twice_is_caught(tmp_path):
    stages, outcomes = two_members(tmp_path)
    lineage = clean_lineage()
    lineage.append({"version": 4, "items": [item(20, "immediate", "e1.g0", 0, 1, [1])]})  # again, a new item id
    join = join_evidence(stages, outcomes, lineage, closed("e1.g0", range(2), 3), set(), set())
    assert len(join.trained_twice) == 1 and "e1.g0/0 stage 1" in join.trained_twice[0]
    assert any("trained twice" in p for p in join.problems())
    # Unless a torn write cut the first training's batch ack from the replay's log: counted, not a violation.
    lineage[1]["version"] = 2
    explained = join_evidence(stages, outcomes, lineage, closed("e1.g0", range(2), 3), set(), set(),
                              Cut(batch_versions={2}))
    assert explained.problems() == [] and explained.retrained_after_cut == 1


def test_a_span_no_worker_sent_is_caught(tmp_path):
    stages, outcomes = two_members(tmp_path)
    for forged in ([item(30, "immediate", "e1.g9", 0, 0, [0])],  # a trajectory no worker journalled
                   [item(31, "immediate", "e1.g0", 0, 1, [1], actions=[ACT[0], [99], ACT[2]])],  # other tokens
                   [item(32, "immediate", "e1.g0", 0, 1, [1], actions=[ACT[0] + [5], ACT[1], ACT[2]])]):  # misplaced
        lineage = [*clean_lineage(), {"version": 4, "items": forged}]
        join = join_evidence(stages, outcomes, lineage, closed("e1.g0", range(2), 3), set(), set())
        assert len(join.without_sender) == 1 and any("no worker sent" in p for p in join.problems()), forged


def test_given_up_stages_are_counted_by_reason(tmp_path):
    stages, outcomes = two_members(tmp_path)
    lineage = [{"version": 1, "items": [item(1, "immediate", "e1.g0", 0, 0, [0])]}]
    fates = closed("e1.g0", range(2), 3)
    fates.corrected[("e1.g0", 0)] = {2}  # member 0's correction credits stage 2 only: stage 1 had nothing to train
    fates.dropped[("e1.g0", 0, 2)] = "past the correction bound"
    fates.abandoned[("e1.g0", 1)] = "worker rollout-0 restarted"
    join = join_evidence(stages, outcomes, lineage, fates, set(), set(), Cut(records={111}))
    assert join.problems() == [] and join.trained == 1
    assert join.given_up == {"correction dropped: past the correction bound": 1,
                             "cut from the log by a torn write": 1,  # msg 111: member 1's stage 1
                             "member abandoned: its worker restarted": 2,  # its stages 0 and 2
                             "no credit left to train (its correction's C was 0 and its immediate was not trained)": 1,
                             }, join.given_up
    # "no credit" needs the replay not to have counted the immediate trained (else the learner lost it):
    fates.replay_trained.add(("e1.g0", 0, 1))
    assert len(join_evidence(stages, outcomes, lineage, fates, set(), set(), Cut(records={111})).lost) == 1


def test_the_ack_journal_survives_the_workers_kill_and_cuts_a_partial_line(tmp_path):
    path = journal_path(tmp_path, "rollout-0")
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(REPO)!r}); sys.path.insert(0, {str(REPO / 'tests')!r})
from test_chaos_check import record
from rollout.ack_journal import AckJournal
journal = AckJournal(__import__('pathlib').Path({str(path)!r}))
for n in range(50):
    journal.sent(record("e1.g0", 0, n % 3, 1000 + n))
    journal.acked(record("e1.g0", 0, n % 3, 1000 + n))
os.write(journal._fd, b'{{"m": 1050, "k": "sta')  # a kill mid-write
os.kill(os.getpid(), signal.SIGKILL)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, timeout=60)
    assert done.returncode == -signal.SIGKILL
    lines, bad = read_journal(path)
    assert [line["m"] for line in lines] == [m for m in range(1000, 1050) for _ in "sa"] and bad == 1
    assert [line["k"] for line in lines[:2]] == ["stage", "ack"]
    journal = AckJournal(path)  # the restarted worker: the partial line is cut before it appends
    journal.sent(record("e1.g1", 0, 0, 2000))
    journal.close()
    lines, bad = read_journal(path)
    assert bad == 0 and journal.cut > 0 and [line["m"] for line in lines][-2:] == [1049, 2000]
    assert lines[-1] == entry(record("e1.g1", 0, 0, 2000)) and lines[-1]["h"] == token_hash(tokens(ACT[0]))


@pytest.mark.parametrize("seed", range(6))
def test_a_truncating_tear_is_read_back_to_the_acknowledged_records_it_cut(tmp_path, seed):
    """A log segment of whole frames (stage records and a batch ack, as the replay logs them) truncated at a random
    offset: the rebuild keeps exactly the frames before the cut (read_frames stops at the cut frame) and the
    checker names every acked record and batch the cut took."""
    replay = tmp_path / "replay"
    replay.mkdir()
    messages = [record("e1.g0", i, k, 100 + 10 * i + k) for i in range(3) for k in range(3)]
    messages.insert(5, BatchAck(learner_id="learner-0", msg_id=7, batch_id=1, policy_version=4))
    frames = [frame(encode_entry(m)) for m in messages]
    rng = random.Random(seed)
    while True:  # a draw that truncates (half of them append a torn frame instead)
        (replay / "wal-00000001.log").write_bytes(b"".join(frames))
        detail = tear_log(replay, rng, tmp_path / "torn")
        if detail.startswith("truncate"):
            break
    offset = int(detail.split()[4])
    kept, end = read_frames((replay / "wal-00000001.log").read_bytes())
    whole = sum(1 for n in range(len(frames) + 1) if sum(map(len, frames[:n])) <= offset) - 1
    assert len(kept) == whole, "the rebuild keeps every frame that ends before the cut, and nothing after it"
    cut = cut_by_tears([{"kind": "torn", "detail": detail}], tmp_path / "torn")
    gone = messages[whole:]
    assert cut.tears == 1 and cut.frames_cut == len(gone)
    assert cut.records == {m.msg_id for m in gone if isinstance(m, StageRecord)}
    assert cut.batch_versions == ({4} if any(isinstance(m, BatchAck) for m in gone) else set())


def encode_entry(message) -> bytes:  # noqa: ANN001
    import msgspec

    return msgspec.msgpack.encode(Received(b"rollout-0", 1.0, encode(message), "rollout-0"))


def test_the_learner_logs_each_trained_span_with_the_hash_the_worker_journals():
    logged = item(5, "correction", "e1.g0", 1, 2, [0, 2])
    assert logged[:4] == [5, "correction", "e1.g0", "e1.g0/1"]
    assert logged[4] == [[2, 4, token_hash(tokens(ACT[0]))], [9, 12, token_hash(tokens(ACT[2]))]]
    assert json.loads(json.dumps(logged)) == logged
    assert os.path.basename(str(journal_path(Path("/r"), "rollout-3"))) == "rollout-3.jsonl"


def test_dropped_corrections_are_put_down_to_the_fault_in_effect(tmp_path):
    from chaos_check import drops_by_fault

    (tmp_path / "logs").mkdir()
    (tmp_path / "summary.json").write_text(json.dumps({"window_start_unix": 1_000_000.0}))
    faults = [{"kind": "pause", "target": "learner", "injected_at": 10.0, "healed_at": 15.0, "recovery_s": 2.0},
              {"kind": "disk", "target": "replay", "injected_at": 12.0, "healed_at": 14.0, "recovery_s": 30.0}]
    from datetime import datetime

    def line(at: float) -> str:
        stamp = datetime.fromtimestamp(1_000_000.0 + at).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
        return f"{stamp} WARNING [replay] async_rl.replay: correction of e1.g0/1 dropped: past the correction bound 8"

    (tmp_path / "logs" / "replay.log").write_text("\n".join(line(at) for at in (-5.0, 11.0, 13.0, 40.0, 100.0)))
    assert drops_by_fault(tmp_path, faults) == {"before the window": 1, "disk": 2, "none in effect": 1, "pause": 1}
    # In stages (what credit_dropped counts): the stages the member's correction credited.
    fates = Fates(corrected={("e1.g0", 1): {0, 1, 2}})
    assert drops_by_fault(tmp_path, faults, fates) == {"before the window": 3, "disk": 6, "none in effect": 3,
                                                       "pause": 3}


def test_a_restarted_replay_takes_the_learners_version_again_though_its_log_forgot_the_batches():
    """Found by the soak's first truncating tear: the rebuilt replay's version ceiling came from a log that had lost
    the learner's last batch acks, and every BatchRequest of the learner, truly ahead, was refused (version_ahead)
    for good: the run stalled. A start now trusts the learner's first word again, as a fresh replay does."""
    sys.path.insert(0, str(REPO / "tests"))
    from test_replay import learner_speaks, make_config, request_batch

    from replay.server import build_service

    service = build_service(make_config())
    learner_speaks(service, version=3)
    service.start_epoch(service.epoch + 1, 0.0)  # rebuilt from a log whose later batch acks were cut
    learner_speaks(service, version=40)  # the learner trained 37 versions the log forgot: refused before the fix
    assert service.policy_version == 40 and service.stats_snapshot().rejected == {}
    assert request_batch(service, 40 + 100, max_wait_s=0.0) is not None  # and the ceiling holds again after it
    assert service.stats_snapshot().rejected == {"version_ahead": 1}


def test_records_of_a_group_whose_lease_a_tear_cut_are_given_up_by_that_rule_only(tmp_path):
    """A tear that cut a LeaseRequest made the restarted replay forget the group it granted; the worker's records for
    it were then acked as a closed group's resends, stored nowhere. Given up by that rule when the group is one its
    epoch made after every group the history knows and that epoch's log was cut; lost otherwise."""
    stages, outcomes = journals(tmp_path, [record("e2.g5", 0, k, 500 + k) for k in range(2)])
    fates = Fates(leased={f"e2.g{n}" for n in range(5)} - {"e2.g3"})
    join = join_evidence(stages, outcomes, [], fates, set(), set(), Cut(epochs={2}))
    assert join.problems() == [] and sum(join.given_up.values()) == 2
    assert list(join.given_up) == ["its group's lease was cut from the log by a torn write (its records then acked "
                                   "as a closed group's)"]
    assert len(join_evidence(stages, outcomes, [], fates, set(), set(), Cut(epochs={3})).lost) == 2  # not cut
    early, _ = journals(tmp_path / "early", [record("e2.g3", 0, 0, 700)])  # below a group the history knows
    assert len(join_evidence(early, {}, [], fates, set(), set(), Cut(epochs={2})).lost) == 1


def test_a_rollback_takes_back_what_the_history_counted_trained_and_corrected():
    """The 50-minute soak's 9 "lost" stages (2026-11-29) were the checker's: a rollback took a group's trained
    immediates back and withdrew its corrections, and the group, finalized again, owed those stages nothing (A_final
    0), yet the history still counted the withdrawn corrections' stages as corrected and the immediates as trained,
    so no rule gave the stages up. The history now forgets both at the rollback: only the corrections in effect
    count (the replay's own scenario, tests/test_replay.py's rollback past a group's immediates)."""
    sys.path.insert(0, str(REPO / "tests"))
    from chaos_check import recording
    from test_replay import (
        Worker,
        ack_batch,
        lease,
        make_config,
        outcome_messages,
        send_all,
        session_request,
        stage_records,
    )

    from replay.server import build_service

    fates = Fates()
    with recording(fates):
        service, worker = build_service(make_config(learner={"checkpoint_every": 2})), Worker()
        grant = lease(service, worker)
        send_all(service, stage_records(worker, grant))
        ack_batch(service, session_request(service, 0, 1, -1), 1)  # the immediates, trained at v1
        send_all(service, outcome_messages(worker, grant))
        old = session_request(service, 1, 1, -1)
        assert fates.replay_trained and fates.corrected
        ack_batch(service, old, 2)
        batch = session_request(service, 0, 2, -1)  # a new learner at version 0: both acks taken back
    assert service.counters.rollbacks == 1
    assert fates.replay_trained == set(), "the immediates the rollback took back are not trained"
    in_effect: dict[tuple[str, int], set[int]] = {}
    for queued in service.serving.own.in_flight[batch.batch_id].items:
        in_effect.setdefault((queued.group_id, queued.member), set()).update(queued.credit)
    assert fates.corrected == in_effect, "only the corrections of the last finalize count"
