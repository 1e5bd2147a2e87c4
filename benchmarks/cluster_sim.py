"""Cluster-scale discrete-event simulation: the real ReplayService driven by simulated engines, tools, judges and a
simulated learner, asynchronous (the system as built) against lock-step, at sizes this machine cannot run.

Simulated time only: a heap of (time, seq, event). The replay service is the real `replay.service.ReplayService`
built from `configs/cluster.yaml` plus overrides, fed real protocol messages through `handle(identity, message, now)`
and `tick(now)`; its replies (LeaseGrant / LeaseDenied / Batch) drive the simulated workers and learner.

  engines   N rollout engines (one worker each), each keeping up to K trajectories going (judging ones excluded,
            as rollout/runner.py does). Continuous batching: one decode step of the engine's current batch takes
            a + b·batch seconds; every decoding trajectory gains one token per step. Prefill of a turn's new
            observation is a delay of tokens / prefill rate that does not load the engine.
  turns     per trajectory T ~ lognormal; per turn an action (lognormal tokens), a tool call (lognormal seconds),
            then its StageRecord goes out with the observation before the action and the action's tokens; after
            the last turn a judge (lognormal seconds) and the Outcome.
  learner   M ranks; one step over a batch takes overhead + the busiest rank's computed tokens / tokens/s per GPU,
            planned by the learner's own code (learner/pack.py: length-balanced shards, sequences packed into rows,
            rows into micro-batches; computed = rows × longest row, summed over micro-batches). The replay fills a
            batch as learner.batch_budget says (packed in configs/cluster.yaml). After each acked step (every
            learner.publish_every) the weights are published; every engine pauses decoding for the weight-sync time
            and then generates with the new version (tokens carry the version that decoded them, segment by
            segment).
  async     admission by algo.max_staleness / algo.groups_per_step exactly as built; the learner asks for
            learner.batch_tokens / min_batch_items / batch_wait_s batches back to back.
  lock-step a round of R = N·K/G groups is leased at once when the engines hold version v; the round is generated
            to the end and judged; then the learner drains the round's items (its corrections: every group
            finalized, so the replay withdrew its queued immediates) as micro-batches of one optimizer step
            (gradient accumulation: the micro-batches are acked at v, the last at v+1), publishes, the engines
            sync, the next round starts. algo.groups_per_step = R, so admission never binds.

Token arrays on the wire are short: one wire token stands for `token_scale` simulated tokens (every simulated count
is a multiple of it), so the replay's token budget and the learner's step time see the simulated sizes.

    python benchmarks/cluster_sim.py            # 64 engines x 64, 8 learner GPUs, ~30 turns, 60 s judges
    python benchmarks/cluster_sim.py --quick    # small sizes, a few seconds
    # admission matched to the learner (docs/research/log.md, "cluster_sim"):
    python benchmarks/cluster_sim.py --hours 3 --only async,async-unguarded --set algo.groups_per_step=3 \
        --variant-mcs -1 --unguarded --out cluster_sim-gps3

Modes: lockstep and async at --max-correction-staleness (256), async-mcsN at --variant-mcs (16, the config's), and
async-unguarded (async with algo.correction_guard=false; in the full form, not --quick). Each mode reports the
replay's guard counters (held seconds, holds, leases refused, trajectories abandoned) and its size estimate.

The last stdout line is JSON: {"throughput_ratio", "learner_tokens_ratio", "modes": {...}, "assumptions": {...}}.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import heapq  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import asdict, dataclass, field, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from async_rl.config import Config  # noqa: E402
from async_rl.config_load import load_config  # noqa: E402
from async_rl.protocol import (  # noqa: E402
    LOGPROB,
    TOKEN,
    Batch,
    BatchAck,
    BatchRequest,
    Heartbeat,
    LeaseDenied,
    LeaseGrant,
    LeaseRequest,
    Message,
    Outcome,
    StageRecord,
    pack,
)
from learner.pack import plan_shards  # noqa: E402
from replay.leases import STALENESS_RETRY_S  # noqa: E402
from replay.server import build_service  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CLUSTER_CONFIG = REPO / "configs" / "cluster.yaml"
LEARNER = b"learner-0"


@dataclass(frozen=True)
class Workload:
    """Every assumed size and latency. Lognormals are given by their median and sigma (of the log)."""

    engines: int = 64  # rollout GPUs, one engine (and one worker) each
    concurrent: int = 64  # K: trajectories one engine keeps going (rollout.max_inflight)
    group_size: int = 8  # G
    learner_gpus: int = 8  # M
    turns_median: float = 30.0
    turns_sigma: float = 0.4
    turns_max: int = 100
    action_tokens_median: float = 200.0
    action_tokens_sigma: float = 0.8
    action_tokens_max: int = 2048  # rollout.max_new_tokens
    obs_tokens_median: float = 300.0  # a tool's output
    obs_tokens_sigma: float = 1.0
    obs_tokens_max: int = 4096
    prompt_tokens: int = 1024  # stage 0's observation
    decode_a_s: float = 0.010  # one decode step of the engine's batch: a + b·batch seconds
    decode_b_s: float = 0.0003
    prefill_tokens_per_s: float = 20_000.0
    tool_median_s: float = 2.0
    tool_sigma: float = 1.0
    judge_median_s: float = 60.0
    judge_sigma: float = 0.7
    learner_tokens_per_s_per_gpu: float = 8_000.0  # computed tokens (padding included), fwd + bwd + optimizer
    learner_step_overhead_s: float = 2.0  # per optimizer step (ZeRO gathers, optimizer, publish)
    weight_sync_s: float = 3.0  # every engine stops decoding this long per published version
    batch_tokens: int = 1_048_576  # learner.batch_tokens (counted as learner.batch_budget says), simulated tokens
    min_batch_items: int = 64
    batch_wait_s: float = 2.0
    heartbeat_s: float = 30.0  # workers' Heartbeat period (below replay.lease_timeout_s; the real default is 2 s)
    tick_s: float = 1.0  # ReplayService.tick period (stage-group timeouts are seen within this)
    token_scale: int = 64  # simulated tokens per wire token
    duration_s: float = 4 * 3600.0  # simulated time
    reward_p: float = 0.5  # stage rewards and outcomes are Bernoulli(p): only their variance matters here

    def decode_step_s(self, batch: int) -> float:
        return self.decode_a_s + self.decode_b_s * batch

    @property
    def round_groups(self) -> int:
        return self.engines * self.concurrent // self.group_size


QUICK = Workload(
    engines=4, concurrent=16, group_size=4, learner_gpus=1, turns_median=6.0, turns_max=20,
    action_tokens_median=100.0, obs_tokens_median=100.0, prompt_tokens=256, tool_median_s=3.0, judge_median_s=30.0,
    learner_tokens_per_s_per_gpu=8_000.0, learner_step_overhead_s=1.0, weight_sync_s=1.0, batch_tokens=65_536,
    min_batch_items=16, heartbeat_s=30.0, token_scale=32, duration_s=3600.0,
)

ASSUMPTION_SOURCES = {
    "decode": "7B model in bf16 on one H100, continuous batching: ~10 ms per decode step at batch 1 (14 GB of "
              "weights read per step), + 0.3 ms per sequence (KV reads, sampling): batch 64 -> 29 ms/step, "
              "34 tokens/s per sequence, ~2,200 tokens/s per engine (inside the 30-60 tokens/s per sequence "
              "usually reported at batch 64). Assumed, not measured.",
    "learner": "7B full-parameter training, ~6·7e9 FLOP per token: 8,000 tokens/s per H100 is ~34% of its dense "
               "bf16 peak. Assumed, not measured.",
    "weight_sync": "14 GB broadcast to the engines + the engine's weight update: 3 s. Assumed.",
    "tool_judge": "tool calls lognormal (median 2 s, sigma 1: p99 ~20 s); judges lognormal (median 60 s, sigma 0.7: "
                  "p99 ~5 min). Assumed.",
}


# --- trajectories and engines ------------------------------------------------------------------------


@dataclass(slots=True)
class Traj:
    worker: int
    group_id: str
    member: int
    task_id: str
    round: int
    turns: int
    k: int = 0  # the turn being generated
    obs_tokens: int = 0  # simulated tokens of stage k's observation
    act_tokens: int = 0
    segments: list[tuple[float, int]] = field(default_factory=list)  # (engine step counter, version) while decoding
    start_step: float = 0.0
    versions: bytes = b""


class Engine:
    """Continuous batching on a step counter S: dS/dt = 1 / (a + b·batch) while not paused."""

    def __init__(self, index: int, workload: Workload) -> None:
        self.index, self.w = index, workload
        self.steps = 0.0
        self.last = 0.0
        self.decoding: dict[int, Traj] = {}
        self.finish: list[tuple[float, int]] = []  # (finish step, traj key)
        self.paused_until = 0.0
        self.paused = False
        self.version = 0
        self.loading = 0
        self.epoch = 0
        self.sync_epoch = 0
        self.busy_s = self.paused_s = self.batch_integral = 0.0

    def advance(self, now: float) -> None:
        dt = now - self.last
        if dt > 0:
            if self.paused:
                self.paused_s += dt
            elif self.decoding:
                n = len(self.decoding)
                self.steps += dt / self.w.decode_step_s(n)
                self.busy_s += dt
                self.batch_integral += n * dt
        self.last = now


# --- the simulation -----------------------------------------------------------------------------------


@dataclass
class Totals:
    trajectories: int = 0
    stage_records: int = 0
    generated_tokens: int = 0
    steps: int = 0  # optimizer steps (versions)
    batches: int = 0
    items: int = 0
    items_immediate: int = 0
    trained_tokens: int = 0  # simulated, unpadded
    padded_tokens: int = 0
    learner_busy_s: float = 0.0
    lease_waits: int = 0
    lease_wait_s: float = 0.0
    lease_polls_equivalent: int = 0  # denials a worker polling every STALENESS_RETRY_S would have received
    residual_max: float = 0.0
    staleness: Counter = field(default_factory=Counter)  # staleness -> trained simulated action tokens
    staleness_immediate: Counter = field(default_factory=Counter)
    rounds: int = 0


class Simulation:
    def __init__(self, workload: Workload, mode: str, seed: int, max_correction_staleness: int,
                 extra: tuple[str, ...] = ()) -> None:
        assert mode in ("async", "lockstep")
        self.w, self.mode = workload, mode
        w = workload
        overrides = [
            f"rollout.group_size={w.group_size}", f"rollout.max_inflight={w.concurrent}",
            f"learner.batch_tokens={w.batch_tokens}", f"learner.min_batch_items={w.min_batch_items}",
            f"learner.batch_wait_s={w.batch_wait_s}", f"algo.max_correction_staleness={max_correction_staleness}",
            "run.max_env_steps=null", f"run.seed={seed}",
            # The simulated engines have no context limit (see the doc); the replay's too_long check must not cut
            # the wire trajectories (one wire token per 64 simulated ones) short either.
            "model.max_seq_len=1000000",
            *extra,
        ]
        if mode == "lockstep":
            overrides.append(f"algo.groups_per_step={w.round_groups}")
        self.overrides = overrides
        self.config: Config = load_config(CLUSTER_CONFIG, overrides)
        self.service = build_service(self.config)
        self.rng = np.random.default_rng(seed)
        self.heap: list[tuple[float, int, str, Any]] = []
        self.seq = itertools.count()
        self.msg_ids = itertools.count()
        self.traj_ids = itertools.count()
        self.engines = [Engine(i, w) for i in range(w.engines)]
        self.acting = [0] * w.engines  # trajectories taking a place in K (every phase but judge)
        self.waiting: dict[int, float] = {}  # worker -> when its lease was first denied (still waiting)
        self.wake_scheduled: set[int] = set()  # waiting workers with a retry already on the heap
        self.trajs: dict[int, Traj] = {}
        self.totals = Totals()
        self.admission_state = (0, 0)
        self.learner_version = 0
        self.learner_waiting_since: float | None = None
        self.round = 0
        self.round_outstanding = 0
        self.tasks = itertools.count()
        self.now = 0.0
        self.scale = w.token_scale
        self._blob: dict[tuple[str, int], bytes] = {}
        self.normals: list[float] = []
        self.uniforms: list[float] = []
        self.round_ends: list[float] = []

    # --- plumbing ---

    def push(self, t: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, payload))

    def lognormal(self, median: float, sigma: float) -> float:
        if not self.normals:
            self.normals = self.rng.standard_normal(4096).tolist()[::-1]  # drawn in blocks: same stream, faster
        return median * math.exp(sigma * self.normals.pop())

    def uniform(self) -> float:
        if not self.uniforms:
            self.uniforms = self.rng.random(4096).tolist()[::-1]
        return self.uniforms.pop()

    def tokens(self, median: float, sigma: float, cap: int) -> int:
        """A simulated token count: lognormal, capped, rounded to a multiple of the wire scale (at least one)."""
        n = min(self.lognormal(median, sigma), cap)
        return max(1, round(n / self.scale)) * self.scale

    def blob(self, dtype_name: str, n: int) -> bytes:
        key = (dtype_name, n)
        if key not in self._blob:
            value = {"tok": (7, TOKEN), "lp": (-1.0, LOGPROB)}[dtype_name]
            self._blob[key] = pack(np.full(n, value[0]), value[1])
        return self._blob[key]

    def send(self, identity: bytes, message: Message) -> None:
        for peer, reply in self.service.handle(identity, message, self.now):
            self.deliver(peer, reply)
        self.after_state_change()

    def tick(self) -> None:
        for peer, reply in self.service.tick(self.now):
            self.deliver(peer, reply)
        self.after_state_change()

    def deliver(self, peer: bytes, reply: Message) -> None:
        if peer == LEARNER and isinstance(reply, Batch):
            self.on_batch(reply)
        # workers' lease replies are read synchronously in request_lease; Acks need no action

    def after_state_change(self) -> None:
        """Admission can reopen only when the learner's version or groups_empty changes: wake the denied workers
        at the moment their poll (every STALENESS_RETRY_S since the denial) would have found it open."""
        counters = self.service.counters
        state = (self.service.policy_version, counters.groups_empty)
        if state == self.admission_state:
            return
        self.admission_state = state
        for worker, since in self.waiting.items():
            if worker in self.wake_scheduled:
                continue
            polls = max(1, math.ceil((self.now - since) / STALENESS_RETRY_S - 1e-9))
            self.push(since + polls * STALENESS_RETRY_S, "lease", worker)
            self.wake_scheduled.add(worker)

    # --- workers ---

    def request_lease(self, worker: int) -> None:
        w = self.w
        self.wake_scheduled.discard(worker)
        while self.acting[worker] + w.group_size <= w.concurrent:
            wid = f"w{worker}"
            (_, reply), *_ = self.service.handle(wid.encode(), LeaseRequest(worker_id=wid, msg_id=next(self.msg_ids)),
                                                 self.now)
            if isinstance(reply, LeaseDenied):
                if worker not in self.waiting:
                    self.waiting[worker] = self.now
                    self.totals.lease_waits += 1
                return
            assert isinstance(reply, LeaseGrant)
            since = self.waiting.pop(worker, None)
            if since is not None:
                self.totals.lease_wait_s += self.now - since
                self.totals.lease_polls_equivalent += max(1, math.ceil((self.now - since) / STALENESS_RETRY_S))
            self.start_group(worker, reply)
        self.after_state_change()

    def start_group(self, worker: int, grant: LeaseGrant) -> None:
        w = self.w
        task = f"task{next(self.tasks)}"
        for member in range(grant.group_size):
            turns = min(w.turns_max, max(1, round(self.lognormal(w.turns_median, w.turns_sigma))))
            key = next(self.traj_ids)
            traj = Traj(worker, grant.group_id, member, task, self.round, turns, obs_tokens=w.prompt_tokens)
            self.trajs[key] = traj
            self.acting[worker] += 1
            self.push(self.now + traj.obs_tokens / w.prefill_tokens_per_s, "decode", key)
        if self.mode == "lockstep":
            self.round_outstanding += grant.group_size

    def start_decode(self, key: int) -> None:
        traj = self.trajs[key]
        engine = self.engines[traj.worker]
        engine.advance(self.now)
        w = self.w
        traj.act_tokens = self.tokens(w.action_tokens_median, w.action_tokens_sigma, w.action_tokens_max)
        traj.start_step = engine.steps
        traj.segments = [(engine.steps, engine.version)]
        engine.decoding[key] = traj
        heapq.heappush(engine.finish, (engine.steps + traj.act_tokens, key))
        self.reschedule(engine)

    def reschedule(self, engine: Engine) -> None:
        engine.epoch += 1
        if engine.paused or not engine.finish:
            return
        steps_left = max(0.0, engine.finish[0][0] - engine.steps)
        self.push(self.now + steps_left * self.w.decode_step_s(len(engine.decoding)), "engine",
                  (engine.index, engine.epoch))

    def on_engine(self, index: int, epoch: int) -> None:
        engine = self.engines[index]
        if epoch != engine.epoch:
            return
        engine.advance(self.now)
        while engine.finish and engine.finish[0][0] <= engine.steps + 1e-6:
            _, key = heapq.heappop(engine.finish)
            traj = engine.decoding.pop(key)
            traj.versions = self.action_versions(traj)
            self.totals.generated_tokens += traj.act_tokens
            self.push(self.now + self.lognormal(self.w.tool_median_s, self.w.tool_sigma), "tool", key)
        self.reschedule(engine)

    def action_versions(self, traj: Traj) -> bytes:
        """One version per wire token: the version that decoded the first simulated token it stands for."""
        n = traj.act_tokens // self.scale
        if len(traj.segments) == 1:
            key = (f"v{traj.segments[0][1]}", n)
            if key not in self._blob:
                self._blob[key] = pack(np.full(n, traj.segments[0][1]), TOKEN)
            return self._blob[key]
        starts = traj.start_step + np.arange(n) * self.scale
        bounds = np.array([s for s, _ in traj.segments[1:]])
        versions = np.array([v for _, v in traj.segments])
        return pack(versions[np.searchsorted(bounds, starts, side="right")], TOKEN)

    def on_tool(self, key: int) -> None:
        traj, w = self.trajs[key], self.w
        terminal = traj.k == traj.turns - 1
        wid = f"w{traj.worker}"
        n_obs, n_act = traj.obs_tokens // self.scale, traj.act_tokens // self.scale
        reward = float(self.uniform() < w.reward_p)
        self.send(wid.encode(), StageRecord(
            msg_id=next(self.msg_ids), worker_id=wid, group_id=traj.group_id,
            trajectory_id=f"{traj.group_id}/{traj.member}", member=traj.member, task_id=traj.task_id,
            stage_index=traj.k, observation_tokens=self.blob("tok", n_obs), action_tokens=self.blob("tok", n_act),
            behaviour_logprobs=self.blob("lp", n_act), policy_versions=traj.versions, stage_reward=reward,
            terminal=terminal,
        ))
        self.totals.stage_records += 1
        if terminal:
            self.acting[traj.worker] -= 1
            self.push(self.now + self.lognormal(w.judge_median_s, w.judge_sigma), "judge", key)
            if self.mode == "async":
                self.request_lease(traj.worker)
            return
        traj.k += 1
        traj.obs_tokens = self.tokens(w.obs_tokens_median, w.obs_tokens_sigma, w.obs_tokens_max)
        self.push(self.now + traj.obs_tokens / w.prefill_tokens_per_s, "decode", key)

    def on_judge(self, key: int) -> None:
        traj = self.trajs.pop(key)
        wid = f"w{traj.worker}"
        outcome = float(self.uniform() < self.w.reward_p)
        self.send(wid.encode(), Outcome(
            msg_id=next(self.msg_ids), worker_id=wid, group_id=traj.group_id,
            trajectory_id=f"{traj.group_id}/{traj.member}", member=traj.member, num_stages=traj.turns,
            outcome=outcome, success=outcome >= 1.0,
        ))
        self.totals.trajectories += 1
        if self.mode == "lockstep":
            self.round_outstanding -= 1
            if self.round_outstanding == 0:
                self.learner_request()

    # --- learner ---

    def learner_request(self) -> None:
        w = self.w
        lockstep = self.mode == "lockstep"
        if lockstep and not len(self.service.queue):
            self.publish_and_next_round(bumped=False)  # nothing to train in this round (every group was empty)
            return
        self.learner_waiting_since = self.now
        self.send(LEARNER, BatchRequest(
            learner_id="learner-0", msg_id=next(self.msg_ids), policy_version=self.learner_version,
            max_tokens=max(1, w.batch_tokens // self.scale), min_items=1 if lockstep else w.min_batch_items,
            max_wait_s=0.0 if lockstep else w.batch_wait_s,
        ))
        if not lockstep:
            self.push(self.now + w.batch_wait_s, "tick")

    def on_batch(self, batch: Batch) -> None:
        w, t = self.w, self.totals
        self.learner_waiting_since = None
        v = self.learner_version
        lengths = [item.num_tokens() * self.scale for item in batch.items]
        t.trained_tokens += sum(lengths)
        for item in batch.items:
            mask = item.mask().astype(bool)
            stale = v - item.versions()[mask]
            counts = Counter(stale.tolist())
            for s, c in counts.items():
                t.staleness[s] += c * self.scale
                if item.kind == "immediate":
                    t.staleness_immediate[s] += c * self.scale
            t.items_immediate += item.kind == "immediate"
        t.items += len(batch.items)
        t.batches += 1
        t.residual_max = max(t.residual_max, batch.stats.ledger_residual_max)
        learner = self.config.learner
        plans = plan_shards(lengths, w.learner_gpus, learner.micro_batch_tokens, learner.packing,
                            learner.pack_row_tokens)
        computed = [sum(rows * width for rows, width in (micro.shape(lengths) for micro in plan)) for plan in plans]
        t.padded_tokens += sum(computed)
        step_s = max(computed) / w.learner_tokens_per_s_per_gpu
        last = self.mode == "async" or not len(self.service.queue)
        if last:
            step_s += w.learner_step_overhead_s
        t.learner_busy_s += step_s
        self.push(self.now + step_s, "ack", (batch.batch_id, last))

    def on_ack(self, batch_id: int, step: bool) -> None:
        if step:
            self.learner_version += 1
            self.totals.steps += 1
        self.send(LEARNER, BatchAck(learner_id="learner-0", msg_id=next(self.msg_ids), batch_id=batch_id,
                                    policy_version=self.learner_version))
        if self.mode == "async":
            if step and self.learner_version % self.config.learner.publish_every == 0:
                self.publish()
            self.learner_request()
        elif step:
            self.publish_and_next_round(bumped=True)
        else:
            self.learner_request()

    def publish(self) -> None:
        for engine in self.engines:
            engine.advance(self.now)
            engine.paused = True
            engine.paused_until = max(engine.paused_until, self.now + self.w.weight_sync_s)
            engine.loading = self.learner_version
            engine.sync_epoch += 1
            engine.epoch += 1  # no decode completes while paused
            self.push(engine.paused_until, "synced", (engine.index, engine.sync_epoch))

    def on_synced(self, index: int, sync_epoch: int) -> None:
        engine = self.engines[index]
        if sync_epoch != engine.sync_epoch:
            return
        engine.advance(self.now)
        engine.paused = False
        engine.version = engine.loading
        for traj in engine.decoding.values():
            traj.segments.append((engine.steps, engine.version))
        self.reschedule(engine)

    def publish_and_next_round(self, bumped: bool) -> None:
        self.totals.rounds += 1
        self.round += 1
        self.round_ends.append(self.now)
        if bumped:
            self.publish()
        self.push(self.now + (self.w.weight_sync_s if bumped else 0.0), "round")

    def start_round(self) -> None:
        for worker in range(self.w.engines):
            self.request_lease(worker)

    # --- the loop ---

    def run(self) -> dict[str, Any]:
        w = self.w
        started = time.perf_counter()
        if self.mode == "async":
            for worker in range(w.engines):
                self.request_lease(worker)
            self.learner_request()
        else:
            self.start_round()
        self.push(w.tick_s, "tick_periodic")
        for worker in range(w.engines):
            self.push(w.heartbeat_s, "heartbeat", worker)
        handlers = {
            "decode": self.start_decode, "tool": self.on_tool, "judge": self.on_judge,
            "lease": self.request_lease,
        }
        while self.heap and self.heap[0][0] <= w.duration_s:
            self.now, _, kind, payload = heapq.heappop(self.heap)
            if kind in handlers:
                handlers[kind](payload)
            elif kind == "engine":
                self.on_engine(*payload)
            elif kind == "ack":
                self.on_ack(*payload)
            elif kind == "synced":
                self.on_synced(*payload)
            elif kind == "round":
                self.start_round()
            elif kind == "tick":
                self.tick()
            elif kind == "tick_periodic":
                self.tick()
                self.push(self.now + w.tick_s, "tick_periodic")
            elif kind == "heartbeat":
                wid = f"w{payload}"
                self.send(wid.encode(), Heartbeat(worker_id=wid))
                self.push(self.now + w.heartbeat_s, "heartbeat", payload)
        self.now = w.duration_s
        for engine in self.engines:
            engine.advance(self.now)
        for since in self.waiting.values():  # waits still open at the end count up to the end
            self.totals.lease_wait_s += self.now - since
        return self.report(time.perf_counter() - started)

    def report(self, wall_s: float) -> dict[str, Any]:
        w, t, d = self.w, self.totals, self.w.duration_s
        stats = self.service.stats_snapshot()
        # The busy time of a step still running at the end counts only up to the end.
        pending = [(time_, p) for time_, _, kind, p in self.heap if kind == "ack"]
        overrun = sum(time_ - d for time_, _ in pending if time_ > d)
        learner_busy = t.learner_busy_s - overrun
        engine_busy = sum(e.busy_s for e in self.engines) / (d * len(self.engines))
        engine_paused = sum(e.paused_s for e in self.engines) / (d * len(self.engines))
        mean_batch = sum(e.batch_integral for e in self.engines) / max(sum(e.busy_s for e in self.engines), 1e-9)
        # Lock-step in whole rounds: the round's trajectories ÷ the time its training ended (no partial round).
        per_round = t.rounds * w.round_groups * w.group_size / self.round_ends[-1] if self.round_ends else None
        return {
            "mode": self.mode,
            "trajectories_per_s": t.trajectories / d,
            "trajectories_per_s_whole_rounds": per_round if self.mode == "lockstep" else None,
            "round_end_s": [round(x, 1) for x in self.round_ends],
            "trajectories_per_hour": t.trajectories / d * 3600,
            # corrections trained: trajectories whose final credit reached the learner (one correction per member)
            "corrections_trained_per_hour": (t.items - t.items_immediate) / d * 3600,
            "learner_tokens_per_s": t.trained_tokens / d,
            "learner_padded_tokens_per_s": t.padded_tokens / d,
            "generated_tokens_per_s": t.generated_tokens / d,
            "learner_idle": 1 - learner_busy / d,
            "engine_idle": 1 - engine_busy - engine_paused,
            "engine_paused": engine_paused,
            "engine_mean_decode_batch": mean_batch,
            "staleness": percentiles(t.staleness),
            "staleness_immediate": percentiles(t.staleness_immediate),
            "versions": t.steps,
            "batches": t.batches,
            "items": t.items,
            "items_immediate": t.items_immediate,
            "trajectories": t.trajectories,
            "stage_records": t.stage_records,
            "lease_waits": t.lease_waits,
            "lease_wait_worker_s": t.lease_wait_s,
            "lease_wait_fraction": t.lease_wait_s / (d * w.engines),
            "lease_polls_equivalent": t.lease_polls_equivalent,
            "leases_denied_replay": stats.leases_denied,
            "groups_started": stats.groups_started,
            "groups_closed": stats.groups_closed,
            "groups_empty": stats.groups_empty,
            "credit_dropped": stats.credit_dropped,
            "immediate_skipped_stale": stats.immediate_skipped_stale,
            "immediate_superseded": stats.immediate_superseded,
            "trajectories_abandoned": stats.trajectories_abandoned,
            "guard_holds": stats.guard_holds,
            "guard_held_s": stats.guard_held_s,
            "guard_leases_denied": stats.guard_leases_denied,
            "guard_abandoned": stats.guard_abandoned,
            # the guard's size estimate for a trajectory still being generated, in simulated tokens
            "longest_trajectory_tokens": self.service.longest_trajectory * w.token_scale,
            "bad_messages": stats.bad_messages,
            "ledger_residual_max": t.residual_max,
            "rounds": t.rounds,
            "max_correction_staleness": self.config.algo.max_correction_staleness,
            "simulated_hours": d / 3600,
            "wall_s": wall_s,
            "overrides": self.overrides,
        }


def percentiles(counter: Counter) -> dict[str, float | int | None]:
    """Token-weighted percentiles of a staleness histogram."""
    total = sum(counter.values())
    if not total:
        return {"p50": None, "p90": None, "p99": None, "max": None, "mean": None, "tokens": 0}
    out: dict[str, float | int | None] = {}
    values = sorted(counter)
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        running = 0
        for value in values:
            running += counter[value]
            if running >= q * total:
                out[name] = int(value)
                break
    out["max"] = int(values[-1])
    out["mean"] = sum(v * c for v, c in counter.items()) / total
    out["tokens"] = int(total)
    return out


def simulate(workload: Workload, mode: str, seed: int, max_correction_staleness: int,
             extra: tuple[str, ...] = ()) -> dict[str, Any]:
    return Simulation(workload, mode, seed, max_correction_staleness, extra).run()


# --- the benchmark --------------------------------------------------------------------------------------


def run_all(workload: Workload, seed: int, mcs: int, variant_mcs: int | None, unguarded: bool = False,
            extra: tuple[str, ...] = (), only: set[str] | None = None) -> dict[str, Any]:
    """Every mode's figures; `extra` overrides go to every async run (e.g. algo.groups_per_step=3), `only` keeps
    the named modes (lockstep, async, async-mcsN, async-unguarded)."""
    plan = {"lockstep": ("lockstep", mcs, ()), "async": ("async", mcs, extra)}
    if variant_mcs is not None:
        plan[f"async-mcs{variant_mcs}"] = ("async", variant_mcs, extra)
    if unguarded:  # what the correction guard costs and buys: the same async run without it
        plan["async-unguarded"] = ("async", mcs, (*extra, "algo.correction_guard=false"))
    modes = {name: simulate(workload, mode, seed, bound, more)
             for name, (mode, bound, more) in plan.items() if only is None or name in only}
    lock, fast = modes.get("lockstep"), modes.get("async")
    both = lock is not None and fast is not None
    return {
        "throughput_ratio": _ratio(fast["trajectories_per_s"], lock["trajectories_per_s"]) if both else None,
        "learner_tokens_ratio": _ratio(fast["learner_tokens_per_s"], lock["learner_tokens_per_s"]) if both else None,
        "extra": list(extra),
        "modes": modes,
        "assumptions": asdict(workload),
        "assumption_sources": ASSUMPTION_SOURCES,
        "seed": seed,
    }


def _ratio(a: float, b: float) -> float | None:
    return None if not b else a / b


def _f(value: float | int | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def table_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    columns = ["mode", "traj/h", "corrections trained/h", "learner tok/s", "learner idle", "engine idle / paused",
               "decode batch",
               "staleness p50/p90/p99/max (imm. max)", "lease waits (worker-h)", "credit dropped",
               "imm. skipped stale", "versions", "wall s"]
    rows = []
    for name, m in result["modes"].items():
        s, si = m["staleness"], m["staleness_immediate"]
        rows.append([
            name, f"{m['trajectories_per_hour']:,.0f}", f"{m['corrections_trained_per_hour']:,.0f}",
            f"{m['learner_tokens_per_s']:,.0f}", f"{m['learner_idle']:.3f}",
            f"{m['engine_idle']:.3f} / {m['engine_paused']:.3f}", f"{m['engine_mean_decode_batch']:.1f}",
            f"{_f(s['p50'], 'd')}/{_f(s['p90'], 'd')}/{_f(s['p99'], 'd')}/{_f(s['max'], 'd')} ({_f(si['max'], 'd')})",
            f"{m['lease_waits']:,} ({m['lease_wait_worker_s'] / 3600:,.1f})", f"{m['credit_dropped']:,}",
            f"{m['immediate_skipped_stale']:,}", f"{m['versions']:,}", f"{m['wall_s']:.1f}",
        ])
    return columns, rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (4 engines, 1 simulated hour)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hours", type=float, default=None, help="simulated hours (default 4, quick 1)")
    parser.add_argument("--max-correction-staleness", type=int, default=256,
                        help="algo.max_correction_staleness of the compared runs (default 256: nothing dropped)")
    parser.add_argument("--variant-mcs", type=int, default=16,
                        help="also run async with this max_correction_staleness (16: the design's default, "
                             "configs/cluster.yaml's until 2026-11-24); -1: skip")
    parser.add_argument("--unguarded", action=argparse.BooleanOptionalAction, default=None,
                        help="also run async with algo.correction_guard=false (default: on, off with --quick)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every async run (repeatable), e.g. algo.groups_per_step=3")
    parser.add_argument("--only", default=None, help="comma-separated modes to run (default all)")
    parser.add_argument("--out", default=None, help="folder under benchmarks/out (default cluster_sim)")
    args = parser.parse_args()
    logging.getLogger("async_rl.replay").setLevel(logging.ERROR)  # dropped corrections log one warning each
    workload = QUICK if args.quick else Workload()
    if args.hours is not None:
        workload = replace(workload, duration_s=args.hours * 3600)
    variant = None if args.variant_mcs < 0 else args.variant_mcs
    unguarded = not args.quick if args.unguarded is None else args.unguarded
    from common import machine, markdown_table, print_table  # benchmarks/ is not a package

    only = None if args.only is None else set(args.only.split(","))
    result = run_all(workload, args.seed, args.max_correction_staleness, variant, unguarded, tuple(args.set), only)
    result["machine"] = machine()
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    columns, rows = table_rows(result)
    caption = (f"async ÷ lock-step: trajectories/s {_f(result['throughput_ratio'], '.2f')}, learner tokens/s "
               f"{_f(result['learner_tokens_ratio'], '.2f')}; {workload.duration_s / 3600:g} simulated h, "
               f"seed {args.seed}")
    print_table("cluster simulation", columns, rows, caption)
    command = " ".join(["python benchmarks/cluster_sim.py", *sys.argv[1:]])
    out = REPO / "benchmarks" / "out" / (args.out or ("cluster_sim-quick" if args.quick else "cluster_sim"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(markdown_table(columns, rows, command))
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
