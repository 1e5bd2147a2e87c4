"""Wire fuzz: 10,000 seeded hostile messages into the replay of a live `async-rl train` run on TCP with CURVE on.

The fuzzer holds a worker's key, rollout-1's (a compromised or buggy worker: the worst a peer that got in can
do), and sends NaN, inf, huge and negative values, out-of-range versions and members, forged outcomes for groups
it never leased, num_stages=0, huge token ids, undecodable frames, messages of the wrong type, and learner messages
(BatchRequest, BatchAck) that its key may not send. It also leases groups of its own and poisons every member.
Each message is built with one defect whose reason it knows. The run must finish with its invariants, and the
replay must have refused exactly what should be refused, by reason, and nothing of the honest workers' traffic.
It is also the test of an authenticated run: `async-rl train` on TCP with CURVE on reaches its end.
"""

from __future__ import annotations

import ast
import json
import math
import random
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import msgspec
import pytest
import zmq

from async_rl.config_load import config_from_dict
from async_rl.protocol import (
    LOGPROB,
    TOKEN,
    Ack,
    Acks,
    Batch,
    BatchAck,
    BatchRequest,
    Error,
    EvalReport,
    Heartbeat,
    LeaseDenied,
    LeaseGrant,
    LeaseRequest,
    Outcome,
    ReplayStats,
    StageRecord,
    WeightsPublished,
    encode,
    pack,
)
from async_rl.security import load_keys
from async_rl.transport import connect_dealer, poll, receive, send
from launch.cli import main

pytestmark = pytest.mark.slow

MESSAGES = 10_000
WINDOW = 500  # messages in flight before the fuzzer reads the replies (a ROUTER drops replies past its HWM, 1000)
VOCAB = 100_000  # replay.vocab_size: far above the tiny model's vocabulary, so honest tokens pass
MAX_SEQ_LEN = 256
GROUP_SIZE = 4
WORKER = "rollout-1"  # a worker of the keys that the run does not start (it runs rollout-0): its key, gone rogue
HUGE_INTS = [2**31 - 1, 2**40, 2**62, -1, -(2**31), -(2**62)]
BAD_FLOATS = [math.nan, math.inf, -math.inf]
HUGE_FLOATS = [1e308, -1e308, 3.4e38, 1e-320]


def free_endpoint() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


class Fuzzer:
    """Builds one hostile message at a time; knows for each the reason the replay must refuse it with."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.msg_ids = iter(range(1, 10**9))
        self.fake_groups = iter(range(10**9))

    def record(self, group_id: str, member: int, *, reward: float | None = 0.5, logprobs=None, versions=None,
               actions=None, observations=None, trajectory_id: str | None = None) -> StageRecord:
        actions = actions if actions is not None else [self.rng.randrange(50) for _ in range(self.rng.randint(1, 3))]
        n = len(actions)
        return StageRecord(
            msg_id=next(self.msg_ids), worker_id=WORKER, group_id=group_id,
            trajectory_id=trajectory_id or f"{group_id}/{member}", member=member, task_id="t0", stage_index=0,
            observation_tokens=pack(observations if observations is not None else [1, 2, 3], TOKEN),
            action_tokens=pack(actions, TOKEN),
            behaviour_logprobs=pack(logprobs if logprobs is not None else [-0.5] * n, LOGPROB),
            policy_versions=pack(versions if versions is not None else [0] * n, TOKEN),
            stage_reward=reward, terminal=self.rng.random() < 0.5,
        )

    def outcome(self, group_id: str, member: int, **fields) -> Outcome:
        values = {"num_stages": 1, "outcome": 1.0, "success": True} | fields
        return Outcome(msg_id=next(self.msg_ids), worker_id=WORKER, group_id=group_id,
                       trajectory_id=f"{group_id}/{member}", member=member, **values)

    # --- messages on groups nobody leased: the value checks first, then unknown_group ---

    def stage_on_unknown_group(self):
        group = f"fz{next(self.fake_groups)}"
        member = self.rng.randrange(10**6)
        kind = self.rng.randrange(6)
        if kind == 0:
            return self.record(group, member, reward=self.rng.choice(BAD_FLOATS)), "nonfinite_reward"
        if kind == 1:
            return self.record(group, member, actions=[1], logprobs=[self.rng.choice([math.nan, 5.0, math.inf])]), \
                "bad_logprob"
        if kind == 2:
            return self.record(group, member, actions=[1], versions=[-self.rng.randint(1, 2**31)]), "bad_version"
        if kind == 3:
            return self.record(group, member, observations=[self.rng.choice([-1, -(2**31)])]), "bad_token"
        # values in range but hostile: huge token ids, versions, rewards; the group was never leased
        return self.record(group, member, reward=self.rng.choice(HUGE_FLOATS + [None]),
                           actions=[2**31 - 1, self.rng.randrange(2**31)], versions=[2**31 - 1, 2**30]), "unknown_group"

    def outcome_on_unknown_group(self):
        group = f"fz{next(self.fake_groups)}"
        kind = self.rng.randrange(5)
        if kind == 0:
            return self.outcome(group, -self.rng.randint(1, 2**31)), "bad_member"
        if kind == 1:
            return self.outcome(group, 0, outcome=self.rng.choice(BAD_FLOATS)), "nonfinite_outcome"
        if kind == 2:
            return self.outcome(group, 0, num_stages=self.rng.choice([0, -1, -(2**40)])), "bad_num_stages"
        if kind == 3:  # a forged outcome, values fine: the group was never leased
            return self.outcome(group, self.rng.randrange(GROUP_SIZE), outcome=self.rng.choice(HUGE_FLOATS),
                                num_stages=self.rng.choice([1, 10**9])), "unknown_group"
        return self.outcome(group, 0, abandoned=True, outcome=None, num_stages=0, reason="x" * 1000), "unknown_group"

    def spoofed_learner(self):
        if self.rng.random() < 0.5:
            return BatchRequest(learner_id="learner", msg_id=next(self.msg_ids),
                                policy_version=self.rng.choice(HUGE_INTS + [0, 1]),
                                max_tokens=self.rng.choice([1, 2**40, -5]), min_items=self.rng.choice([0, 2**40, -1]),
                                max_wait_s=self.rng.choice(BAD_FLOATS + [0.0, 1e9])), "not_learner"
        return BatchAck(learner_id="learner", msg_id=next(self.msg_ids), batch_id=self.rng.choice(HUGE_INTS + [0, 1]),
                        policy_version=self.rng.choice(HUGE_INTS + [0]), trained=self.rng.random() < 0.5), "not_learner"

    def eval_report(self):
        if self.rng.random() < 0.5:
            version = self.rng.choice(HUGE_INTS[1:])  # all out of [0, 2**31 - 1]
            return EvalReport(worker_id=WORKER, msg_id=next(self.msg_ids), policy_version=version,
                              metrics={"eval_success_rate": 1.0}), "bad_version"
        return EvalReport(worker_id=WORKER, msg_id=next(self.msg_ids), policy_version=0,
                          metrics={"eval_success_rate": self.rng.choice(BAD_FLOATS)}), "nonfinite_metric"

    def wrong_type(self):
        kind = self.rng.randrange(4)
        if kind == 0:
            return LeaseGrant(msg_id=next(self.msg_ids), group_id="g0", group_size=2**40, policy_version=2**40), \
                "unexpected_type"
        if kind == 1:
            return Batch(msg_id=next(self.msg_ids), batch_id=0, items=[], stats=ReplayStats()), "unexpected_type"
        if kind == 2:
            return WeightsPublished(version=2**31 - 1, path="/etc/passwd"), "unexpected_type"
        return Error(msg_id=next(self.msg_ids), code="bad_state", detail="x"), "unexpected_error"  # never answered

    def undecodable(self):
        """Raw frames: garbage, truncated messages, a member < 0 (refused by the decoder), another protocol version,
        an unknown type tag, two message frames."""
        valid = encode(self.record("g0", 0))
        kind = self.rng.randrange(6)
        if kind == 0:
            return [self.rng.randbytes(self.rng.randint(0, 64))], "undecodable"
        if kind == 1:
            return [valid[: self.rng.randrange(len(valid))]], "undecodable"
        fields = msgspec.msgpack.decode(valid)
        if kind == 2:
            fields["member"] = -self.rng.randint(1, 2**40)
        elif kind == 3:
            fields["protocol"] = self.rng.choice([0, 2, 99, -1])
        elif kind == 4:
            fields["type"] = "root_shell"
        else:
            return [valid, valid], "undecodable"
        return [msgspec.msgpack.encode(fields)], "undecodable"

    def heartbeat(self):
        ids = [self.rng.choice(["g0", "g1", "fz1", "", "x" * 200]) for _ in range(self.rng.randint(0, 5))]
        return Heartbeat(worker_id=WORKER, group_ids=ids), None  # accepted, never answered

    def poison_own_group(self, group_id: str) -> list:
        """A group the fuzzer leased: members out of range; then every member gets one record the replay's state
        refuses (which abandons that member), a forged outcome for an abandoned member (a duplicate: acked, not
        refused) before the last one; once all are abandoned the group closes, and a late outcome for it is acked as
        a resend (closed_group_resends) and changes nothing."""
        messages = [(self.outcome(group_id, self.rng.choice([GROUP_SIZE, 10**6, 2**40])), "bad_member"),
                    (self.record(group_id, self.rng.choice([GROUP_SIZE, 2**31])), "bad_member")]
        for member in range(GROUP_SIZE):
            if member == GROUP_SIZE - 1:
                messages.append((self.outcome(group_id, 0, outcome=1e308), None))
            kind = self.rng.randrange(3)
            if kind == 0:
                messages.append((self.record(group_id, member, actions=[VOCAB + self.rng.randrange(2**30)]),
                                 "bad_token"))
            elif kind == 1:
                messages.append((self.record(group_id, member, actions=[1], versions=[2**31 - 1]), "version_ahead"))
            else:
                messages.append((self.record(group_id, member, observations=[1] * MAX_SEQ_LEN), "too_long"))
        messages.append((self.outcome(group_id, 1), None))
        return messages

    def random_message(self):
        return self.rng.choices(
            [self.stage_on_unknown_group, self.outcome_on_unknown_group, self.spoofed_learner, self.eval_report,
             self.wrong_type, self.undecodable, self.heartbeat],
            weights=[30, 20, 20, 5, 5, 15, 5],
        )[0]()


def answered(message, reason: str | None) -> bool:
    return not isinstance(message, Error | Heartbeat)


class Link:
    """The fuzzer's DEALER: sends a window, then reads every reply it must get."""

    def __init__(self, dealer: zmq.Socket) -> None:
        self.dealer = dealer
        self.expected: Counter[str] = Counter()  # reason -> messages sent that must be refused with it
        self.refused: Counter[str] = Counter()  # reason -> Error replies received
        self.sent = 0
        self.grants: list[LeaseGrant] = []

    def exchange(self, window: list, timeout_s: float = 30.0) -> None:
        replies = 0
        for message, reason in window:
            if isinstance(message, list):
                self.dealer.send_multipart(message)
                replies += 1
            else:
                send(self.dealer, message)
                replies += answered(message, reason)
            self.sent += 1
            if reason is not None:
                self.expected[reason] += 1
        deadline = time.monotonic() + timeout_s
        while replies and time.monotonic() < deadline:
            if not poll(self.dealer, 0.5):
                continue
            reply = receive(self.dealer)[1]
            replies -= len(reply.msg_ids) if isinstance(reply, Acks) else 1  # a round's acks in one (protocol 7)
            if isinstance(reply, Error):  # detail "<reason>: ..."; a frame that did not decode says why instead
                head = reply.detail.split(":")[0]
                self.refused[head if re.fullmatch(r"[a-z_]+", head) else "undecodable"] += 1
            elif isinstance(reply, LeaseGrant):
                self.grants.append(reply)
            elif not isinstance(reply, LeaseDenied):
                assert isinstance(reply, Ack | Acks), reply
        assert replies == 0, f"{replies} replies missing"


def fuzz(link: Link, fuzzer: Fuzzer, own_groups: int, run_dir: Path) -> tuple[int, float]:
    """Lease groups of our own as soon as the replay is up (admission is widest at version 0), wait until the
    learner has trained a step (its version bounds version_ahead), then fuzz. Returns (the learner's version when
    the fuzz began, the seconds it took)."""
    deadline = time.monotonic() + 180
    while len(link.grants) < own_groups and time.monotonic() < deadline:
        link.exchange([(LeaseRequest(worker_id=WORKER, msg_id=next(fuzzer.msg_ids)), None)], timeout_s=120)
        time.sleep(0.05)
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(link.grants) == own_groups and metrics.exists(), "the run never got going"
    version = len(metrics.read_text().splitlines())
    poison = [m for grant in link.grants for m in fuzzer.poison_own_group(grant.group_id)]
    started = time.monotonic()
    while link.sent < MESSAGES:
        window = poison[:WINDOW] or [fuzzer.random_message() for _ in range(min(WINDOW, MESSAGES - link.sent))]
        poison = poison[WINDOW:]
        link.exchange(window)
    return version, time.monotonic() - started


def final_replay_stats(log_text: str) -> dict[str, int]:
    """`rejected` of the replay's last stats line (logged when it stops: everything, after the last batch too)."""
    line = [ln for ln in log_text.splitlines() if "replay service stopped:" in ln][-1]
    return ast.literal_eval(re.search(r"rejected=(\{[^}]*\})", line).group(1))


def test_ten_thousand_hostile_messages_during_a_curve_run(tmp_path):
    """Slow by design: the run's 20 versions take >= 10 s by the clock so that they outlast the fuzz (below)."""
    keys = tmp_path / "curve"
    assert main(["keys", str(keys)]) == 0
    replay, publish = free_endpoint(), free_endpoint()
    args = [sys.executable, "-m", "launch.cli", "train", f"run.dir={tmp_path}", "run.name=t", "wandb.mode=disabled",
            "run.target_success=null", "run.max_versions=20", "run.eval_samples_per_task=0",
            f"rollout.group_size={GROUP_SIZE}", "env.kwargs.num_tasks=4",
            # Each step waits 0.5 s for items (it never gets 1000): the 20 versions take >= 10 s by the clock,
            # whatever the load, and outlast the fuzz (8 s at load average 10 on 2 cores: done by version 9).
            "learner.min_batch_items=1000", "learner.batch_wait_s=0.5",
            f"replay.vocab_size={VOCAB}", f"model.max_seq_len={MAX_SEQ_LEN}",
            f"replay.endpoint={replay}", f"learner.publish_endpoint={publish}", f"security.curve_dir={keys}"]
    run = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    context = zmq.Context()
    config = config_from_dict({"security": {"curve_dir": str(keys)}})
    # a worker's own key, gone rogue
    dealer = connect_dealer(context, replay, WORKER, load_keys(config.security.curve_dir, WORKER))
    link, fuzzer = Link(dealer), Fuzzer(seed=11)
    try:
        first_version, fuzz_s = fuzz(link, fuzzer, own_groups=8, run_dir=tmp_path / "t")
        # Every reply came, so the replay was live throughout: it is stopped as soon as the learner ends.
        trained_by_then = len((tmp_path / "t" / "metrics.jsonl").read_text().splitlines())
        stdout, stderr = run.communicate(timeout=240)
    finally:
        dealer.close(linger=0)
        context.term()
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, stderr[-3000:]
    assert link.sent >= MESSAGES
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["versions"] == 20, result
    run_dir = tmp_path / "t"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(m["ledger_residual_max"] < 1e-6 for m in lines)
    expected = dict(link.expected)
    assert set(expected) >= {"not_learner", "unknown_group", "bad_member", "bad_num_stages", "nonfinite_reward",
                             "nonfinite_outcome", "bad_logprob", "bad_version", "bad_token", "version_ahead",
                             "too_long", "undecodable", "unexpected_type", "unexpected_error", "nonfinite_metric"}
    answered_expected = Counter(expected)
    answered_expected.pop("unexpected_error")  # an Error is counted, never answered
    assert link.refused == answered_expected, "every hostile message got the Error its defect calls for"
    # The replay counted exactly these, and nothing of the honest workers' traffic (which also kept going):
    assert final_replay_stats((run_dir / "logs" / "replay.log").read_text()) == expected
    # The metrics line carries them (as of the last batch, which may precede the end of the fuzz):
    last = lines[-1]
    in_metrics = {k[len("rejected_"):]: v for k, v in last.items() if k.startswith("rejected_")}
    assert 0 < last["rejected"] == sum(in_metrics.values()) and all(v <= expected[k] for k, v in in_metrics.items())
    assert last["trajectories_finished"] > 0
    print(f"fuzz: {link.sent} messages in {fuzz_s:.1f} s (the learner from "
          f"version {first_version} to {trained_by_then} of 20), run {result['wall_s']:.1f} s; "
          f"refused {sum(expected.values())}: {sorted(expected.items())}")
