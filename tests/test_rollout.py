"""The rollout worker against a real ROUTER socket playing the replay service and a real PUB socket of weights.

The worker runs in a thread (and, for signals, in a subprocess) exactly as in production: real ZeroMQ sockets,
the built-in torch engine on the tiny model, the trap environment with simulated latency.
"""

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import zmq
from rollout_helpers import model_dir_for

from async_rl.config import Config
from async_rl.config_load import load_config
from async_rl.loss import token_logprobs
from async_rl.model import load_model, load_tokenizer
from async_rl.protocol import (
    Ack,
    Error,
    Heartbeat,
    LeaseDenied,
    LeaseGrant,
    LeaseRequest,
    Outcome,
    StageRecord,
    WeightsPublished,
)
from async_rl.transport import bind_publisher, bind_router, poll, receive, send
from async_rl.weights.file import save_weights
from rollout.worker import run

REPO = Path(__file__).resolve().parent.parent


class ReplayDouble:
    """The replay service's part on a real ROUTER: grants `leases` (group ids), then denies ("budget").

    Every StageRecord and Outcome is acked, except the first StageRecord after `drop_an_ack` is set (as if its
    ack were lost on the way). Everything received is kept with its arrival time.
    """

    def __init__(
        self, context: zmq.Context, leases: list[str], group_size: int, retry_after_s: float = 0.1
    ) -> None:
        self.socket = bind_router(context, "tcp://127.0.0.1:*", insecure=True)
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.leases = list(leases)
        self.group_size = group_size
        self.retry_after_s = retry_after_s
        self.arrivals: list[tuple[float, object]] = []
        self.drop_an_ack = False
        self.ack_dropped_for: int | None = None  # msg_id of the record whose ack was dropped

    def serve_until(self, condition, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, "timed out waiting for the worker"
            if poll(self.socket, 0.02):
                identity, message = receive(self.socket)
                self.arrivals.append((time.monotonic(), message))
                self._reply(identity, message)

    def serve_for(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        self.serve_until(lambda: time.monotonic() >= deadline, timeout_s=seconds + 1.0)

    def _reply(self, identity: bytes, message) -> None:
        if isinstance(message, LeaseRequest):
            send(self.socket, self._lease_reply(message.msg_id), identity)
        elif isinstance(message, StageRecord | Outcome):
            if self.drop_an_ack and isinstance(message, StageRecord):
                self.drop_an_ack = False
                self.ack_dropped_for = message.msg_id
                return
            send(self.socket, Ack(msg_id=message.msg_id), identity)

    def _lease_reply(self, msg_id: int) -> LeaseGrant | LeaseDenied:
        if not self.leases:
            return LeaseDenied(msg_id=msg_id, reason="budget", retry_after_s=self.retry_after_s, policy_version=0)
        return LeaseGrant(msg_id=msg_id, group_id=self.leases.pop(0), group_size=self.group_size, policy_version=0)

    def copies(self, msg_id: int) -> int:
        return sum(1 for _, m in self.arrivals if isinstance(m, StageRecord | Outcome) and m.msg_id == msg_id)

    def first(self, kind) -> list[tuple[float, object]]:
        """Messages of `kind`, first copy of each msg_id, in arrival order."""
        seen, out = set(), []
        for at, message in self.arrivals:
            if isinstance(message, kind) and message.msg_id not in seen:
                seen.add(message.msg_id)
                out.append((at, message))
        return out

    def records(self) -> list[StageRecord]:
        return [m for _, m in self.first(StageRecord)]

    def outcomes(self) -> list[Outcome]:
        return [m for _, m in self.first(Outcome)]

    def groups_finished(self, count: int) -> bool:
        """`count` groups have every trajectory's Outcome."""
        per_group = defaultdict(set)
        for outcome in self.outcomes():
            per_group[outcome.group_id].add(outcome.member)
        return sum(len(members) == self.group_size for members in per_group.values()) >= count


@pytest.fixture
def zmq_context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)  # closes the test's sockets too, even after a failure


@pytest.fixture
def publisher(zmq_context):
    socket = bind_publisher(zmq_context, "tcp://127.0.0.1:*", insecure=True)
    yield socket
    socket.close(linger=0)


def worker_overrides(tmp_path: Path, replay: ReplayDouble, publisher: zmq.Socket, *extra: str) -> list[str]:
    return [
        f"run.dir={tmp_path}",
        "wandb.mode=disabled",
        f"replay.endpoint={replay.endpoint}",
        f"learner.publish_endpoint={publisher.getsockopt_string(zmq.LAST_ENDPOINT)}",
        f"rollout.group_size={replay.group_size}",
        "security.insecure=true",  # the doubles listen on loopback TCP without keys
        "env.kwargs.num_tasks=3",
        "env.kwargs.step_latency_s=0.02",
        "rollout.heartbeat_s=0.2",
        *extra,
    ]


def make_config(tmp_path: Path, replay: ReplayDouble, publisher: zmq.Socket, *extra: str) -> Config:
    return load_config(None, worker_overrides(tmp_path, replay, publisher, *extra))


@contextlib.contextmanager
def running_worker(config: Config):
    stop = threading.Event()
    errors = []

    def target():
        try:
            run(config, worker_index=0, stop=stop)
        except BaseException as exc:  # surfaced in the test thread below
            errors.append(exc)

    thread = threading.Thread(target=target, name="rollout-worker")
    thread.start()
    try:
        yield stop
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive(), "the worker did not stop within 10 s of the stop event"
    assert not errors, errors


def by_trajectory(records: list[StageRecord]) -> dict[str, list[StageRecord]]:
    trajectories = defaultdict(list)
    for record in records:
        trajectories[record.trajectory_id].append(record)
    return trajectories


def assert_behaviour_logprobs_are_exact(records: list[StageRecord], models: dict[int, torch.nn.Module]) -> None:
    """Rebuild each trajectory from its records alone; every action token's log mu equals a recomputation by the
    weights of the version it is tagged with (so the concatenation is the context the engine really saw)."""
    for stages in by_trajectory(records).values():
        tokens, positions, logprobs, versions = [], [], [], []
        for record in sorted(stages, key=lambda r: r.stage_index):
            tokens += record.observation_ids().tolist()
            positions += range(len(tokens) - 1, len(tokens) - 1 + len(record.action_ids()))
            tokens += record.action_ids().tolist()
            logprobs += record.logprobs().tolist()
            versions += record.versions().tolist()
        sequence = torch.tensor([tokens])
        for version, model in models.items():
            with torch.no_grad():
                recomputed = token_logprobs(model(sequence).logits, sequence)[0]
            for position, logprob, tagged in zip(positions, logprobs, versions, strict=True):
                if tagged == version:  # float32: batched, cached decoding differs from one pass by a few ulps
                    assert abs(float(recomputed[position]) - logprob) <= 1e-5 + 1e-5 * abs(logprob)


def test_stages_stream_contiguously_and_before_their_outcome(tmp_path, zmq_context, publisher):
    replay = ReplayDouble(zmq_context, ["g0", "g1"], group_size=3)
    config = make_config(tmp_path, replay, publisher, "env.kwargs.retries=3", "env.kwargs.outcome_delay_s=0.2")
    with running_worker(config):
        replay.serve_until(lambda: replay.groups_finished(2))
    records, outcomes = replay.first(StageRecord), replay.first(Outcome)
    tokenizer = load_tokenizer(model_dir_for(config))
    for trajectory_id, stages in by_trajectory([m for _, m in records]).items():
        assert [r.stage_index for r in stages] == list(range(len(stages))), "contiguous, in order, no gaps"
        assert [r.terminal for r in stages] == [False] * (len(stages) - 1) + [True]
        assert all(len(r.action_ids()) == len(r.logprobs()) == len(r.versions()) >= 1 for r in stages)
        assert tokenizer.decode(stages[0].observation_ids()) == f"task{stages[0].task_id} stage1"
        outcome_at, outcome = next((at, o) for at, o in outcomes if o.trajectory_id == trajectory_id)
        assert outcome.num_stages == len(stages) and not outcome.abandoned and outcome.outcome in (0.0, 1.0)
        assert outcome.success == (outcome.outcome == 1.0)
        assert max(at for at, r in records if r.trajectory_id == trajectory_id) < outcome_at
    for group_id in ("g0", "g1"):
        arrivals = [at for at, r in records if r.group_id == group_id]
        first_stage = min(at for at, r in records if r.group_id == group_id and r.stage_index == 0)
        assert first_stage < max(arrivals) - 0.02, "a stage is streamed before the group's last stage"
    assert_behaviour_logprobs_are_exact(replay.records(), {0: load_model(model_dir_for(config)).eval()})


def test_heartbeats_name_the_live_group(tmp_path, zmq_context, publisher):
    replay = ReplayDouble(zmq_context, ["g0"], group_size=2)
    config = make_config(tmp_path, replay, publisher, "env.kwargs.outcome_delay_s=1.0", "rollout.heartbeat_s=0.1")
    with running_worker(config):
        replay.serve_until(lambda: replay.groups_finished(1))
    heartbeats = [m for _, m in replay.arrivals if isinstance(m, Heartbeat)]
    assert heartbeats and all(h.worker_id == "rollout-0" for h in heartbeats)
    assert any(h.group_ids == ["g0"] for h in heartbeats)


def test_new_weights_tag_the_tokens_generated_after_them(tmp_path, zmq_context, publisher):
    replay = ReplayDouble(zmq_context, [f"g{i}" for i in range(100)], group_size=2)
    config = make_config(tmp_path, replay, publisher, "env.kwargs.retries=6")
    model_v0 = load_model(model_dir_for(config)).eval()
    torch.manual_seed(1)
    weights = {name: value + 0.3 * torch.randn_like(value) for name, value in model_v0.state_dict().items()}
    save_weights(weights, tmp_path / "weights" / "v3.safetensors")
    announcement = WeightsPublished(version=3, path=str(tmp_path / "weights" / "v3.safetensors"))

    announced_at = [0.0]

    def new_version_in_use() -> bool:
        if time.monotonic() - announced_at[0] > 0.2:  # PUB/SUB may drop a message: re-announce until it lands
            send(publisher, announcement)
            announced_at[0] = time.monotonic()
        return any(3 in r.versions() for r in replay.records())

    with running_worker(config):
        replay.serve_until(lambda: len(replay.records()) >= 2)
        replay.serve_until(new_version_in_use)
        count = len(replay.records())
        replay.serve_until(lambda: len(replay.records()) >= count + 4)

    versions = [v for r in sorted(replay.records(), key=lambda r: r.msg_id) for v in r.versions().tolist()]
    assert versions[0] == 0 and versions[-1] == 3
    assert versions == sorted(versions), "once the new weights are in, no token carries the old version"
    model_v3 = load_model(model_dir_for(config)).eval()
    model_v3.load_state_dict(weights)
    assert_behaviour_logprobs_are_exact(replay.records(), {0: model_v0, 3: model_v3})


def test_a_late_worker_catches_up_from_latest_json(tmp_path, zmq_context, publisher):
    replay = ReplayDouble(zmq_context, ["g0"], group_size=2)
    config = make_config(tmp_path, replay, publisher)
    model = load_model(model_dir_for(config))
    save_weights(model.state_dict(), config.run_dir / "weights" / "v5.safetensors")
    (config.run_dir / "weights" / "latest.json").write_text(
        f'{{"version": 5, "path": "{config.run_dir / "weights" / "v5.safetensors"}"}}'
    )
    with running_worker(config):
        replay.serve_until(lambda: len(replay.records()) >= 1)
    assert replay.records()[0].versions().tolist() == [5]


def test_a_denied_lease_is_asked_again_after_retry_after_s(tmp_path, zmq_context, publisher):
    replay = ReplayDouble(zmq_context, [], group_size=2, retry_after_s=0.25)
    config = make_config(tmp_path, replay, publisher)
    with running_worker(config):
        replay.serve_until(lambda: len(replay.first(LeaseRequest)) >= 4)
    asked_at = [at for at, _ in replay.first(LeaseRequest)]
    assert all(later - earlier >= 0.2 for earlier, later in itertools.pairwise(asked_at))


def test_a_malformed_reply_or_an_error_does_not_stop_the_worker(tmp_path, zmq_context, publisher, caplog):
    replay = ReplayDouble(zmq_context, ["g0"], group_size=2)
    config = make_config(tmp_path, replay, publisher)
    with running_worker(config):
        assert poll(replay.socket, 20.0)
        identity, request = receive(replay.socket)
        replay.socket.send_multipart([identity, b"\x93not a message"])
        send(replay.socket, Error(msg_id=request.msg_id, code="bad_state", detail="refused for the test"), identity)
        replay.serve_until(lambda: replay.groups_finished(1))
    (_, retry), *_ = replay.first(LeaseRequest)
    assert retry.msg_id != request.msg_id, "after the Error the worker asks again with a fresh request"
    assert "malformed message from replay" in caplog.text and "refused for the test" in caplog.text
    lines = [json.loads(line) for line in (config.run_dir / "metrics" / "rollout-0.jsonl").read_text().splitlines()]
    assert lines[-1]["bad_messages"] == 1, "the malformed reply is counted on the worker's metrics line"


def test_a_dropped_ack_is_resent_with_the_same_msg_id(tmp_path, zmq_context, publisher):
    replay = ReplayDouble(zmq_context, ["g0"], group_size=2)
    replay.drop_an_ack = True
    config = make_config(tmp_path, replay, publisher, "rollout.ack_timeout_s=0.3")
    with running_worker(config):
        replay.serve_until(lambda: replay.ack_dropped_for is not None)
        dropped = replay.ack_dropped_for
        replay.serve_until(lambda: replay.copies(dropped) >= 2)
        replay.serve_for(0.8)  # two more ack timeouts: the acked resend must not come again
        replay.serve_until(lambda: replay.groups_finished(1))
    copies = [m for _, m in replay.arrivals if isinstance(m, StageRecord) and m.msg_id == dropped]
    assert len(copies) == 2 and copies[0] == copies[1]
    others = [m.msg_id for _, m in replay.arrivals if isinstance(m, StageRecord) and m.msg_id != dropped]
    assert len(others) == len(set(others)), "acked records are never resent"
    # The worker's journal (rollout/ack_journal.py) holds each record once as sent, as it was sent, and once as
    # acked (the one whose ack was dropped too: acked on its resend).
    from rollout.ack_journal import entry, journal_path, read_journal

    journalled, unreadable = read_journal(journal_path(config.run_dir, "rollout-0"))
    sent = {m.msg_id: m for _, m in replay.arrivals if isinstance(m, StageRecord | Outcome)}
    records = [line for line in journalled if line["k"] != "ack"]
    assert unreadable == 0 and sorted(line["m"] for line in records) == sorted(sent)
    assert all(line == entry(sent[line["m"]]) for line in records)
    assert sorted(line["m"] for line in journalled if line["k"] == "ack") == sorted(sent)


def test_a_slow_outcome_does_not_block_the_next_group(tmp_path, zmq_context, publisher):
    replay = ReplayDouble(zmq_context, ["g0", "g1"], group_size=2)
    config = make_config(tmp_path, replay, publisher, "env.kwargs.outcome_delay_s=1.5")
    with running_worker(config):
        replay.serve_until(lambda: replay.groups_finished(2))
    first_g1_stage = min(at for at, r in replay.first(StageRecord) if r.group_id == "g1")
    first_g0_outcome = min(at for at, o in replay.first(Outcome) if o.group_id == "g0")
    assert first_g1_stage < first_g0_outcome


def test_a_context_longer_than_the_model_ends_the_trajectory_and_it_is_judged(tmp_path, zmq_context, publisher):
    replay = ReplayDouble(zmq_context, ["g0"], group_size=2)
    # "task0 stage1" (2) + action (1) + "ok|miss stageN" (2) + action (1) = 6 tokens; a third action cannot fit.
    config = make_config(tmp_path, replay, publisher, "model.max_seq_len=6", "env.kwargs.retries=5",
                         "env.kwargs.choices=2")
    with running_worker(config):
        replay.serve_until(lambda: replay.groups_finished(1))
    for outcome in replay.outcomes():  # 4 stages and 5 retries: no trajectory can end within 2 stages
        stages = [r for r in replay.records() if r.trajectory_id == outcome.trajectory_id]
        assert outcome.num_stages == len(stages) == 2 and not stages[-1].terminal
        assert not outcome.abandoned and outcome.outcome == 0.0 and not outcome.success  # cut short: not solved


def test_a_context_too_short_for_any_first_observation_stops_the_worker_naming_the_key(tmp_path, zmq_context,
                                                                                        publisher):
    """model.max_seq_len=2 leaves no room after "taskN stage1": every trajectory is abandoned. After
    NO_ROOM_STREAK_LIMIT in a row the worker stops with a ConfigError naming the key (before, the run went on
    abandoning until run.max_wall_s and exited 0 with 0 env steps); each abandoned trajectory's Outcome was sent."""
    from async_rl.errors import ConfigError
    from rollout.runner import NO_ROOM_STREAK_LIMIT

    groups = NO_ROOM_STREAK_LIMIT // 2 + 4
    replay = ReplayDouble(zmq_context, [f"g{i}" for i in range(groups)], group_size=2)
    config = make_config(tmp_path, replay, publisher, "model.max_seq_len=2")
    errors = []

    def target():
        try:
            run(config, worker_index=0, stop=threading.Event())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, name="rollout-worker")
    thread.start()
    replay.serve_until(lambda: not thread.is_alive(), timeout_s=60)
    thread.join(timeout=10)
    assert len(errors) == 1 and isinstance(errors[0], ConfigError)
    assert str(errors[0]).startswith("model.max_seq_len: 2 tokens leave no room for an action after the first "
                                     f"observation of env 'trap': {NO_ROOM_STREAK_LIMIT} trajectories in a row")
    abandoned = [o for o in replay.outcomes() if o.abandoned]
    assert len(abandoned) >= NO_ROOM_STREAK_LIMIT - 2 and not replay.records()


def test_the_worker_stops_promptly_on_the_stop_event_despite_a_slow_judge(tmp_path, zmq_context, publisher):
    replay = ReplayDouble(zmq_context, ["g0", "g1"], group_size=2)
    config = make_config(tmp_path, replay, publisher, "env.kwargs.outcome_delay_s=60")
    with running_worker(config) as stop:
        replay.serve_until(lambda: any(r.terminal for r in replay.records()))
        stopped_at = time.monotonic()
        stop.set()
    assert time.monotonic() - stopped_at < 3.0


@pytest.mark.slow
def test_sigterm_stops_a_worker_process_cleanly(tmp_path, zmq_context, publisher):
    replay = ReplayDouble(zmq_context, ["g0"], group_size=2)
    overrides = worker_overrides(tmp_path, replay, publisher, "env.kwargs.outcome_delay_s=60")
    code = "import sys; from async_rl.config_load import load_config; from rollout.worker import run; "
    code += "run(load_config(None, sys.argv[1:]), 0)"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-c", code, *overrides], env=env, cwd=tmp_path)
    try:
        replay.serve_until(lambda: any(r.terminal for r in replay.records()), timeout_s=60)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()


# --- many trajectories in flight, user environments, multi-token turns --------------------------------------------

TEXT_ENV = '''
import itertools
from rollout.envs.base import Judgement, StepResult, Task

made = itertools.count()

class TextEnv:
    """Byte-level text (no declared vocabulary): each turn's action is any text; the tool answers with a
    multi-line report. Every `fail_every`-th env made raises inside its second step."""
    def __init__(self, turns, fail):
        self.turns, self.fail, self.n = turns, fail, 0
    def reset(self, task):
        return "Task " + task.id + ": write something.\\n"
    def step(self, action):
        self.n += 1
        if self.fail and self.n == 2:
            raise ValueError("the tool fell over")
        return StepResult("Tool: got " + str(len(action)) + " chars\\nnext?\\n", float(len(action) > 3),
                          self.n >= self.turns)
    def judge(self):
        return Judgement(score=0.5, success=False, info={"turns": float(self.n)})

class Factory:
    def __init__(self, turns, fail_every):
        self.turns, self.fail_every = turns, fail_every
    def tasks(self, split):
        return [Task(id=f"{split}-{i}", data={}) for i in range(3)]
    def make(self):
        n = next(made)
        return TextEnv(self.turns, fail=bool(self.fail_every) and n % self.fail_every == self.fail_every - 1)

def factory(turns=3, fail_every=0):
    return Factory(turns, fail_every)
'''


@pytest.fixture
def text_env(tmp_path, monkeypatch):
    """A user's environment module outside the project, importable by name."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "text_env_plugin.py").write_text(TEXT_ENV)
    monkeypatch.syspath_prepend(str(plugins))
    yield "text_env_plugin:factory"
    sys.modules.pop("text_env_plugin", None)


def test_multi_token_turns_stop_at_a_stop_string_and_rebuild_exactly(tmp_path, zmq_context, publisher, text_env):
    replay = ReplayDouble(zmq_context, ["g0", "g1"], group_size=2)
    config = make_config(tmp_path, replay, publisher, f"env.name={text_env}", "env.kwargs={}",
                         "env.kwargs.turns=3", "rollout.max_new_tokens=12", "rollout.stop=['e', 'x']")
    with running_worker(config):
        replay.serve_until(lambda: replay.groups_finished(2))
    tokenizer = load_tokenizer(model_dir_for(config))
    assert len(tokenizer) == 259  # no vocabulary declared: the tiny model's tokenizer is byte-level
    records = replay.records()
    for stages in by_trajectory(records).values():
        stages.sort(key=lambda r: r.stage_index)
        assert len(stages) == 3 and stages[-1].terminal and stages[0].task_id.startswith("train-")
        assert tokenizer.decode(stages[0].observation_ids()) == f"Task {stages[0].task_id}: write something.\n"
        for record in stages[1:]:
            assert tokenizer.decode(record.observation_ids()).startswith("Tool: got ")
    ends = []
    for record in records:
        text = tokenizer.decode(record.action_ids(), skip_special_tokens=True)
        eos = record.action_ids()[-1] == tokenizer.eos_token_id
        assert 1 <= len(record.action_ids()) <= 12
        if not eos and len(record.action_ids()) < 12:  # ended early without EOS: only a stop string does that
            assert text.endswith("e") or text.endswith("x")
            ends.append(text)
        assert "e" not in text[:-1] and "x" not in text[:-1], "nothing is generated past a stop string"
    assert ends, "some turns ended at a stop string"
    assert_behaviour_logprobs_are_exact(records, {0: load_model(model_dir_for(config)).eval()})
    assert {o.outcome for o in replay.outcomes()} == {0.5} and not any(o.success for o in replay.outcomes())


def test_an_env_error_abandons_only_its_trajectory(tmp_path, zmq_context, publisher, text_env):
    replay = ReplayDouble(zmq_context, ["g0", "g1", "g2"], group_size=2)
    config = make_config(tmp_path, replay, publisher, f"env.name={text_env}", "env.kwargs={}",
                         "env.kwargs.fail_every=3", "rollout.max_new_tokens=4")
    with running_worker(config):
        replay.serve_until(lambda: replay.groups_finished(3))
    outcomes = replay.outcomes()
    failed = [o for o in outcomes if o.abandoned]
    assert len(outcomes) == 6 and len(failed) == 2
    for outcome in failed:
        assert outcome.reason == f"env_error: env '{text_env}': step raised ValueError: the tool fell over"
        assert outcome.num_stages == 1  # the first stage was streamed; the failed step produced none
    assert all(o.outcome == 0.5 for o in outcomes if not o.abandoned)


def test_trajectories_of_several_groups_are_in_flight_at_once(tmp_path, zmq_context, publisher):
    replay = ReplayDouble(zmq_context, ["g0", "g1", "g2"], group_size=2)
    config = make_config(tmp_path, replay, publisher, "rollout.max_inflight=6", "env.kwargs.step_latency_s=0.15",
                         "env.kwargs.retries=3")
    with running_worker(config):
        replay.serve_until(lambda: replay.groups_finished(3))
    spans = {}
    for at, record in replay.first(StageRecord):
        first, last = spans.get(record.group_id, (at, at))
        spans[record.group_id] = (min(first, at), max(last, at))
    for at, outcome in replay.first(Outcome):
        first, last = spans[outcome.group_id]
        spans[outcome.group_id] = (first, max(last, at))
    (s0, e0), (s1, _), (s2, _) = spans["g0"], spans["g1"], spans["g2"]
    assert s1 < e0 and s2 < e0, "groups 1 and 2 streamed stages while group 0 was still running"
    assert s2 - s0 < 0.15, "all three groups started within one tool latency"


class SleepingEngine:
    """A stand-in for a slow model (named as such): the real built-in engine, but every generate first sleeps
    `delay_s`, longer than rollout.ack_timeout_s (a real SmolLM2 call here takes 5-40 s)."""

    def __init__(self, inner, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    @property
    def version(self) -> int:
        return self.inner.version

    def generate(self, prompts, params):
        time.sleep(self.delay_s)
        return self.inner.generate(prompts, params)

    def update_weights(self, version: int, path: str, format: str | None = None) -> None:
        self.inner.update_weights(version, path, format)

    def close(self) -> None:
        self.inner.close()


def worker_lines(config: Config) -> list[dict]:
    path = config.run_dir / "metrics" / "rollout-0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_slow_engine_does_not_stall_the_workers_messaging(tmp_path, zmq_context, publisher, monkeypatch):
    """Issue 41: every engine call takes 1.2 s, ack_timeout_s is 0.4 s. Acks are read while the engine works, so
    nothing is resent but the one record whose ack was really lost; each lease request is sent once (no group is
    granted twice); heartbeats keep their pace; an outcome reaches the replay as soon as the judge returns and the
    judge latency is what the env took (0.3 s), not the engine call it waited behind."""
    import rollout.worker as worker_module

    made = worker_module.make_engine
    monkeypatch.setattr(worker_module, "make_engine", lambda *a, **k: SleepingEngine(made(*a, **k), 1.2))
    replay = ReplayDouble(zmq_context, ["g0", "g1", "g2"], group_size=2)
    replay.drop_an_ack = True
    config = make_config(tmp_path, replay, publisher, "rollout.ack_timeout_s=0.4", "rollout.heartbeat_s=0.1",
                         "env.kwargs.outcome_delay_s=0.3", "rollout.max_inflight=4", "run.metrics_every_s=0.5")
    with running_worker(config):
        replay.serve_until(lambda: replay.groups_finished(3), timeout_s=60)
    copies = defaultdict(int)
    for _, message in replay.arrivals:
        if isinstance(message, StageRecord | Outcome | LeaseRequest):
            copies[message.msg_id] += 1
    resent = {msg_id: n for msg_id, n in copies.items() if n > 1}
    assert resent == {replay.ack_dropped_for: 2}, "only the record whose ack was lost is sent again, once"
    requests = [m for _, m in replay.arrivals if isinstance(m, LeaseRequest)]
    assert len({m.msg_id for m in requests}) == len(requests), "a lease request is never sent twice"
    beats = [at for at, m in replay.arrivals if isinstance(m, Heartbeat)]
    first_outcome = replay.first(Outcome)[0][0]
    gaps = [b - a for a, b in itertools.pairwise(t for t in beats if t < first_outcome)]
    assert gaps and max(gaps) < 0.6, f"heartbeats stalled behind an engine call: {max(gaps):.2f} s"
    terminal = {r.trajectory_id: at for at, r in replay.first(StageRecord) if r.terminal}
    for at, outcome in replay.first(Outcome):
        # the judge starts when the env's step returns, a few ms before its terminal record reaches the replay; no
        # lower bound: a busy double stamps a terminal record late (the 0.3 s is checked from the worker's lines)
        assert 0.0 < at - terminal[outcome.trajectory_id] < 0.3 + 0.35, "the outcome waited for the engine"
    judged = [line["judge_latency_s_mean"] for line in worker_lines(config) if line["trajectories_finished"]]
    assert judged and all(0.29 <= value < 0.4 for value in judged), judged
    assert worker_lines(config)[-1]["resends"] == 1


def test_a_hung_step_or_judge_abandons_its_trajectory_and_frees_its_slot(tmp_path, zmq_context, publisher):
    """A tool that never returns (a 1000 s step) and a judge that never returns are abandoned at their limits,
    counted, and neither holds the worker: the next groups run, and the worker stops at once (daemon threads)."""
    replay = ReplayDouble(zmq_context, ["g0", "g1", "g2"], group_size=2)
    config = make_config(tmp_path, replay, publisher, "env.kwargs.step_latency_s=1000", "rollout.step_timeout_s=0.3",
                         "rollout.max_inflight=2", "run.metrics_every_s=0.3")
    started = time.monotonic()
    with running_worker(config):
        replay.serve_until(lambda: replay.groups_finished(3), timeout_s=20)
        replay.serve_for(0.5)
    assert time.monotonic() - started < 8
    outcomes = replay.outcomes()
    assert len(outcomes) == 6 and all(o.abandoned and o.reason.startswith("timeout: env 'trap' step") for o in outcomes)
    last = worker_lines(config)[-1]
    assert last["plugin_timeouts"] == 6 and last["hung_calls"] == 6
    # the first step moved the worker's loop (rollout/inline_calls.py), then steps ran on a pool (a busy machine may
    # move an instant call too: at least one)
    assert last["loop_moves"] >= 1

    replay = ReplayDouble(zmq_context, ["h0", "h1"], group_size=2)
    config = make_config(tmp_path / "judge", replay, publisher, "env.kwargs.outcome_delay_s=1000",
                         "rollout.judge_timeout_s=0.4")
    with running_worker(config):
        replay.serve_until(lambda: replay.groups_finished(2), timeout_s=20)
    assert all(o.abandoned and "judge did not return within 0.4 s" in o.reason for o in replay.outcomes())
    assert worker_lines(config)[-1]["plugin_timeouts"] == 4 and worker_lines(config)[-1]["loop_moves"] >= 1
