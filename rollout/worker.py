"""A rollout worker: lease groups from the replay service, run their episodes, stream their stages, follow weights.

    DEALER -> replay ROUTER   LeaseRequest, StageRecord, Outcome, Heartbeat, EvalReport
                              (Ack, LeaseGrant, LeaseDenied, Error)
    SUB    <- learner PUB     WeightsPublished

The worker asks for a new group whenever its episode runner (rollout/runner.py) has room for one more group
within `rollout.max_inflight`, and draws the group's task from its environment's train split (each task once per
pass, in a seeded order). The engine runs on its own thread (rollout/engines/thread.py): this loop reads acks,
resends, heartbeats, lease replies, judgements and weight notices every IDLE_POLL_S at most, however long one
engine call takes. A weight load is queued on the engine's thread, so weights change only between engine calls
and every token's version tag is the version that actually produced it. A worker that starts late catches up from
`<run_dir>/weights/latest.json`. Which loader takes a notice's weights is the notice's `format`
(async_rl/weights/base.py): a format the engine cannot load is refused by name, whatever this worker's config.
With `run.eval_every` > 0, worker 0 evaluates the policy on the eval split every that many versions and reports
the result (EvalReport) for the learner's metrics line.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

import torch
import zmq

from async_rl.config import Config
from async_rl.model import load_tokenizer
from async_rl.protocol import (
    LOGPROB,
    TOKEN,
    EvalReport,
    LeaseDenied,
    LeaseGrant,
    Outcome,
    StageRecord,
    WeightsPublished,
    pack,
)
from async_rl.security import check_transport, load_keys
from async_rl.signals import stop_on_signals
from async_rl.telemetry import RoleMetrics
from async_rl.transport import Inbox, connect_dealer, connect_subscriber
from async_rl.weights.base import WeightsFormatError, format_of
from async_rl.weights.file import version_files
from rollout.ack_journal import AckJournal, journal_path
from rollout.engines import EngineStopped, EngineUnavailable, Generation, InferenceEngine
from rollout.engines.thread import EngineThread
from rollout.engines.torch_engine import TorchEngine, configured_device
from rollout.envs.base import Judgement, Task, checked_tasks, close_factory, env_metrics
from rollout.episode import Episode
from rollout.evaluate import evaluate_policy
from rollout.inline_calls import InlineCalls, LoopMoved
from rollout.link import ReplayLink
from rollout.prepare import load_env, prepare_model_dir
from rollout.runner import EpisodeRunner
from rollout.sandbox import isolation_counts
from rollout.settings import EngineSettings, EvalSettings, RolloutSettings

log = logging.getLogger("async_rl.rollout")

IDLE_POLL_S = 0.05  # how long the loop waits for a reply or an environment when there is nothing to generate
# The engine's thread holds the GIL for most of a call (a Hugging Face forward is many small Python steps); at
# Python's default 5 ms switch interval the loop, which hands finished turns to their environments and starts the
# next call, waited that long for it. 0.5 ms: ~15% more env steps a second on the default run (docs/research/log.md).
SWITCH_INTERVAL_S = 0.0005
STOP_DRAIN_S = 2.0  # on stop, wait this long at most for the acks of what was already sent


class TaskSampler:
    """Draws tasks evenly: every task once per pass, in a fresh seeded order each pass."""

    def __init__(self, tasks: Sequence[Task], seed: int) -> None:
        self.tasks = list(tasks)
        self.rng = random.Random(seed)
        self.order: list[Task] = []

    def next(self) -> Task:
        if not self.order:
            self.order = list(self.tasks)
            self.rng.shuffle(self.order)
        return self.order.pop()


class ReplaySink:
    """Stages and outcomes of a runner's episodes, as records to the replay service."""

    def __init__(self, worker_id: str, send: Callable[[StageRecord | Outcome], None], next_msg_id: Callable[[], int]):
        self.worker_id = worker_id
        self.send = send
        self.next_msg_id = next_msg_id

    def stage(self, episode: Episode, generation: Generation, reward: float, terminal: bool) -> None:
        self.send(
            StageRecord(
                msg_id=self.next_msg_id(),
                worker_id=self.worker_id,
                group_id=episode.group_id,
                trajectory_id=episode.trajectory_id,
                member=episode.member,
                task_id=episode.task.id,
                stage_index=episode.stages,
                observation_tokens=pack(episode.observation_tokens, TOKEN),
                action_tokens=pack(generation.token_ids, TOKEN),
                behaviour_logprobs=pack(generation.logprobs, LOGPROB),
                policy_versions=pack(generation.versions, TOKEN),
                stage_reward=reward,
                terminal=terminal,
            )
        )

    def outcome(self, episode: Episode, judgement: Judgement | None, reason: str) -> None:
        self.send(
            Outcome(
                msg_id=self.next_msg_id(),
                worker_id=self.worker_id,
                group_id=episode.group_id,
                trajectory_id=episode.trajectory_id,
                member=episode.member,
                num_stages=episode.stages,
                outcome=judgement.score if judgement is not None else None,
                success=judgement.success if judgement is not None else False,
                abandoned=judgement is None,
                reason=reason,
            )
        )


def make_engine(settings: EngineSettings, model_dir: Path, seed: int,
                stop: threading.Event | None = None) -> InferenceEngine:
    if settings.engine == "sglang":
        from rollout.engines.sglang import SGLangEngine  # httpx is needed only by SGLang users

        return SGLangEngine(settings.sglang, stop)  # a generate waiting on its servers ends when `stop` is set
    if settings.engine == "vllm":
        from rollout.engines.vllm import VLLMEngine

        return VLLMEngine(settings.vllm, stop)
    return TorchEngine(model_dir, seed=seed, device=configured_device(settings.device), stop=stop,
                       cache_mib=settings.prefix_cache_mib)


class WeightsFollower:
    """Keeps the engine at the newest published policy version. Loads run on the engine's thread (between two
    engine calls); a newer announcement that arrives during a load waits for it to finish."""

    def __init__(self, socket: zmq.Socket, engine: EngineThread, run_dir: Path) -> None:
        self.socket = socket
        self.engine = engine
        self.inbox = Inbox(socket, "the weights channel", log)  # its `bad`: malformed or unexpected notices
        self._pending: WeightsPublished | None = None  # the newest announcement not loaded yet
        self._loading: Future | None = None
        self.refused: tuple[int, str] | None = None  # the last (version, format) the engine cannot load: not retried
        self._catch_up(run_dir / "weights" / "latest.json")

    def sync(self) -> None:
        """Drain every announcement waiting on SUB; load only the last one (skipped versions are superseded). The last,
        not the highest: a learner that resumed from a checkpoint announces a version below the engine's, and the
        weights of the versions above it died with the old learner (docs/architecture.md, "Resume after a crash")."""
        newest: WeightsPublished | None = None
        for message in self.inbox.messages(0.0):
            if isinstance(message, WeightsPublished):
                newest = message
            else:
                self.inbox.unexpected(message)
        if newest is not None:
            self._pending = newest
        if self._loading is not None and self._loading.done():
            if self._loading.exception() is not None:
                log.error("loading policy weights failed: %r", self._loading.exception())
            self._loading = None
        if self._pending is not None and self._loading is None:
            notice, self._pending = self._pending, None
            if notice.version != self.engine.version and (notice.version, notice.format) != self.refused:
                self._loading = self.engine.submit(self._load, notice.version, notice.path, notice.format)

    def _catch_up(self, latest: Path) -> None:
        """Load the version latest.json names before the first engine call (a torn latest.json: the newest
        weights file beside it), in the format it records (one written before it recorded one: the path says)."""
        if not latest.exists():
            return
        try:
            record = json.loads(latest.read_text())
            version, path = int(record["version"]), str(record["path"])
            weights_format = str(record.get("format") or format_of(path))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            files = published_files(latest.parent, None)
            log.warning("ignoring unreadable %s: %s%s", latest, exc, f"; trying {files[0][1]}" if files else "")
            if not files:
                return
            version, path, weights_format = files[0][0], str(files[0][1]), "safetensors"
        self._loading = self.engine.submit(self._load, version, path, weights_format)
        self._loading.result()  # before the first engine call

    def _load(self, version: int, path: str, weights_format: str = "safetensors") -> None:
        """On the engine's thread, by the engine's loader for `weights_format`; a format it has none for is refused
        by name (logged once per version, never retried for it). A file that does not load (pruned by keep_weights,
        torn, or failing its checksum after a node crash) is skipped with a warning naming it, for the newest older
        published file that loads: the engine never takes weights that failed their check, and the version it tags
        tokens with is the one it loaded. Never below the engine's own version unless the announced one is (a learner
        that resumed)."""
        floor = self.engine.version if version > self.engine.version else -1
        older = published_files(Path(path).parent, version) if weights_format == "safetensors" else []
        for candidate, file in [(version, path), *older]:
            if candidate <= floor or candidate == self.engine.version:
                return
            try:
                self.engine.engine.update_weights(candidate, str(file), weights_format)
            except WeightsFormatError as exc:
                self.refused = (version, weights_format)
                log.error("policy version %d not loaded: %s (is this worker's rollout.engine or "
                          "its weight_sync not the learner's?)", version, exc)
                return
            except (OSError, RuntimeError) as exc:  # async_rl.errors.WeightsError is a RuntimeError
                log.warning("could not load policy version %d from %s: %s", candidate, file, exc)
                continue
            if candidate != version:
                log.warning("loaded policy version %d from %s in place of version %d", candidate, file, version)
            return


def published_files(weights_dir: Path, below: int | None) -> list[tuple[int, Path]]:
    """The learner's published weight files `v<N>.safetensors` in `weights_dir` (async_rl/weights/file.py), N <
    `below` when given, newest first."""
    return sorted(((version, file) for version, file in version_files(weights_dir).items()
                   if below is None or version < below), reverse=True)


def run(config: Config, worker_index: int, stop: threading.Event | None = None) -> None:
    """Run rollout worker `rollout-<worker_index>` until `stop` is set (or SIGTERM/SIGINT in the main thread). The
    role's entry: the components' settings are read from the config here."""
    # refused before the env and engine are built; the sockets refuse again (async_rl/transport.py)
    check_transport(config.security.curve_dir, config.security.insecure,
                    (config.replay.endpoint, config.learner.publish_endpoint))
    settings = RolloutSettings.from_config(config)
    with stop_on_signals(stop) as request:
        _run_until_stopped(settings, worker_index, request.event)


def _run_until_stopped(settings: RolloutSettings, worker_index: int, stop: threading.Event) -> None:
    torch.set_num_threads(settings.worker.threads_per_process)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    worker = _Worker(settings, worker_index, stop)
    try:
        worker.run_loop()
    except EngineUnavailable as exc:  # e.g. every SGLang server gone: deliver the abandoned outcomes, then stop
        log.error("%s stops: %s", worker.worker_id, exc)
        _deliver_unacked(worker.link, settings.worker.ack_timeout_s)
        raise
    except EngineStopped:  # stopped while the engine waited on its servers: as below
        _deliver_unacked(worker.link, STOP_DRAIN_S)
    else:  # stopped: what was sent should still reach the replay service (it is stopped after the workers)
        _deliver_unacked(worker.link, STOP_DRAIN_S)
    finally:
        worker.close()


class _Worker:
    """One worker's parts (env, engine, sockets, runner, metrics) and its loop; each part gets its own settings."""

    def __init__(self, settings: RolloutSettings, worker_index: int, stop: threading.Event) -> None:
        self.settings, self.stop = settings, stop
        self.env_name, worker = settings.env.name, settings.worker
        self.worker_id = worker_id = f"rollout-{worker_index}"
        self.factory = load_env(settings.env)
        tasks = checked_tasks(self.env_name, self.factory, "train")
        self.train_tasks = TaskSampler(tasks, seed=settings.env.seed * 1000 + worker_index)
        model_dir = prepare_model_dir(settings.model_dir, self.factory)
        self.tokenizer = load_tokenizer(model_dir)
        seed = worker.seed * 1000 + worker_index
        self.engine = EngineThread(make_engine(settings.engine, model_dir, seed=seed, stop=stop))
        self.context = zmq.Context()
        curve = load_keys(worker.curve_dir, worker_id)  # its own key: the replay holds it to this worker id and leases
        self.dealer = connect_dealer(self.context, worker.endpoint, worker_id, curve, insecure=worker.insecure)
        self.subscriber = connect_subscriber(self.context, worker.publish_endpoint, curve, insecure=worker.insecure)
        self.journal = AckJournal(journal_path(worker.run_dir, worker_id))
        self.link = ReplayLink(self.dealer, worker_id, worker.ack_timeout_s, worker.heartbeat_s, self.journal)
        self.weights = WeightsFollower(self.subscriber, self.engine, worker.run_dir)
        sink = ReplaySink(worker_id, self.link.send_reliably, self.link.next_msg_id)
        budget = settings.runner.inline_budget_s
        self.inline = InlineCalls(budget, self._start_loop_thread) if budget > 0 else None
        self.runner = EpisodeRunner.from_settings(settings.runner, self.env_name, self.factory, self.engine,
                                                  self.tokenizer, sink, inline=self.inline)
        self.runner.watch(self.dealer)  # the runner's wait ends at a reply or a weights notice, not only a call
        self.runner.watch(self.subscriber)
        self._loop_threads = 0
        self._loop_done = threading.Event()
        self._loop_error: BaseException | None = None
        self.eval_every = settings.eval.eval_every if worker_index == 0 else 0
        self.metrics = RoleMetrics(settings.metrics, worker_id)
        log.info("%s up: env %s, engine %s at version %d, %d in flight at most, replay %s", worker_id, self.env_name,
                 settings.engine.engine, self.engine.version, worker.max_inflight, worker.endpoint)

    def run_loop(self) -> None:
        """`loop` on a thread of its own, which an env call that overran rollout.inline_budget_s replaces
        (rollout/inline_calls.py); this thread waits for the loop to end (signals still reach it) and raises what
        the loop raised."""
        self._start_loop_thread()
        while not self._loop_done.wait(0.5):
            pass
        if self._loop_error is not None:
            raise self._loop_error

    def _start_loop_thread(self) -> None:
        self._loop_threads += 1
        threading.Thread(target=self._loop_thread, name=f"{self.worker_id}-loop-{self._loop_threads}",
                         daemon=True).start()

    def _loop_thread(self) -> None:
        try:
            self.loop()
        except LoopMoved:  # an env call held this thread past its budget: the loop goes on on another one
            return
        except BaseException as exc:  # noqa: BLE001 - handed to run_loop, which raises it
            self._loop_error = exc
        self._loop_done.set()

    def loop(self) -> None:
        worker, link, runner, engine = self.settings.worker, self.link, self.runner, self.engine
        next_metrics_at = time.monotonic() + worker.metrics_every_s
        next_request_at = 0.0
        next_eval = self.eval_every
        held_replies: list[LeaseGrant | LeaseDenied] = []  # lease replies that arrived while an evaluation ran
        while not self.stop.is_set():
            now = time.monotonic()
            if now >= next_metrics_at:
                next_metrics_at = now + worker.metrics_every_s
                self.write_metrics()
            if link.lease_request is None and now >= next_request_at and runner.room_for(worker.group_size):
                link.request_lease()
            busy = not runner.idle()
            for reply in held_replies + link.handle_replies(0.0 if busy else IDLE_POLL_S):
                next_request_at = self._answered(reply)
            held_replies = []
            runner.pump(IDLE_POLL_S if busy else 0.0)  # never longer: the engine call runs on its own thread
            self.weights.sync()
            link.tick(runner.live_group_ids())
            if self.eval_every and engine.version >= next_eval:
                # On the grid of multiples of eval_every: a version that arrived late (the learner published two
                # while this worker was busy) does not shift every later evaluation.
                next_eval = (engine.version // self.eval_every + 1) * self.eval_every
                held_replies = _evaluate_now(self.settings.eval, self.env_name, self.factory, engine,
                                             self.tokenizer, link, runner, self.worker_id)

    def _answered(self, reply: LeaseGrant | LeaseDenied) -> float:
        """A lease reply: a granted group starts (a task drawn for it); returns when to ask for the next lease."""
        if isinstance(reply, LeaseDenied):
            log.debug("lease denied (%s); asking again in %.2fs", reply.reason, reply.retry_after_s)
            return time.monotonic() + reply.retry_after_s
        task = self.train_tasks.next()
        log.debug("group %s: task %s x %d", reply.group_id, task.id, reply.group_size)
        self.runner.start_group(reply.group_id, task, reply.group_size)
        return 0.0

    def write_metrics(self) -> None:
        link, runner = self.link, self.runner
        line = runner.take_stats()
        line.update(policy_version=self.engine.version, resends=link.resends, unacked=len(link.unacked),
                    env_errors=runner.env_errors, plugin_timeouts=runner.plugin_timeouts,
                    hung_calls=runner.hung_calls(), loop_moves=self.inline.moved if self.inline else 0,
                    weights_refused=getattr(self.engine.engine, "weights_refused", 0),  # failed their checksum
                    duplicate_acks=link.duplicate_acks, acks_journalled=self.journal.written,
                    bad_messages=link.inbox.bad + self.weights.inbox.bad,  # malformed or unexpected, not acted on
                    ack_journal_dropped=self.journal.dropped, duplicate_lease_replies=link.duplicate_lease_replies,
                    **isolation_counts(),  # agent code run by this worker, and how much of it without namespaces
                    **env_metrics(self.env_name, self.factory),  # the env's own counts (agent_*)
                    **{f"rejected_{code}": n for code, n in link.rejected.items()})
        self.metrics.write(line)

    def close(self) -> None:
        if self.inline is not None:
            self.inline.close()
        self.write_metrics()
        self.metrics.close()
        self.journal.close()
        self.runner.close()
        self.engine.close()
        self.engine.engine.close()
        close_factory(self.env_name, self.factory)  # e.g. the tasks env's MCP server
        self.dealer.close(linger=0)
        self.subscriber.close(linger=0)
        self.context.term()
        log.info("%s stopped (%d records unacked, %d resends, %d env errors)", self.worker_id, len(self.link.unacked),
                 self.link.resends, self.runner.env_errors)


def _evaluate_now(settings: EvalSettings, env_name: str, factory, engine: EngineThread, tokenizer, link: ReplayLink,
                  runner: EpisodeRunner, worker_id: str) -> list[LeaseGrant | LeaseDenied]:
    """Evaluate the loaded weights on the eval split and report it. Training episodes make no engine call
    meanwhile, but their steps and judgements go on and are delivered; leases stay alive."""
    held: list[LeaseGrant | LeaseDenied] = []

    def keep_leases() -> None:
        held.extend(link.handle_replies(0.0))
        runner.pump(0.0, generate=False)
        link.tick(runner.live_group_ids())

    version = engine.version
    started = time.monotonic()
    metrics = evaluate_policy(settings, env_name, factory, engine, tokenizer, runner.params, service=keep_leases)
    metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    metrics["eval_s"] = time.monotonic() - started
    link.send_reliably(EvalReport(worker_id=worker_id, msg_id=link.next_msg_id(), policy_version=version,
                                  metrics=metrics))
    return held


def _deliver_unacked(link: ReplayLink, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while link.unacked and time.monotonic() < deadline:
        link.handle_replies(IDLE_POLL_S)
        link.tick([])
