"""The workloads `systems.py` times: trap-env traffic through the replay service, and a two-process socket pair.

Traffic is what a random policy produces in the trap environment (docs/environments.md), played group by group in
the order a rollout worker sends it: stage k of every member, then stage k+1, then the outcomes.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass

import zmq

from async_rl.config import Config
from async_rl.protocol import (
    LOGPROB,
    TOKEN,
    Batch,
    BatchAck,
    BatchRequest,
    LeaseGrant,
    LeaseRequest,
    Message,
    Outcome,
    StageRecord,
    pack,
)
from async_rl.transport import bind_router, connect_dealer, receive, send
from rollout.envs.base import Task
from rollout.envs.trap import TrapFactory, symbol
from rollout.envs.trap import factory as trap_factory

LEARNER = b"learner-0"
NOW = 0.0  # the replay clock stands still: no lease or stage-group timer fires while we measure


@dataclass
class Stage:
    observation: list[int]
    action: int
    reward: float
    terminal: bool


def random_episode(factory: TrapFactory, task: Task, rng: random.Random, ids: dict[str, int]) -> tuple[
    list[Stage], float
]:
    """One trajectory of a uniformly random policy over the task's symbols; returns (stages, outcome)."""
    env = factory.make()
    text = env.reset(task)
    stages, done = [], False
    while not done:
        action = symbol(rng.randrange(factory.settings.choices))
        observation = [ids[word] for word in text.split()]
        result = env.step(action)
        text, done = result.observation or "", result.done
        stages.append(Stage(observation, ids[action], result.reward, done))
    return stages, env.judge().score


class ReplayDriver:
    """Plays whole groups through `ReplayService.handle`, adding up the CPU time spent inside `handle` only."""

    def __init__(self, service, config: Config, seed: int) -> None:  # noqa: ANN001 - replay.service.ReplayService
        self.service, self.config = service, config
        self.factory = trap_factory(**config.env.kwargs)
        self.tasks = self.factory.tasks("train")
        self.ids = {word: i + 3 for i, word in enumerate(self.factory.vocabulary())}  # after <pad> <eos> <unk>
        self.rng = random.Random(seed)
        self.msg_ids = itertools.count()
        self.handle_s = 0.0
        self.records = self.tokens = 0
        self.batches: list[Batch] = []

    def handle(self, identity: bytes, message: Message) -> list:
        started = time.process_time()  # CPU time: a shared machine's other tenants do not count against us
        replies = self.service.handle(identity, message, NOW)
        self.handle_s += time.process_time() - started
        return replies

    def play_group(self, worker_id: str, members: int | None = None, outcomes: bool = True) -> bool:
        """Lease a group, send the stage records of its first `members` members (all by default) and, if asked,
        their outcomes. False if admission refused the lease."""
        (_, grant), *_ = self.handle(worker_id.encode(), LeaseRequest(worker_id=worker_id, msg_id=next(self.msg_ids)))
        if not isinstance(grant, LeaseGrant):
            return False
        members = grant.group_size if members is None else members
        task = self.rng.choice(self.tasks)
        episodes = [random_episode(self.factory, task, self.rng, self.ids) for _ in range(members)]
        version = pack([grant.policy_version], TOKEN)
        for k in range(max(len(stages) for stages, _ in episodes)):
            for member, (stages, _) in enumerate(episodes):
                if k < len(stages):
                    record = self._record(worker_id, grant, task, member, k, stages[k], version)
                    self.handle(worker_id.encode(), record)
        if outcomes:
            for member, (stages, outcome) in enumerate(episodes):
                self.handle(worker_id.encode(), Outcome(
                    msg_id=next(self.msg_ids), worker_id=worker_id, group_id=grant.group_id,
                    trajectory_id=f"{grant.group_id}/{member}", member=member, num_stages=len(stages), outcome=outcome,
                    success=outcome >= 1.0,
                ))
        return True

    def _record(self, worker_id: str, grant: LeaseGrant, task: Task, member: int, k: int, stage: Stage,
                version: bytes) -> StageRecord:
        self.records += 1
        self.tokens += len(stage.observation) + 1
        return StageRecord(
            msg_id=next(self.msg_ids), worker_id=worker_id, group_id=grant.group_id,
            trajectory_id=f"{grant.group_id}/{member}", member=member, task_id=task.id, stage_index=k,
            observation_tokens=pack(stage.observation, TOKEN), action_tokens=pack([stage.action], TOKEN),
            behaviour_logprobs=pack([-1.79], LOGPROB), policy_versions=version, stage_reward=stage.reward,
            terminal=stage.terminal,
        )

    def train_one(self, max_tokens: int, min_items: int) -> Batch | None:
        """A learner's BatchRequest and, once the batch is served, its BatchAck (one optimizer step)."""
        version = self.service.policy_version
        request = BatchRequest(learner_id="learner-0", msg_id=next(self.msg_ids), policy_version=version,
                               max_tokens=max_tokens, min_items=min_items, max_wait_s=0.0)
        batch = next((m for _, m in self.handle(LEARNER, request) if isinstance(m, Batch)), None)
        if batch is None:
            self.service.parked.clear()  # nothing trainable left: withdraw the request
            return None
        self.handle(LEARNER, BatchAck(learner_id="learner-0", msg_id=next(self.msg_ids), batch_id=batch.batch_id,
                                      policy_version=version + 1))
        return batch

    def train_all(self, max_tokens: int) -> None:
        while len(self.service.queue) and self.train_one(max_tokens, min_items=1) is not None:
            pass

    def collect_batches(self, count: int) -> list[Batch]:
        """Full-size batches as the learner would get them (learner.batch_tokens, min_batch_items)."""
        learner = self.config.learner
        batches: list[Batch] = []
        while len(batches) < count:
            if len(self.service.queue) >= learner.min_batch_items or not self.play_group("worker-0"):
                batch = self.train_one(learner.batch_tokens, learner.min_batch_items)
                if batch is not None:
                    batches.append(batch)
        return batches


class RecordingDriver(ReplayDriver):
    """A ReplayDriver that keeps every (identity, message) it hands to the service: a stream to play again."""

    def __init__(self, service, config: Config, seed: int) -> None:  # noqa: ANN001 - replay.service.ReplayService
        super().__init__(service, config, seed)
        self.stream: list[tuple[bytes, Message]] = []

    def handle(self, identity: bytes, message: Message) -> list:
        self.stream.append((identity, message))
        return super().handle(identity, message)


# --- transport: the two ends of one DEALER -> ROUTER pipe ------------------------------------------------


def receiver(endpoint: str) -> None:
    """The ROUTER end (its own process). A round is b"hello N protocol|raw", N messages (decoded by
    async_rl.transport.receive, or just received), then our b"done"; b"stop" ends."""
    context = zmq.Context()
    socket = bind_router(context, endpoint, insecure=True)
    try:
        while True:
            identity, hello = socket.recv_multipart()
            if hello == b"stop":
                return
            _, count, mode = hello.split()
            started = time.process_time()  # this process's CPU, its ZeroMQ I/O thread included
            if mode == b"protocol":
                for _ in range(int(count)):
                    receive(socket)
            else:
                for _ in range(int(count)):
                    socket.recv_multipart()
            socket.send_multipart([identity, b"done %r" % (time.process_time() - started)])
    finally:
        socket.close(linger=0)
        context.term()


@dataclass
class Round:
    per_s: float  # messages/s, wall clock: first send to the receiver's b"done"
    sender_cpu_us: float  # CPU per message of each process (its ZeroMQ I/O thread included)
    receiver_cpu_us: float

    @property
    def capacity_per_s(self) -> float:
        """Messages/s the pipe sustains when each end has a core to itself: the busier end bounds it."""
        return 1e6 / max(self.sender_cpu_us, self.receiver_cpu_us)


def send_round(socket: zmq.Socket, payloads: list, protocol: bool) -> Round:
    """One round: hello, every payload pipelined (no per-message ack), then wait for b"done <receiver CPU s>"."""
    socket.send(b"hello %d %s" % (len(payloads), b"protocol" if protocol else b"raw"))
    started, cpu_started = time.perf_counter(), time.process_time()
    if protocol:
        for record in payloads:
            send(socket, record)  # encode + send: what a rollout worker does per stage
    else:
        for payload in payloads:
            socket.send(payload)
    done, receiver_cpu_s = socket.recv().split()
    if done != b"done":
        raise RuntimeError(f"the receiver answered {done!r}, not b'done'")
    n = len(payloads)
    return Round(n / (time.perf_counter() - started), 1e6 * (time.process_time() - cpu_started) / n,
                 1e6 * float(receiver_cpu_s) / n)


def open_sender(context: zmq.Context, endpoint: str) -> zmq.Socket:
    socket = connect_dealer(context, endpoint, "sender", insecure=True)
    socket.setsockopt(zmq.LINGER, 1000)  # the final b"stop" must reach the receiver
    return socket
