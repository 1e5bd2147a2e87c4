"""The SGLang engine: a client of SGLang's native HTTP API, behind the same interface as the built-in engine.

A batch of prompts is split over the live servers of `rollout.sglang.urls` (or one sglang-router URL) and sent
as one `/generate` call per server, concurrently, with `return_logprob`. Every generated token carries the
behaviour log-prob SGLang sampled it with (log_softmax(logits / temperature), the full distribution even under
top-p: the same quantity `async_rl.loss.token_logprobs` recomputes) and the server's `weight_version` for that
token position (`meta_info.weight_versions` splits a request that lived across an update).

Failures lose no accounting: a server that fails a request (connection refused, timeout, 5xx) is marked dead
and its share of the batch is sent again, whole, to a live server, at most `max_retries` times. Only a finished
batch is returned, so a stage is streamed once or not at all; when no server is left, `generate` raises
`EngineUnavailable` and the agent reports the affected trajectories abandoned. A request a server aborted (a
weight update in `abort` pause mode) is sent again the same way.

Weight sync: with `weight_sync: disk` the engine loads each published HF directory into every server with
`/update_weights_from_disk` (pause_mode abort: after /pause_generation, then /continue_generation; in_place:
running requests finish on the old weights first); servers already at that version (another worker sharing them
got there first) are skipped. With `weight_sync: distributed` the learner pushes the weights
itself and the engine only reads the servers' new version.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from async_rl.config import SGLangConfig
from rollout.engines.base import EngineUnavailable, Generation, SamplingParams

log = logging.getLogger("async_rl.rollout")

HEALTH_TIMEOUT_S = 30.0  # /health_generate runs a real one-token generation
REPROBE_DEAD_EVERY_S = 10.0  # a dead server is asked again (GET /health) at most this often

logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would drown the worker's log


class ServerFailed(Exception):
    """One server failed one request; the caller retries elsewhere."""


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


class SGLangEngine:
    def __init__(self, config: SGLangConfig) -> None:
        if not config.urls:
            raise EngineUnavailable("rollout.sglang.urls: no SGLang server configured")
        self.config = config
        self.servers = [Server(url.rstrip("/")) for url in config.urls]
        self.http = httpx.Client(timeout=config.request_timeout_s)
        self.pool = ThreadPoolExecutor(max_workers=len(self.servers), thread_name_prefix="sglang")
        self.stages_retried = 0  # server shares sent again after a failure or an abort
        for server in self.servers:
            try:
                self._get(server, "/health_generate", timeout=min(HEALTH_TIMEOUT_S, config.request_timeout_s))
            except ServerFailed as exc:
                self._mark_dead(server, f"health check failed: {exc}")
        self.version = min(self._live_versions())
        log.info("SGLang engine: %d/%d server(s) healthy at version %d", len(self._live()), len(self.servers),
                 self.version)

    # --- generation -------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("SGLangEngine.generate: every prompt needs at least one token")
        results: list[Generation | None] = [None] * len(prompts)
        pending = list(range(len(prompts)))
        for attempt in range(self.config.max_retries + 1):
            live = self._live()
            if not live:
                raise EngineUnavailable(f"no SGLang server left of {[s.url for s in self.servers]}")
            shares = [pending[i :: len(live)] for i in range(len(live))]
            jobs = [
                (server, rows, self.pool.submit(self._generate_on, server, [prompts[r] for r in rows], params))
                for server, rows in zip(live, shares, strict=True)
                if rows
            ]
            pending = []
            for server, rows, job in jobs:
                try:
                    generations = job.result()
                except ServerFailed as exc:
                    self._mark_dead(server, str(exc))
                    pending += rows
                    continue
                for row, generation in zip(rows, generations, strict=True):
                    if generation is None:  # aborted by the server (an update in abort mode): ask again
                        pending.append(row)
                    else:
                        results[row] = generation
            if not pending:
                return results  # type: ignore[return-value]
            pending.sort()
            self.stages_retried += len(pending)
            log.warning("%d prompt(s) to send again (attempt %d of %d)", len(pending), attempt + 1,
                        self.config.max_retries)
        raise EngineUnavailable(f"{len(pending)} prompt(s) still failing after {self.config.max_retries} retries")

    def _generate_on(self, server: Server, prompts: list[list[int]], params: SamplingParams) -> list[Generation | None]:
        """One batched /generate on one server; an aborted row comes back as None."""
        body = {
            "input_ids": prompts,
            "sampling_params": {
                "temperature": params.temperature,
                "top_p": params.top_p,
                "max_new_tokens": params.max_new_tokens,
                "stop_token_ids": params.stop_token_ids,
                # SGLang stops at the model's EOS unless ignore_eos, which also disables stop_token_ids: so EOS
                # ends a row here only when stop tokens are asked for (the agent always lists EOS among them).
                "ignore_eos": not params.stop_token_ids,
            },
            "return_logprob": True,
        }
        replies = self._post(server, "/generate", body)
        if not isinstance(replies, list) or len(replies) != len(prompts):
            raise ServerFailed(f"{server.url}/generate: expected {len(prompts)} results, got {replies!r:.200}")
        return [_generation(reply) for reply in replies]

    # --- weights ----------------------------------------------------------------------------------

    def update_weights(self, version: int, path: str) -> None:
        """Bring every live server to `version`: load the HF directory `path` (disk sync), or, when the learner
        pushes the weights itself (distributed sync), just take note of the servers' version."""
        for server in self._live():
            try:
                if self.config.weight_sync == "disk" and self._server_version(server) < version:
                    self._load_from_disk(server, version, path)  # servers already there are skipped: idempotent
            except ServerFailed:
                continue  # marked dead; later batches go to the others
        self.version = min(self._live_versions())
        log.info("policy version %d on %d server(s)", self.version, len(self._live()))

    def _load_from_disk(self, server: Server, version: int, path: str) -> None:
        """in_place: SGLang's update waits for the running requests to finish on the old weights, then loads.
        abort: pause with abort first; the aborted requests come back and their owners send them again.
        (An in_place *pause* is not used here: another worker's update would wait forever on requests it froze.)"""
        abort = self.config.pause_mode == "abort"
        if abort:
            self._post(server, "/pause_generation", {"mode": "abort"})
        try:
            self._post(server, "/update_weights_from_disk", {"model_path": path, "weight_version": str(version)})
        finally:
            if abort:
                self._post(server, "/continue_generation", {})
        log.info("%s: policy version %d loaded from %s", server.url, version, path)

    def _live_versions(self) -> list[int]:
        versions = []
        for server in self._live():
            try:
                versions.append(self._server_version(server))
            except ServerFailed:
                continue
        if not versions:
            raise EngineUnavailable(f"no SGLang server left of {[s.url for s in self.servers]}")
        return versions

    def _server_version(self, server: Server) -> int:
        return parse_version(self._get(server, "/get_model_info").get("weight_version"))

    # --- servers ----------------------------------------------------------------------------------

    def _live(self) -> list[Server]:
        """Live servers; a dead one is probed again (cheap GET /health) once in a while and rejoins if it answers."""
        now = time.monotonic()
        for server in self.servers:
            if not server.alive and now - server.dead_since >= REPROBE_DEAD_EVERY_S:
                server.dead_since = now
                try:
                    self._get(server, "/health", timeout=5.0)
                except ServerFailed:
                    continue
                server.alive = True
                log.warning("SGLang server %s answers again; using it", server.url)
        return [s for s in self.servers if s.alive]

    def _mark_dead(self, server: Server, reason: str) -> None:
        if server.alive:
            log.error("SGLang server %s lost: %s", server.url, reason)
        server.alive, server.dead_since = False, time.monotonic()

    def _request(self, server: Server, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, server.url + path, **kwargs)
        except httpx.HTTPError as exc:
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
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()


def _generation(reply: dict) -> Generation | None:
    """One /generate result as a Generation, or None when the server aborted it."""
    meta = reply["meta_info"]
    finish = meta["finish_reason"]["type"]
    if finish == "abort":
        return None
    entries = meta["output_token_logprobs"]
    versions = [parse_version(meta.get("weight_version"))] * len(entries)
    for segment in meta.get("weight_versions") or []:
        version = parse_version(segment["version"])
        for position in range(segment["start"], min(segment["end"], len(entries))):
            versions[position] = version
    return Generation(
        token_ids=[int(token) for _, token, _ in entries],
        logprobs=[float(logprob) for logprob, _, _ in entries],
        versions=versions,
        finish_reason="stop" if finish == "stop" else "length",
    )
