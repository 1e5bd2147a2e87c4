"""The agent loop of one group: G trajectories of one task, turn by turn, each stage streamed as it completes.

Every turn the engine samples one action for each still-running trajectory (one batched call), the
environments step concurrently in a thread pool (their tool latency overlaps), and each stage is sent as a
`StageRecord` the moment its step returns, long before the trajectory ends. A finished trajectory's outcome
(a slow judge) is computed in the background; the next group starts without waiting for it.

A trajectory's token sequence is exactly the concatenation, over its stages, of observation tokens then action
tokens, so the learner can rebuild it from the records alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from async_rl.config import Config
from async_rl.protocol import LOGPROB, TOKEN, LeaseGrant, Outcome, StageRecord, pack
from rollout.engines import EngineUnavailable, Generation, InferenceEngine, SamplingParams
from rollout.envs.trap import TrapEnv

log = logging.getLogger("async_rl.rollout")

WAIT_SLICE_S = 0.05  # how often the loop looks up from waiting on environments to service its sockets


def _judge_in_background(env: TrapEnv) -> Future[float]:
    """`env.outcome()` on its own daemon thread: outcomes of several groups may be pending at once, and a slow
    judge must hold up neither the next group nor the process's exit (a pool's threads are joined at exit)."""
    future: Future[float] = Future()

    def judge() -> None:
        try:
            future.set_result(env.outcome())
        except Exception as exc:
            future.set_exception(exc)

    threading.Thread(target=judge, name="env-outcome", daemon=True).start()
    return future


@dataclass
class Trajectory:
    group_id: str
    task_id: int
    member: int
    env: TrapEnv
    observation_tokens: list[int]  # the observation the next action answers
    context: list[int] = field(default_factory=list)  # every token so far: what the policy conditions on
    stages_sent: int = 0
    done: bool = False

    @property
    def trajectory_id(self) -> str:
        return f"{self.group_id}/{self.member}"


class Agent:
    """Runs groups for one worker. `send` delivers a record reliably; `service` keeps the sockets alive."""

    def __init__(
        self,
        config: Config,
        worker_id: str,
        engine: InferenceEngine,
        tokenizer: PreTrainedTokenizerBase,
        send: Callable[[StageRecord | Outcome], None],
        next_msg_id: Callable[[], int],
    ) -> None:
        self.config = config
        self.worker_id = worker_id
        self.engine = engine
        self.tokenizer = tokenizer
        self.send = send
        self.next_msg_id = next_msg_id
        rollout = config.rollout
        self.params = SamplingParams(
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            max_new_tokens=rollout.max_new_tokens,
            stop_token_ids=[tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [],
        )
        self.step_pool = ThreadPoolExecutor(max_workers=rollout.group_size, thread_name_prefix="env-step")
        self.pending_outcomes: dict[Future[float], Trajectory] = {}
        self.running_group: str | None = None

    def live_group_ids(self) -> list[str]:
        """Groups this worker still owes records to (for heartbeats)."""
        groups = {t.group_id for t in self.pending_outcomes.values()}
        if self.running_group is not None:
            groups.add(self.running_group)
        return sorted(groups)

    def run_group(self, grant: LeaseGrant, service: Callable[[], None], stop: threading.Event) -> None:
        """Play the granted group to the end of its last stage (outcomes may still be pending after)."""
        self.running_group = grant.group_id
        trajectories = [self._start(grant, member) for member in range(grant.group_size)]
        try:
            while not stop.is_set():
                for trajectory in trajectories:
                    if not trajectory.done and self._context_full(trajectory):
                        self._abandon(trajectory, "context_length")
                running = [t for t in trajectories if not t.done]
                if not running:
                    return
                try:
                    generations = self.engine.generate([t.context for t in running], self.params)
                except EngineUnavailable as exc:  # no stage of this turn was sent: each trajectory ends here
                    for trajectory in running:
                        self._abandon(trajectory, f"engine_unavailable: {exc}")
                    raise
                self._step_all(running, generations, service, stop)
                service()
        finally:
            self.running_group = None

    def poll_outcomes(self) -> None:
        """Send the outcomes whose judge has answered."""
        for future in [f for f in self.pending_outcomes if f.done()]:
            trajectory = self.pending_outcomes.pop(future)
            try:
                outcome = future.result()
            except Exception:
                log.exception("outcome of trajectory %s failed; reporting it abandoned", trajectory.trajectory_id)
                self._abandon(trajectory, "outcome_error")
                continue
            self.send(self._outcome(trajectory, outcome=outcome))

    def close(self) -> None:
        """Stop without waiting for slow environments or judges (their leases time out at the replay service)."""
        self.step_pool.shutdown(wait=False, cancel_futures=True)

    def _start(self, grant: LeaseGrant, member: int) -> Trajectory:
        env = TrapEnv(self.config.env)
        observation = self.tokenizer(env.reset(grant.task_id))["input_ids"]  # special tokens (BOS) only here
        return Trajectory(grant.group_id, grant.task_id, member, env, observation, context=list(observation))

    def _context_full(self, trajectory: Trajectory) -> bool:
        return len(trajectory.context) + self.params.max_new_tokens > self.config.model.max_seq_len

    def _step_all(
        self,
        running: list[Trajectory],
        generations: list[Generation],
        service: Callable[[], None],
        stop: threading.Event,
    ) -> None:
        """Step every running environment concurrently; stream each stage as soon as its step returns."""
        steps: dict[Future[tuple[str, float, bool]], tuple[Trajectory, Generation]] = {}
        for trajectory, generation in zip(running, generations, strict=True):
            action = self.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
            steps[self.step_pool.submit(trajectory.env.step, action)] = (trajectory, generation)
        while steps and not stop.is_set():
            finished, _ = wait(steps, timeout=WAIT_SLICE_S, return_when=FIRST_COMPLETED)
            for future in finished:
                trajectory, generation = steps.pop(future)
                observation, stage_reward, done = future.result()
                self._record_stage(trajectory, generation, stage_reward, done)
                if done:
                    trajectory.done = True
                    self.pending_outcomes[_judge_in_background(trajectory.env)] = trajectory
                else:
                    observation_tokens = self.tokenizer(observation, add_special_tokens=False)["input_ids"]
                    trajectory.context += generation.token_ids + observation_tokens
                    trajectory.observation_tokens = observation_tokens
            service()

    def _record_stage(self, trajectory: Trajectory, generation: Generation, stage_reward: float, done: bool) -> None:
        self.send(
            StageRecord(
                msg_id=self.next_msg_id(),
                worker_id=self.worker_id,
                group_id=trajectory.group_id,
                trajectory_id=trajectory.trajectory_id,
                member=trajectory.member,
                task_id=trajectory.task_id,
                stage_index=trajectory.stages_sent,
                observation_tokens=pack(trajectory.observation_tokens, TOKEN),
                action_tokens=pack(generation.token_ids, TOKEN),
                behaviour_logprobs=pack(generation.logprobs, LOGPROB),
                policy_versions=pack(generation.versions, TOKEN),
                stage_reward=stage_reward,
                terminal=done,
            )
        )
        trajectory.stages_sent += 1

    def _abandon(self, trajectory: Trajectory, reason: str) -> None:
        log.warning("trajectory %s abandoned: %s", trajectory.trajectory_id, reason)
        trajectory.done = True
        self.send(self._outcome(trajectory, outcome=None, abandoned=True, reason=reason))

    def _outcome(
        self, trajectory: Trajectory, outcome: float | None, abandoned: bool = False, reason: str = ""
    ) -> Outcome:
        return Outcome(
            msg_id=self.next_msg_id(),
            worker_id=self.worker_id,
            group_id=trajectory.group_id,
            trajectory_id=trajectory.trajectory_id,
            member=trajectory.member,
            num_stages=trajectory.stages_sent,
            outcome=outcome,
            abandoned=abandoned,
            reason=reason,
        )
