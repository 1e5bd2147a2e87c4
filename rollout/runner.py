"""The episode runner: many trajectories in flight, each advancing on its own, for training and evaluation alike.

A runner keeps up to `rollout.max_inflight` trajectories (of several groups) going at once, each an `Episode`
(rollout/episode.py) in one phase:

    reset  →  act  →  step  →  act  → … → judge → done        (or abandoned, from any phase)

`act`: waiting for the engine; `generate`: in an engine call. Every engine call takes whichever trajectories are
waiting and runs on the engine's own thread (rollout/engine_calls.py), so the runner's owner keeps its sockets
answered while a slow model generates. A call starts once 3/4 of the trajectories in flight wait for it, or the
first of them has waited `rollout.engine_batch_wait_s` (a call's fixed cost is shared by more rows: docs/results.md,
"The quick start"). A turn ends at EOS, a stop string (`rollout.stop`) or the action token budget. `step`: the
action's text is with the environment, on a pool of daemon threads, so a slow tool holds up only its own trajectory,
and one past `step_timeout_s` (or a judge past `judge_timeout_s`) abandons it (rollout/plugin_calls.py). A worker
runs them on its loop thread instead while they are instant (a twentieth of `rollout.inline_budget_s` on average);
a kind that is slower goes to the pools for a while, and a call past the budget moves the loop to a new thread
first (rollout/env_calls.py, rollout/inline_calls.py). When the
step returns, the stage (observation tokens, action tokens, behaviour log-probs, versions, stage reward) goes to the
sink at once, long before the trajectory ends. `judge`: the finished trajectory's outcome is computed on its own
thread (a slow judge holds up nothing). What the runner did goes to its metrics line (rollout/runner_stats.py).

A trajectory's token sequence is exactly the concatenation, over its stages, of observation tokens then action
tokens, so the learner can rebuild it from the records alone. Observations are masked out of the loss. A model
whose tokenizer has a chat template gets observations as user turns (the template's own tokens around them).
An env with `tools()` gets an `Action` each turn (its tool calls parsed by rollout/tool_parser.py) and may answer
with `ToolResult`s, rendered as the template's `tool` messages (rollout/prompting.py).
A turn's action budget shrinks to what still fits in `model.max_seq_len`; a trajectory with no room left ends
there and is judged as it stands.

An environment that raises, or breaks its contract (rollout/envs/base.py), abandons that trajectory only:
the sink hears `env_error: ...` naming the env and the method.

A token-level env (`reset_tokens`/`step_tokens`, rollout/envs/base.py: the `agent` env) goes through the same
phases but hands over tokens: its `Prompt`s are the observation tokens as they are (it renders them itself), its
step gets the action's `Generation` (tokens, not text), and a Prompt may cap the next action's tokens.
"""

from __future__ import annotations

import logging
import time

import zmq
from transformers import PreTrainedTokenizerBase

from async_rl.errors import ConfigError
from rollout.engine_calls import EngineCalls
from rollout.engines import EngineStopped, EngineUnavailable, Generation, InferenceEngine, SamplingParams
from rollout.engines.thread import EngineThread
from rollout.env_calls import EnvCalls, Returned
from rollout.envs.base import (
    Action,
    EnvError,
    EnvFactory,
    Prompt,
    StepResult,
    Task,
    checked_judge,
    checked_make,
    checked_reset,
    checked_reset_tokens,
    checked_step,
    checked_step_tokens,
    optional,
    token_level,
    tools_of,
)
from rollout.episode import Episode, Sink
from rollout.inline_calls import InlineCalls
from rollout.plugin_calls import (
    DEFAULT_JUDGE_TIMEOUT_S,
    DEFAULT_STEP_TIMEOUT_S,
    Waker,
    call_limits,
    start_daemon_call,
)
from rollout.prompting import Prompter, blinded
from rollout.runner_stats import RunnerStats
from rollout.settings import RunnerSettings
from rollout.tool_parser import get_parser, tool_names

log = logging.getLogger("async_rl.rollout")

# This many trajectories in a row whose first observation left no room for an action: model.max_seq_len is too small
# for the environment's tasks, and the run would only abandon trajectories (seen: `env.name=coding` at the default
# 256, 0 env steps until run.max_wall_s, exit 0). The worker stops with a ConfigError naming the key.
NO_ROOM_STREAK_LIMIT = 64
DEFAULT_MAX_ACTION_TOKENS = 256  # when neither rollout.max_new_tokens nor the env's max_action_tokens says
BLIND_OBSERVATION = "?"  # what `blind` evaluation shows instead of every tool answer

def sampling_params(rollout: RunnerSettings, factory: EnvFactory,
                    tokenizer: PreTrainedTokenizerBase) -> SamplingParams:
    """The turn's sampling settings: `rollout.*`, with the env's suggested action budget when none is set."""
    max_new_tokens = rollout.max_new_tokens or optional(factory, "max_action_tokens") or DEFAULT_MAX_ACTION_TOKENS
    return SamplingParams(
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        max_new_tokens=int(max_new_tokens),
        stop_token_ids=[tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [],
        stop=list(rollout.stop),
    )


class EpisodeRunner:
    """Trajectories in flight through their phases (the module's docstring); the owner calls `start_group` and
    `pump`, results go to the `Sink`."""

    def __init__(
        self,
        env_name: str,
        factory: EnvFactory,
        engine: InferenceEngine | EngineThread,
        tokenizer: PreTrainedTokenizerBase,
        params: SamplingParams,
        max_seq_len: int,
        sink: Sink,
        max_inflight: int,
        blind: bool = False,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        judge_timeout_s: float = DEFAULT_JUDGE_TIMEOUT_S,
        tool_parser: str = "hermes",
        batch_wait_s: float = 0.0,
        inline: InlineCalls | None = None,
    ) -> None:
        self.env_name = env_name
        self.factory = factory
        self.engine = EngineCalls(engine, params)  # on the engine's own thread (rollout/engine_calls.py)
        self.tokenizer = tokenizer
        self.prompter = Prompter(tokenizer)
        self.parse_tools = get_parser(tool_parser)  # the actions of envs with tools(): rollout.tool_parser
        self.params = params
        self.max_seq_len = max_seq_len
        self.sink = sink
        self.max_inflight = max_inflight
        self.blind = blind
        self.batch_wait_s = batch_wait_s
        self.ready_since: float | None = None  # when the first trajectory now waiting for the engine began to wait
        # a finished call (engine or pool) wakes `pump`'s one poll, as do the owner's sockets (`watch`)
        self.waker = Waker()
        self.poller = zmq.Poller()
        self.poller.register(self.waker.fd, zmq.POLLIN)
        self.calls = EnvCalls(env_name, max_inflight, step_timeout_s, judge_timeout_s, inline,  # rollout/env_calls.py
                              wake=self.waker.wake)
        self.episodes: list[Episode] = []  # every episode not yet done
        self.engine_calls = 0  # generates done
        self.env_errors = 0
        self.stats = RunnerStats()
        self.no_room_streak = 0  # trajectories in a row abandoned for their first observation's length
        self.longest_first_observation = 0
        bind = getattr(factory, "bind", None)  # a factory that renders and decodes itself (the `agent` env)
        if callable(bind):
            bind(tokenizer=tokenizer, parse_tools=self.parse_tools, stop=list(params.stop),
                 step_timeout_s=step_timeout_s)

    @classmethod
    def from_settings(
        cls,
        settings: RunnerSettings,
        env_name: str,
        factory: EnvFactory,
        engine: InferenceEngine | EngineThread,
        tokenizer: PreTrainedTokenizerBase,
        sink: Sink,
        params: SamplingParams | None = None,
        max_inflight: int | None = None,
        blind: bool = False,
        inline: InlineCalls | None = None,
    ) -> EpisodeRunner:
        """The runner `settings` (`model.max_seq_len` and `rollout.*`) describe for the env `env_name` (env.name),
        for a worker's training and an evaluation alike: sampling as `sampling_params` says (unless `params` is
        given), the env call limits of `call_limits`, `rollout.tool_parser`, and `rollout.max_inflight` trajectories
        (unless `max_inflight`); `inline`: env calls on the owner's thread (a worker's)."""
        step_timeout_s, judge_timeout_s = call_limits(settings, factory)
        return cls(
            env_name,
            factory,
            engine,
            tokenizer,
            params if params is not None else sampling_params(settings, factory, tokenizer),
            settings.max_seq_len,
            sink,
            max_inflight if max_inflight is not None else settings.max_inflight,
            blind=blind,
            step_timeout_s=step_timeout_s,
            judge_timeout_s=judge_timeout_s,
            tool_parser=settings.tool_parser,
            batch_wait_s=settings.engine_batch_wait_s,
            inline=inline,
        )

    # --- what the owner asks --------------------------------------------------------------------------

    def acting(self) -> int:
        """Trajectories that take a place in `max_inflight` (every phase but judge)."""
        return sum(e.phase != "judge" for e in self.episodes)

    def room_for(self, group_size: int) -> bool:
        return self.acting() + group_size <= self.max_inflight

    def live_group_ids(self) -> list[str]:
        return sorted({e.group_id for e in self.episodes})

    def idle(self) -> bool:
        return not self.episodes

    def start_group(self, group_id: str, task: Task, group_size: int) -> None:
        for member in range(group_size):
            episode = Episode(group_id, member, task, env=None)
            self.episodes.append(episode)
            try:
                episode.env = checked_make(self.env_name, self.factory)
            except EnvError as exc:
                self._abandon(episode, f"env_error: {exc}")
                continue
            reset = checked_reset_tokens if token_level(episode.env) else checked_reset
            self.calls.submit("reset", episode, reset, self.env_name, episode.env, task)

    def pump(self, wait_s: float, generate: bool = True) -> None:
        """One round, never blocking longer than `wait_s`: hand finished resets/steps/judges and a finished engine
        call on; when no engine call is under way, start one (on the engine's thread) for every trajectory waiting
        for it; then wait up to `wait_s` for any of them. `generate=False` starts no engine call (a worker keeps
        its training episodes moving this way while an evaluation has the engine)."""
        self._collect()
        self._collect_generation()
        self.calls.run_queued(generate, self._returned)
        now = time.monotonic()
        self._expire(now)
        if generate and self.engine.call is None:
            ready = [e for e in self.episodes if e.phase == "act"]
            ready = [e for e in ready if not self._truncate_if_full(e)]
            if not ready:
                self.ready_since = None
            elif self._call_is_due(len(ready), now):
                self.ready_since = None
                self._generate(ready)
            else:  # gathering: wait no longer than the first one's deadline
                wait_s = min(wait_s, max(0.0, self.ready_since + self.batch_wait_s - now))
        if wait_s > 0:  # until a call finishes (the Waker's byte) or a watched socket has a message
            for ready, _ in self.poller.poll(wait_s * 1000):
                if ready == self.waker.fd:  # before collecting: a call finishing after this leaves its own byte
                    self.waker.clear()
        self._collect()
        self._collect_generation()
        self._collect_judges()
        self.calls.run_queued(generate, self._returned)

    def watch(self, socket: zmq.Socket) -> None:
        """`pump`'s wait also ends when `socket` has a message (a worker's replay and weights sockets)."""
        self.poller.register(socket, zmq.POLLIN)

    def abandon_all(self, reason: str) -> None:
        for episode in list(self.episodes):
            if episode.phase != "judge":
                self._abandon(episode, reason)

    def take_stats(self) -> dict[str, float]:
        """The metrics since the last call (rates over that span), plus the trajectories in flight now."""
        now = time.monotonic()
        line = self.stats.line(now)
        line["in_flight"] = self.acting()
        line["judging"] = self.calls.judging()
        self.stats = RunnerStats(started=now)
        return line

    def close(self) -> None:
        """Stop without waiting for slow environments, judges or an engine call (their leases time out at the
        replay service)."""
        self.calls.close()
        self.engine.close()
        self.waker.close()

    def hung_calls(self) -> int:
        """Env calls written off past their time limit that have still not returned (each holds a thread)."""
        return self.calls.hung()

    @property
    def plugin_timeouts(self) -> int:
        """Env calls abandoned past their time limit."""
        return self.calls.timeouts

    # --- the phases -----------------------------------------------------------------------------------

    def _collect(self) -> None:
        for returned in self.calls.returned(("reset", "step")):
            self._returned(returned)

    def _returned(self, returned: Returned) -> None:
        """An env call came back, from the pool or inline."""
        if returned.episode.phase == "done":  # abandoned meanwhile
            return
        if returned.kind == "judge":
            self._judged(returned.episode, returned.result, returned.error, returned.elapsed_s)
        else:
            self._env_returned(returned.episode, returned.result, returned.error, returned.elapsed_s)

    def _failed(self, episode: Episode, error: BaseException) -> None:
        """An env call raised: the checked calls raise EnvError for whatever the env did wrong; anything else is a
        bug of ours around the call, and still costs only this trajectory."""
        if isinstance(error, EnvError):
            self._abandon(episode, f"env_error: {error}")
            return
        log.error("trajectory %s: internal error", episode.trajectory_id, exc_info=error)
        self._abandon(episode, f"internal_error: {type(error).__name__}: {error}")

    def _env_returned(self, episode: Episode, result: object, error: BaseException | None, elapsed: float) -> None:
        """A reset or step came back (`error`: what it raised)."""
        if error is not None:
            self._failed(episode, error)
            return
        (self.stats.reset_s if episode.phase == "reset" else self.stats.step_s).append(elapsed)
        if episode.phase == "reset" and isinstance(result, Prompt):  # a token-level env: tokens as they are
            episode.observation_tokens = result.tokens
            episode.max_new_tokens = result.max_new_tokens
            episode.on_token = result.on_token
            episode.context = list(episode.observation_tokens)
            episode.phase = "act"
        elif episode.phase == "reset":
            try:
                episode.tools = tools_of(self.env_name, episode.env)
            except EnvError as exc:
                self._abandon(episode, f"env_error: {exc}")
                return
            episode.observation_tokens = self.prompter.first(result, episode.tools)  # type: ignore[arg-type]
            episode.context = list(episode.observation_tokens)
            episode.phase = "act"
        else:
            self._stepped(episode, result)  # type: ignore[arg-type]

    def _stepped(self, episode: Episode, result: StepResult) -> None:
        generation = episode.generation
        assert generation is not None
        episode.generation = None
        self.sink.stage(episode, generation, result.reward, result.done)
        episode.stages += 1
        if result.done:
            self._judge(episode)
            return
        if isinstance(result.observation, Prompt):  # a token-level env's tokens, as they are
            episode.observation_tokens = result.observation.tokens
            episode.max_new_tokens = result.observation.max_new_tokens
            episode.on_token = result.observation.on_token
        else:
            observation = blinded(result.observation, BLIND_OBSERVATION) if self.blind else (result.observation or "")
            episode.observation_tokens = self.prompter.next(observation)
        episode.context += generation.token_ids + episode.observation_tokens
        episode.phase = "act"

    def _room(self, episode: Episode) -> int:
        """Action tokens that still fit under model.max_seq_len (and a token-level env's cap for this turn)."""
        budget = min(self.params.max_new_tokens, episode.max_new_tokens or self.params.max_new_tokens)
        return min(budget, self.max_seq_len - len(episode.context))

    def _truncate_if_full(self, episode: Episode) -> bool:
        """Not one more action token fits in model.max_seq_len: the trajectory ends here and is judged as it is."""
        if self._room(episode) >= 1:
            if episode.stages == 0:
                self.no_room_streak = 0
            return False
        if episode.stages == 0:
            self._abandon(episode, f"context_length: the first observation ({len(episode.context)} tokens) leaves "
                                   f"no room for an action under model.max_seq_len={self.max_seq_len}")
            self.no_room_streak += 1
            self.longest_first_observation = max(self.longest_first_observation, len(episode.context))
            if self.no_room_streak >= NO_ROOM_STREAK_LIMIT:
                raise ConfigError(
                    f"model.max_seq_len: {self.max_seq_len} tokens leave no room for an action after the first "
                    f"observation of env {self.env_name!r}: {self.no_room_streak} trajectories in a row were abandoned "
                    f"(the longest first observation {self.longest_first_observation} tokens); raise model.max_seq_len")
        else:
            self._judge(episode)
        return True

    def _call_is_due(self, ready: int, now: float) -> bool:
        """Start the engine call now: 3/4 of the trajectories in flight wait for it, or the first of them has waited
        `batch_wait_s` (the clock starts at the first pump that finds one waiting)."""
        if self.ready_since is None:
            self.ready_since = now
        return 4 * ready >= 3 * self.acting() or now - self.ready_since >= self.batch_wait_s

    def _generate(self, ready: list[Episode]) -> None:
        """One engine call for all of them; near the context limit a trajectory's action budget shrinks to what fits."""
        for episode in ready:
            episode.phase = "generate"
        self.engine.start(ready, [self._room(e) for e in ready])
        assert self.engine.call is not None
        self.engine.call.add_done_callback(self.waker.wake)

    def _collect_generation(self) -> None:
        """The engine call is done: each trajectory's action goes to its env (a step on the pool)."""
        finished = self.engine.finished()
        if finished is None:
            return
        call, episodes = finished
        try:
            results = call.result()
        except EngineUnavailable as exc:  # no stage of this turn was produced: each trajectory ends here
            for episode in episodes:
                if episode.phase == "generate":
                    self._abandon(episode, f"engine_unavailable: {exc}")
            raise
        except EngineStopped:
            raise
        except Exception as exc:  # a bug of ours in an engine: these trajectories, not the worker
            log.exception("engine call failed")
            for episode in episodes:
                if episode.phase == "generate":
                    self._abandon(episode, f"internal_error: engine: {type(exc).__name__}: {exc}")
            return
        for batch, generations, elapsed in results:
            self.engine_calls += 1
            self.stats.engine_s += elapsed
            for episode, generation in zip(batch, generations, strict=True):
                self.stats.actions += 1
                self.stats.action_tokens += len(generation.token_ids)
                if episode.phase != "generate":  # abandoned while the engine worked
                    continue
                episode.generation = generation
                episode.phase = "step"
                assert episode.env is not None
                if token_level(episode.env):  # the tokens themselves: the env decodes and parses them
                    self.calls.submit("step", episode, checked_step_tokens, self.env_name, episode.env, generation)
                    continue
                action = self._action(episode, generation)
                self.calls.submit("step", episode, checked_step, self.env_name, episode.env, action)

    def _expire(self, now: float) -> None:
        """Abandon each trajectory whose reset, step or judge is past its time limit; its thread is written off."""
        for kind, episode, limit in self.calls.expired(now):
            self._abandon(episode, f"timeout: env {self.env_name!r} {kind} did not return within {limit:g} s",
                          hung=True)

    def _action(self, episode: Episode, generation: Generation) -> str | Action:
        """What `step` gets: the text, or for an env with tools an `Action` with its parsed calls (counted)."""
        text = self._action_text(generation)
        if episode.tools is None:
            return text
        action, errors = self.parse_tools(text, tool_names(episode.tools))
        self.stats.tool_calls += len(action.tool_calls)
        self.stats.tool_call_errors += errors
        return action

    def _action_text(self, generation: Generation) -> str:
        text = self.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
        for stop in self.params.stop:  # the tokens may run past the stop string inside their last token
            at = text.find(stop)
            if at >= 0:
                text = text[: at + len(stop)]
        return text

    def _judge(self, episode: Episode) -> None:
        """The judge inline, or on a daemon thread of the judge pool: a slow one holds up nothing, a hung one keeps
        its thread (the pool starts another) and holds up neither the worker nor its exit."""
        episode.phase = "judge"
        assert episode.env is not None
        self.calls.submit("judge", episode, checked_judge, self.env_name, episode.env)

    def _collect_judges(self) -> None:
        for returned in self.calls.returned(("judge",)):
            self._returned(returned)  # with the judge's own time, not when we looked

    def _judged(self, episode: Episode, judgement: object, error: BaseException | None, elapsed: float) -> None:
        if error is not None:
            self._failed(episode, error)
            return
        self.stats.judge_s.append(elapsed)
        self.stats.trajectories_finished += 1
        self.stats.turns += episode.stages
        self._finish(episode)
        self.sink.outcome(episode, judgement, "")  # type: ignore[arg-type]

    def _abandon(self, episode: Episode, reason: str, hung: bool = False) -> None:
        log.warning("trajectory %s abandoned: %s", episode.trajectory_id, reason)
        self.env_errors += reason.startswith("env_error")
        self.stats.trajectories_abandoned += 1
        self._finish(episode, hung=hung)
        self.sink.outcome(episode, None, reason)

    def _finish(self, episode: Episode, hung: bool = False) -> None:
        episode.phase = "done"
        if episode in self.episodes:
            self.episodes.remove(episode)
        close = optional(episode.env, "close")
        if callable(close) and hung:  # the env is still inside a call that hung: its close may hang as well
            start_daemon_call(close, name="env-close")
        elif callable(close):
            try:
                close()
            except Exception as exc:
                log.warning("env %r: close() of trajectory %s raised %s: %s", self.env_name, episode.trajectory_id,
                            type(exc).__name__, exc)

