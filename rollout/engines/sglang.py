"""The SGLang engine: a client of SGLang's native HTTP API, behind the same interface as the built-in engine.

A batch of prompts is split over the live servers of `rollout.sglang.urls` (or one sglang-router URL) and sent
as one `/generate` call per server, concurrently, with `return_logprob`. Every generated token carries the
behaviour log-prob SGLang sampled it with (log_softmax(logits / temperature), the full distribution even under
top-p: the same quantity `async_rl.loss.token_logprobs` recomputes) and the server's `weight_version` for that
token position (`meta_info.weight_versions` splits a request that lived across an update).

Three kinds of trouble, kept apart:

* **Preemption** (a weight update aborted the request: `finish_reason` "abort" with no status code) is not a
  failure. The row is sent again, after a short backoff, until it completes; only the run stopping ends that
  (`stop` event or `close()`: a waiting `generate` raises `EngineStopped` within POLL_S). With
  `partial_rollouts` (the default) the tokens generated before the abort are kept with their log-probs and
  versions and the same action continues from them on the new weights (AReaL's interruptible generation): the
  request is prompt + kept tokens, `max_new_tokens` reduced by what was kept, the stop rules unchanged (a stop
  string split across the cut is not seen by the server; the agent still cuts the action's text at it). Without
  it, they are discarded and the action starts over.
* **Failure** (connection refused, timeout, 5xx; or a row aborted *with* a status code, i.e. the server refused
  it): a server that fails a call is marked dead, and the rows are sent again to a live server. Each row may be
  sent again after a failure at most `max_retries` times; past that no server can serve it.
* **Unavailability** (no live server: all restarting or unreachable): `generate` (and start-up) waits, probing
  the servers with backoff and logging at most once per LOG_EVERY_S, for up to `unavailable_timeout_s`; a dead
  server rejoins as soon as it answers `/health`.

`EngineUnavailable` is raised only when no server can serve: none answered for `unavailable_timeout_s`, or a row
failed on `max_retries` + 1 attempts. Only a finished batch is returned, so a stage is streamed once or not at
all; on `EngineUnavailable` the agent reports the affected trajectories abandoned.

Weight sync, by the notice's format (`WeightsPublished.format`, whatever `weight_sync` says): an "hf-dir" (the
learner's `weight_sync: disk`) the engine loads into every server with `/update_weights_from_disk`, from hard
links of its own to the directory's files (`async_rl.weights.hf_dir.load_view`: the learner may prune the
directory while a server reads it) after checking them against the directory's manifest (a torn or changed file is
refused, never sent, and counted in `weights_refused`). pause_mode abort: with `abort_all_requests`, so the running
requests are preempted; in_place: they finish on the old weights first. Servers already at that version (another
worker sharing them got there first) are skipped, and a server that rejoins behind the latest version loads it.
"distributed" (`weight_sync: distributed`): the learner pushes the weights itself and the engine only reads the
servers' new version. A single "safetensors" file is refused by name (no model directory a server can load).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from async_rl.durable import manifest_problem
from async_rl.errors import WeightsError
from async_rl.ratelimit import RateLimitedLog
from async_rl.security import server_tls, sglang_headers
from async_rl.weights.base import Loader, loader_for
from async_rl.weights.hf_dir import load_view, version_dirs
from rollout.engines.base import EngineStopped, EngineUnavailable, Generation, SamplingParams
from rollout.settings import SGLangSettings, VLLMSettings

log = logging.getLogger("async_rl.rollout")

HEALTH_TIMEOUT_S = 30.0  # /health_generate runs a real one-token generation
PROBE_TIMEOUT_S = 5.0  # GET /health: answers during a short pause too (not after ~20 s paused: sglang-notes)
REPROBE_DEAD_EVERY_S = 10.0  # while other servers are live, a dead one is asked again at most this often
PREEMPT_BACKOFF_S = (0.05, 1.0)  # first and largest wait before preempted rows are sent again (doubling)
UNAVAILABLE_BACKOFF_S = (0.5, 5.0)  # first and largest wait between probes while no server answers (doubling)
LOG_EVERY_S = 10.0  # preemption and waiting lines: at most one per kind this often
POLL_S = 0.1  # a waiting generate looks at its stop event at least this often
CHECKS_KEPT = 64  # hf-v<N>/ checks remembered (the newest)
VIEW_ATTEMPTS = 3  # an hf-v<N>/ pruned while the engine links it: the newest beside it is tried, this often at most

logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would drown the worker's log


class ServerFailed(Exception):
    """One server failed one request; the caller retries elsewhere."""


def loadable_dir(version: int, path: str) -> tuple[int, str] | None:
    """(version, path) of the HF directory to load for announced `version` at `path`: itself while it holds its
    weights (the learner writes it whole and renames it: async_rl/weights/hf_dir.py); once the learner has pruned it
    (learner.keep_weights, a worker that fell behind), the newest hf-v<N> beside it with N > version that does; None
    if there is none. SGLang takes a path that is not a directory for a Hub repo id, and its scheduler dies of
    that (HFValidationError), taking the server with it: a pruned path must never be sent."""
    here = Path(path)
    if (here / "model.safetensors").is_file():
        return version, path
    newer = [(n, str(directory)) for n, directory in version_dirs(here.parent).items() if n > version]
    return newer[-1] if newer else None


def _identity(file: Path) -> tuple[int, int, int, int]:
    """What tells a file's content apart without reading it, for files written once and renamed into place."""
    st = file.stat()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def parse_version(label: str | int | None) -> int:
    """A server's weight_version as a policy version: ours are stringified ints; "default" is the start (0)."""
    try:
        return int(label)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0


@dataclass
class Server:
    url: str
    alive: bool = True
    dead_since: float = 0.0
    last_error: str = ""  # why it was last marked dead (EngineUnavailable says it)


@dataclass
class Piece:
    """What one /generate reply produced for one row."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish: Literal["stop", "length", "preempted", "refused"]
    message: str = ""


@dataclass
class Row:
    """One prompt of a `generate` call: what it has produced so far (kept across preemptions) and its failures."""

    prompt: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    failures: int = 0

    def add(self, piece: Piece) -> None:
        self.token_ids += piece.token_ids
        self.logprobs += piece.logprobs
        self.versions += piece.versions

    def generation(self, finish: Literal["stop", "length"]) -> Generation:
        return Generation(list(self.token_ids), list(self.logprobs), list(self.versions), finish)


class SGLangEngine:
    kind, section = "SGLang", "sglang"  # in messages: the servers' name, the config section (rollout.<section>)
    health_path = "/health_generate"  # what start-up asks each server (SGLang's runs a one-token generation)

    def __init__(self, settings: SGLangSettings | VLLMSettings, stop: threading.Event | None = None) -> None:
        """`settings`: a VLLMSettings for the subclass (rollout/engines/vllm.py). `stop`: when set (e.g. the worker's
        SIGTERM event), a `generate` that is waiting raises EngineStopped."""
        if not settings.urls:
            raise EngineUnavailable(f"rollout.{self.section}.urls: no {self.kind} server configured")
        self.settings = settings
        self.stop = stop
        self.closed = threading.Event()
        self.servers = [Server(url.rstrip("/")) for url in settings.urls]
        self.http = httpx.Client(timeout=settings.request_timeout_s, headers=self._headers(),
                                 verify=server_tls(settings.urls, settings.ca_file, f"rollout.{self.section}.ca_file"))
        # Several calls per server can be in flight: a server's re-sent rows need not wait for another's share.
        self.pool = ThreadPoolExecutor(max_workers=4 * len(self.servers), thread_name_prefix=self.section)
        self.ratelog = RateLimitedLog(log, LOG_EVERY_S)
        self.latest_disk: tuple[int, str] | None = None  # (version, path) last asked for with disk sync
        # Counters (cumulative over the engine's life; the benchmark and the logs read them):
        self.stages_retried = 0  # rows sent again after a failure or a preemption
        self.preemptions = 0  # rows a server aborted (weight update) and that were sent again
        self.tokens_kept = 0  # tokens of preempted rows kept as the prefix of their continuation
        self.tokens_discarded = 0  # tokens of preempted rows thrown away (partial_rollouts: false)
        self.failures = 0  # rows a server failed (or refused) and that were sent elsewhere
        self.weights_refused = 0  # hf-v<N>/ directories refused: torn, changed, or without a manifest to check
        self.refused_paths: set[str] = set()
        # By `WeightsPublished.format`: HF directories from disk, or a note of what the learner pushed (a single
        # safetensors file is no model directory a server can load: refused by name).
        self.loaders: dict[str, Loader] = {"hf-dir": self._load_dir, "distributed": self._take_servers_version}
        self.checked: dict[tuple, str | None] = {}  # the files' identity -> their check's problem (None: good)
        for server in self.servers:
            try:
                self._get(server, self.health_path, timeout=min(HEALTH_TIMEOUT_S, settings.request_timeout_s))
            except ServerFailed as exc:
                self._mark_dead(server, f"health check failed: {exc}")
        self.version = min(self._live_versions(wait=True))
        log.info("%s engine: %d/%d server(s) healthy at version %d (partial rollouts %s)", self.kind, len(self._live()),
                 len(self.servers), self.version, "on" if settings.partial_rollouts else "off")

    # --- generation -------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError(f"{type(self).__name__}.generate: every prompt needs at least one token")
        rows = [Row(list(p)) for p in prompts]
        results: list[Generation | None] = [None] * len(prompts)
        queue = list(range(len(prompts)))  # rows to send (again)
        in_flight: dict[Future, tuple[Server, list[int]]] = {}
        send_at, backoff = 0.0, PREEMPT_BACKOFF_S[0]
        while queue or in_flight:
            self._check_stop()
            if queue and time.monotonic() >= send_at:
                live = self._live()
                if not live and not in_flight:
                    self._wait_for_a_server()
                    live = self._live()
                if live:
                    self._send(live, rows, queue, params, in_flight)
                    queue = []
            if not in_flight:
                self._sleep(min(POLL_S, max(0.0, send_at - time.monotonic())))
                continue
            done, _ = wait(in_flight, timeout=POLL_S, return_when=FIRST_COMPLETED)
            preempted = []
            for job in done:
                server, share = in_flight.pop(job)
                try:
                    pieces = job.result()
                except ServerFailed as exc:
                    self._mark_dead(server, str(exc))
                    queue += self._failed(rows, share, f"{server.url}: {exc}")
                    continue
                for row, piece in zip(share, pieces, strict=True):
                    if piece.finish == "refused":
                        queue += self._failed(rows, [row], f"{server.url} refused it: {piece.message}")
                    elif piece.finish == "preempted":
                        generation = self._preempted(rows[row], piece, params)
                        if generation is None:
                            preempted.append(row)
                        else:
                            results[row] = generation
                    else:
                        rows[row].add(piece)
                        results[row] = rows[row].generation(piece.finish)
            if preempted:
                queue += preempted
                self.stages_retried += len(preempted)
                send_at, backoff = time.monotonic() + backoff, min(2 * backoff, PREEMPT_BACKOFF_S[1])
                self.ratelog("preempted", logging.INFO,
                             "preempted by weight updates: %d row(s) now, %d so far (%d tokens kept, %d discarded);"
                             " sending them again", len(preempted), self.preemptions, self.tokens_kept,
                             self.tokens_discarded)
            elif done:
                backoff = PREEMPT_BACKOFF_S[0]
            queue.sort()
        return results  # type: ignore[return-value]

    def _send(self, live: list[Server], rows: list[Row], queue: list[int], params: SamplingParams,
              in_flight: dict[Future, tuple[Server, list[int]]]) -> None:
        """Split `queue` over the live servers; each row continues from what it kept (prompt + kept tokens)."""
        for index, server in enumerate(live):
            share = queue[index :: len(live)]
            if share:
                requests = [(rows[r].prompt + rows[r].token_ids, params.max_new_tokens - len(rows[r].token_ids))
                            for r in share]
                in_flight[self.pool.submit(self._generate_on, server, requests, params)] = (server, share)

    def _preempted(self, row: Row, piece: Piece, params: SamplingParams) -> Generation | None:
        """Take a preempted row's partial output; the finished Generation if the kept tokens already end it."""
        self.preemptions += 1
        if not self.settings.partial_rollouts:
            self.tokens_discarded += len(piece.token_ids)
            return None
        row.add(piece)
        self.tokens_kept += len(piece.token_ids)
        if row.token_ids and row.token_ids[-1] in params.stop_token_ids:
            return row.generation("stop")
        if len(row.token_ids) >= params.max_new_tokens:
            return row.generation("length")
        return None

    def _failed(self, rows: list[Row], share: list[int], reason: str) -> list[int]:
        """Rows a server failed go back to the queue, each at most `max_retries` times."""
        self.failures += len(share)
        for r in share:
            rows[r].failures += 1
        if max(rows[r].failures for r in share) > self.settings.max_retries:
            raise EngineUnavailable(f"{len(share)} prompt(s) failed {self.settings.max_retries + 1} times, last: "
                                    f"{reason}")
        self.stages_retried += len(share)
        log.warning("%d prompt(s) to send again after a failure (%s)", len(share), reason[:300])
        return share

    def _generate_on(self, server: Server, requests: list[tuple[list[int], int]],
                     params: SamplingParams) -> list[Piece]:
        """One batched /generate on one server: (input_ids, max_new_tokens) per row."""
        body = {
            "input_ids": [ids for ids, _ in requests],
            "sampling_params": [
                {
                    "temperature": params.temperature,
                    "top_p": params.top_p,
                    "max_new_tokens": max_new_tokens,
                    "stop_token_ids": params.stop_token_ids,
                    # SGLang stops at the model's EOS unless ignore_eos, which also disables stop_token_ids: so EOS
                    # ends a row here only when stop tokens are asked for (the agent always lists EOS among them).
                    "ignore_eos": not params.stop_token_ids,
                    # Stop strings end the row at the token completing one, kept in the output (as the torch engine).
                    **({"stop": params.stop, "no_stop_trim": True} if params.stop else {}),
                }
                for _, max_new_tokens in requests
            ],
            "return_logprob": True,
        }
        replies = self._post(server, "/generate", body)
        if not isinstance(replies, list) or len(replies) != len(requests):
            raise ServerFailed(f"{server.url}/generate: expected {len(requests)} results, got {replies!r:.200}")
        return [_piece(reply) for reply in replies]

    # --- waiting and stopping ---------------------------------------------------------------------

    def _stopping(self) -> bool:
        return self.closed.is_set() or (self.stop is not None and self.stop.is_set())

    def _check_stop(self) -> None:
        if self._stopping():
            raise EngineStopped(f"the {self.kind} engine was told to stop while generating")

    def _sleep(self, seconds: float) -> None:
        """Sleep, looking at the stop event every POLL_S (it may be set by a signal handler on this thread)."""
        deadline = time.monotonic() + seconds
        while True:
            self._check_stop()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.closed.wait(min(POLL_S, left))

    def _wait_for_a_server(self) -> None:
        """No server is live: probe them all with backoff until one answers, for up to unavailable_timeout_s."""
        started = time.monotonic()
        delay = UNAVAILABLE_BACKOFF_S[0]
        while True:
            for server in self.servers:
                if self._probe(server):
                    log.warning("%s server %s answers after %.1f s without any; going on", self.kind, server.url,
                                time.monotonic() - started)
                    return
            waited = time.monotonic() - started
            if waited >= self.settings.unavailable_timeout_s:
                last = "; ".join(f"{s.url}: {s.last_error}" for s in self.servers if s.last_error)
                raise EngineUnavailable(f"no {self.kind} server left of {[s.url for s in self.servers]} (none "
                                        f"answered for {waited:.0f} s, rollout.{self.section}.unavailable_timeout_s="
                                        f"{self.settings.unavailable_timeout_s:g}){'; last: ' + last if last else ''}")
            self.ratelog("unavailable", logging.WARNING,
                         "no %s server answers (of %d); waiting, %.0f s so far, giving up after %.0f s",
                         self.kind, len(self.servers), waited, self.settings.unavailable_timeout_s)
            self._sleep(min(delay, self.settings.unavailable_timeout_s - waited))
            delay = min(2 * delay, UNAVAILABLE_BACKOFF_S[1])

    # --- weights ----------------------------------------------------------------------------------

    def update_weights(self, version: int, path: str, format: str | None = None) -> None:
        """Bring every live server to `version`, by the loader for `format` (the notice's; None: the one
        `weight_sync` says): "hf-dir" loads the HF directory `path` into them (whatever `weight_sync` says);
        "distributed" (the learner pushed the weights itself) just takes note of the servers' version; any other
        is refused by name (WeightsFormatError). With no server live, nothing happens now (the next `generate`
        waits for one; a server that rejoins catches up)."""
        native = "hf-dir" if self.settings.weight_sync == "disk" else "distributed"
        loader_for(self.loaders, format or native, f"the {self.kind} engine")(version, path)

    def _load_dir(self, version: int, path: str) -> None:
        """The "hf-dir" loader: servers behind `version` load `path` (`_load_from_disk`); then the servers' version."""
        self.latest_disk = (version, path)
        behind = []
        for server in self._live():
            try:
                if self._server_version(server) < version:  # servers already there are skipped: idempotent
                    behind.append(server)
            except ServerFailed:
                continue  # marked dead; later batches go to the others
        if behind:
            self._load_from_disk(behind, version, path)
        self._take_servers_version(version)

    def _take_servers_version(self, version: int, path: str = "") -> None:
        """The "distributed" loader (the learner pushed `version` into the servers; nothing to read): the version
        the servers report now."""
        versions = self._live_versions(wait=False)
        if not versions:
            log.warning("policy version %d: no %s server answers now; generation waits for one", version, self.kind)
            return
        self.version = min(versions)
        log.info("policy version %d on %d server(s)", self.version, len(self._live()))

    def _load_from_disk(self, servers: list[Server], version: int, path: str) -> None:
        """Load hf-v<N>/ `path` into `servers`, from one view of hard links to its files (`load_view`) made and
        checked against its manifest before any server reads it, and removed after the last: every server reads
        exactly the files checked, also when the learner prunes the directory meanwhile (learner.keep_weights). A
        directory that fails the check is sent to none (WeightsError, counted in `weights_refused`). A server that
        fails is marked dead and skipped.
        in_place: SGLang's update waits for the running requests to finish on the old weights, then loads.
        abort: the same call with `abort_all_requests`: the running requests come back aborted (their owners
        continue them on the new weights) and the load follows at once.
        No pause is used: a *paused* server loads without its update lock, and two loads at once (workers sharing
        a server) then crash it (InvalidStateError in SGLang's tokenizer manager, docs/sglang-notes.md); an
        in_place pause would also make another worker's update wait forever on the requests it froze."""
        for attempt in range(VIEW_ATTEMPTS):
            loadable = loadable_dir(version, path)
            if loadable is None:
                raise FileNotFoundError(f"{path} holds no model.safetensors (pruned by learner.keep_weights: this "
                                        f"worker fell behind) and no newer hf-v<N> is beside it; not sent to "
                                        f"{', '.join(server.url for server in servers)}")
            if loadable[0] != version:
                log.warning("%s is gone (pruned by learner.keep_weights: this worker fell behind); loading policy "
                            "version %d from %s in its place", path, *loadable)
                version, path = loadable
                self.latest_disk = max(self.latest_disk or loadable, loadable)
            try:
                view = load_view(Path(path))
            except FileNotFoundError:  # pruned as the links were made: the newest directory beside it, once more
                if attempt == VIEW_ATTEMPTS - 1:
                    raise
                continue
            except WeightsError as exc:  # no manifest to check it against
                self._refused(path, str(exc))
                raise
            break
        try:
            self._check(view, path)
            for server in servers:
                try:
                    self._load_into(server, view, version)
                except ServerFailed:
                    continue  # marked dead; later batches go to the others
                log.info("%s: policy version %d loaded from %s", server.url, version, path)
        finally:
            shutil.rmtree(view, ignore_errors=True)  # the servers hold the weights in memory (or failed)

    def _load_into(self, server: Server, view: Path, version: int) -> None:
        """One server loads the checked view and labels its weights `version` (`/update_weights_from_disk`; with
        pause_mode abort, `abort_all_requests`); ServerFailed when it fails."""
        body: dict[str, Any] = {"model_path": str(view), "weight_version": str(version)}
        if self.settings.pause_mode == "abort":
            body["abort_all_requests"] = True
        self._post(server, "/update_weights_from_disk", body)

    def _headers(self) -> dict[str, str]:
        return sglang_headers(self.settings.api_key_file)

    def _check(self, view: Path, path: str) -> None:
        """The view's files (hard links to `path`'s: what the server will read) against `path`'s manifest; a file
        checked once is not read again (the same inode, size and mtime: every server, every worker sharing it).
        WeightsError naming the file when one is torn or changed: refused, counted once per directory."""
        key = tuple((file.name, *_identity(file)) for file in sorted(view.iterdir()))
        if key in self.checked:
            problem = self.checked[key]
        else:
            problem = self.checked[key] = manifest_problem(view)
            while len(self.checked) > CHECKS_KEPT:
                del self.checked[next(iter(self.checked))]
            if problem is not None:
                self._refused(path, problem)
        if problem is not None:
            raise WeightsError(f"{path}: {problem}; not loaded into any server (policy version stays "
                               f"{self.version})")

    def _refused(self, path: str, problem: str) -> None:
        if path not in self.refused_paths:
            self.refused_paths.add(path)
            self.weights_refused += 1
            log.error("%s weights %s fail their check (%s): refused, never sent to a server", self.kind, path,
                      problem)

    def _live_versions(self, wait: bool) -> list[int]:
        while True:
            versions = []
            for server in self._live():
                try:
                    versions.append(self._server_version(server))
                except ServerFailed:
                    continue
            if versions or not wait:
                return versions
            self._wait_for_a_server()

    def _server_version(self, server: Server) -> int:
        return parse_version(self._get(server, "/get_model_info").get("weight_version"))

    # --- servers ----------------------------------------------------------------------------------

    def _live(self) -> list[Server]:
        """Live servers; a dead one is probed again (cheap GET /health) once in a while and rejoins if it answers."""
        now = time.monotonic()
        for server in self.servers:
            if not server.alive and now - server.dead_since >= REPROBE_DEAD_EVERY_S:
                self._probe(server)
        return [s for s in self.servers if s.alive]

    def _probe(self, server: Server) -> bool:
        """Ask a dead server GET /health; if it answers it rejoins (and, with disk sync, loads the latest weights)."""
        server.dead_since = time.monotonic()
        try:
            self._get(server, "/health", timeout=PROBE_TIMEOUT_S)
        except ServerFailed:
            return False
        server.alive = True
        log.warning("%s server %s answers again; using it", self.kind, server.url)
        if self.latest_disk is not None:
            version, path = self.latest_disk
            try:
                if self._server_version(server) < version:
                    self._load_from_disk([server], version, path)
            except (ServerFailed, RuntimeError, OSError) as exc:  # pruned, nothing newer: its tokens carry its version
                log.warning("%s rejoined behind version %d and could not load it: %s", server.url, version, exc)
        return server.alive

    def _mark_dead(self, server: Server, reason: str) -> None:
        if server.alive:
            log.error("%s server %s lost: %s", self.kind, server.url, reason)
        server.alive, server.dead_since, server.last_error = False, time.monotonic(), reason[:500]

    def _request(self, server: Server, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, server.url + path, **kwargs)
        except (httpx.HTTPError, RuntimeError) as exc:  # RuntimeError: the client was closed under the request
            if self.closed.is_set():  # closed while it ran: nobody waits for it, and the server is fine
                raise ServerFailed(f"{server.url}{path}: the engine was closed") from exc
            if not isinstance(exc, httpx.HTTPError):
                raise
            self._mark_dead(server, f"{path}: {type(exc).__name__}: {exc}")
            raise ServerFailed(f"{server.url}{path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500:
            self._mark_dead(server, f"{path}: HTTP {response.status_code}")
            raise ServerFailed(f"{server.url}{path}: HTTP {response.status_code}: {response.text[:200]}")
        return response

    def _post(self, server: Server, path: str, body: dict) -> Any:
        response = self._request(server, "POST", path, json=body)
        if response.status_code != 200:
            raise RuntimeError(f"{server.url}{path} refused the request: HTTP {response.status_code}: "
                               f"{response.text[:300]}")
        return response.json()

    def _get(self, server: Server, path: str, timeout: float | None = None) -> Any:
        kwargs = {"timeout": timeout} if timeout is not None else {}
        response = self._request(server, "GET", path, **kwargs)
        if response.status_code != 200:
            raise ServerFailed(f"{server.url}{path}: HTTP {response.status_code}")
        return response.json() if response.content else {}

    def close(self) -> None:
        """Stop: a `generate` waiting in another thread raises EngineStopped within POLL_S."""
        self.closed.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()


def _piece(reply: dict) -> Piece:
    """One /generate result. An abort without a status code is a preemption (a weight update, /abort_request):
    its partial output comes back with log-probs (docs/sglang-notes.md). One with a status code is the server
    refusing or failing that request (out of memory, a bad request, a timeout)."""
    meta = reply["meta_info"]
    finish = meta["finish_reason"] or {}
    entries = meta.get("output_token_logprobs") or []
    versions = [parse_version(meta.get("weight_version"))] * len(entries)
    for segment in meta.get("weight_versions") or []:
        version = parse_version(segment["version"])
        for position in range(segment["start"], min(segment["end"], len(entries))):
            versions[position] = version
    piece = Piece(
        token_ids=[int(token) for _, token, _ in entries],
        logprobs=[float(logprob) for logprob, _, _ in entries],
        versions=versions,
        finish="stop" if finish.get("type") == "stop" else "length",
    )
    if finish.get("type") == "abort":
        piece.finish = "preempted" if finish.get("status_code") is None else "refused"
        piece.message = str(finish.get("message"))
    return piece
