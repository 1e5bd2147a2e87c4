"""The vLLM engine: a client of vLLM's token-in/token-out and RL HTTP routes, behind the same interface as SGLang's.

Everything but the wire is the SGLang engine's (rollout/engines/sglang.py, subclassed): rows split over the live
servers of `rollout.vllm.urls`, preempted rows continued as partial rollouts, failed servers marked dead and their
rows re-sent, no server at all waited for, HF directories checked against their manifest and loaded from a view
of hard links. What differs is how one server is spoken to (vLLM 0.32, started as scripts/start_vllm_server.py
does):

* **Generation**: one `POST /inference/v1/generate` per row (`--enable-scale-out`; vLLM batches the rows that are
  in flight together): `token_ids` in, `token_ids` out, never detokenized and tokenized again; `logprobs: 0`
  gives the sampled token's log-prob, which `--logprobs-mode processed_logprobs` makes log_softmax(logits /
  temperature) (top-p, if asked for, also renormalizes it: keep `rollout.top_p` 1); each choice's
  `weight_versions` spans say which weights sampled each token. EOS ends a row only when stop tokens are asked for
  (as SGLang: `ignore_eos` otherwise); a stop token or stop string is kept in the output
  (`include_stop_str_in_output`; stop strings need `detokenize`, so the server's tokenizer). A reply with
  `finish_reason` "abort" (a weight update's `/pause?mode=abort`) is a preemption; a 4xx is the server refusing
  that row; 5xx or no answer, a failed server.
* **Version**: `GET /weight_info` ("default" at start: version 0).
* **Weight update** of one server from an "hf-dir" notice (`weight_sync: disk`), holding its scheduler paused so
  that no token is sampled between the load and the label (`VLLM_SERVER_DEV_MODE=1` routes): `POST /pause?mode=`
  (pause_mode in_place: `wait`, running rows finish on the old weights; abort: `abort`, they come back aborted and
  are continued; keep: `keep`, they are frozen and go on in the server on the new weights, the version spans
  recording where), `POST /collective_rpc` `reload_weights` with `weights_path` (vLLM's in-place reload from an HF
  directory), `POST /update_weight_version`, then always `POST /resume`.
* **"distributed"** (`weight_sync: distributed`): the learner pushed the weights itself, over NCCL/gloo into the
  servers' `async_rl` weight-transfer backend (learner/vllm_sync.py, scripts/vllm_plugin/), under the same pause;
  the engine only takes note of the servers' version (the SGLang engine's loader).
* **"lora-adapter"** (`rollout.vllm.lora: adapter` under `learner.lora`): each version's adapters alone, a PEFT
  directory checked against its manifest and loaded into every live server (`POST /v1/load_lora_adapter`) from a
  view of hard links under a name of its own (`async-rl-<engine>-<n>-v<N>`, the engine's n-th load: workers sharing
  a server never unload each other's, and a version published again after the learner resumed from a checkpoint is
  a new adapter); new rows name the last loaded (`model`), and every token of a row carries the version of the
  adapter it was sent with: a row runs to its end on that adapter, so an update needs no pause and preempts
  nothing. The last `ADAPTERS_KEPT` loaded stay loaded (and their views on disk: vLLM may read an adapter again
  after evicting it from its CPU cache); older ones no row of this engine still runs on are unloaded and their
  views removed. A server that rejoins loads the current one.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import shutil
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from async_rl.config import VLLM_PAUSE_MODES
from async_rl.security import vllm_headers
from async_rl.weights.hf_dir import ADAPTER_FILE, load_view
from rollout.engines.base import SamplingParams
from rollout.engines.sglang import Piece, Server, ServerFailed, SGLangEngine, parse_version
from rollout.settings import VLLMSettings

log = logging.getLogger("async_rl.rollout")

ROWS_PER_SERVER = 64  # rows one engine keeps in flight on one server at most (one HTTP request each)
ADAPTERS_KEPT = 2  # LoRA adapters an engine keeps loaded in its servers: the current one and the one before


class Adapter:
    """A LoRA adapter this engine loaded into its servers: its version, its name there, the view they read."""

    def __init__(self, version: int, name: str, view: Path) -> None:
        self.version, self.name, self.view = version, name, view


class VLLMEngine(SGLangEngine):
    kind, section = "vLLM", "vllm"
    health_path = "/health"

    def __init__(self, settings: VLLMSettings, stop: threading.Event | None = None) -> None:
        self.rows = ThreadPoolExecutor(max_workers=ROWS_PER_SERVER * max(1, len(settings.urls)),
                                       thread_name_prefix="vllm-row")
        self.adapters: list[Adapter] = []  # loaded into the servers, in the order loaded (the last is the current)
        self.rows_on = collections.Counter[str]()  # rows in flight on each adapter, by name
        self.adapter_lock = threading.Lock()
        self.loads = 0  # adapters loaded so far (each one's name is new)
        self.name = f"async-rl-{uuid.uuid4().hex[:8]}"  # this engine's adapters' prefix
        super().__init__(settings, stop)
        self.loaders["lora-adapter"] = self._load_adapter

    def _headers(self) -> dict[str, str]:
        return vllm_headers(self.settings.api_key_file)

    # --- generation -------------------------------------------------------------------------------

    def _generate_on(self, server: Server, requests: list[tuple[list[int], int]],
                     params: SamplingParams) -> list[Piece]:
        """The rows of one share, each its own request, all in flight at once; ServerFailed if any failed."""
        jobs = [self.rows.submit(self._generate_row, server, ids, max_new_tokens, params)
                for ids, max_new_tokens in requests]
        pieces, failure = [], None
        for job in jobs:
            try:
                pieces.append(job.result())
            except ServerFailed as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        return pieces

    def _generate_row(self, server: Server, ids: list[int], max_new_tokens: int, params: SamplingParams) -> Piece:
        """One row on the current adapter (if any: every token carries its version) or on the base weights."""
        with self.adapter_lock:
            adapter = self.adapters[-1] if self.adapters else None
            if adapter is not None:
                self.rows_on[adapter.name] += 1
        try:
            piece = self._generate_row_on(server, ids, max_new_tokens, params, adapter)
        finally:
            if adapter is not None:
                with self.adapter_lock:
                    self.rows_on[adapter.name] -= 1
        if adapter is not None:
            piece.versions[:] = [adapter.version] * len(piece.versions)
        return piece

    def _generate_row_on(self, server: Server, ids: list[int], max_new_tokens: int, params: SamplingParams,
                         adapter: Adapter | None) -> Piece:
        sampling = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": max_new_tokens,
            "logprobs": 0,
            "stop_token_ids": params.stop_token_ids,
            "ignore_eos": not params.stop_token_ids,
            "detokenize": bool(params.stop),
            **({"stop": params.stop, "include_stop_str_in_output": True} if params.stop else {}),
        }
        body = {"token_ids": ids, "sampling_params": sampling, **({"model": adapter.name} if adapter else {})}
        response = self._request(server, "POST", "/inference/v1/generate", json=body)
        if response.status_code != 200:
            return Piece([], [], [], "refused", f"HTTP {response.status_code}: {response.text[:300]}")
        try:
            return _piece(response.json()["choices"][0])
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ServerFailed(f"{server.url}/inference/v1/generate: unreadable reply ({exc!r}): "
                               f"{response.text[:200]}") from exc

    # --- weights ----------------------------------------------------------------------------------

    def _server_version(self, server: Server) -> int:
        return parse_version(self._get(server, "/weight_info").get("weight_version"))

    def _load_into(self, server: Server, view: Path, version: int) -> None:
        """Pause `server` (by pause_mode), reload its weights from `view`, label them `version`, resume it."""
        mode = VLLM_PAUSE_MODES[self.settings.pause_mode]
        # "wait" lasts as long as the longest running request (each bounded by request_timeout_s).
        self._call(server, f"/pause?mode={mode}", {}, timeout=2 * self.settings.request_timeout_s + 10)
        resumed = False
        try:
            self._call(server, "/collective_rpc", {"method": "reload_weights",
                                                   "kwargs": {"weights_path": str(view)}})
            self._call(server, "/update_weight_version", {"new_version": str(version)})
            resumed = True
            self._call(server, "/resume", {})
        finally:
            if not resumed:  # a failed load still resumes the server (its tokens then carry its old version)
                with contextlib.suppress(ServerFailed, RuntimeError):
                    self._call(server, "/resume", {})

    def _load_adapter(self, version: int, path: str) -> None:
        """The "lora-adapter" loader: `path` (a lora-v<N>/ directory) checked against its manifest and loaded into
        every live server from a view of hard links; then the rows sent next run on it. WeightsError when it fails
        its check, FileNotFoundError when the learner has pruned it (the worker loads the next notice's),
        RuntimeError naming the fix when a server cannot load adapters."""
        if not (Path(path) / ADAPTER_FILE).is_file():
            raise FileNotFoundError(f"{path} holds no {ADAPTER_FILE} (pruned by learner.keep_weights: this worker "
                                    "fell behind, or not a lora-v<N> directory)")
        view = load_view(Path(path))
        self.loads += 1
        adapter = Adapter(version, f"{self.name}-{self.loads}-v{version}", view)
        try:
            self._check(view, path)
            for server in self._live():
                with contextlib.suppress(ServerFailed):  # marked dead; it loads the current adapter when it rejoins
                    self._load_adapter_into(server, adapter)
        except BaseException:
            shutil.rmtree(view, ignore_errors=True)
            raise
        with self.adapter_lock:
            self.adapters.append(adapter)
            done = [old for old in self.adapters[:-ADAPTERS_KEPT] if not self.rows_on[old.name]]
            self.adapters = [kept for kept in self.adapters if kept not in done]
        self.version = version
        log.info("policy version %d: LoRA adapter %s loaded from %s", version, adapter.name, path)
        for old in done:
            self._unload(old)

    def _load_adapter_into(self, server: Server, adapter: Adapter) -> None:
        response = self._request(server, "POST", "/v1/load_lora_adapter",
                                 json={"lora_name": adapter.name, "lora_path": str(adapter.view)})
        if response.status_code != 200 and "already" not in response.text:
            raise RuntimeError(
                f"{server.url}/v1/load_lora_adapter refused the LoRA adapter of version {adapter.version}: HTTP "
                f"{response.status_code}: {response.text[:300]}. A server loads adapters when started with "
                "--enable-lora --max-lora-rank R (>= learner.lora.rank) and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 "
                "(scripts/start_vllm_server.py --max-lora-rank R); or set rollout.vllm.lora: merged")

    def _unload(self, adapter: Adapter, timeout: float | None = None) -> None:
        """`adapter` unloaded where the servers answer, and its view removed."""
        for server in self._live():
            with contextlib.suppress(ServerFailed, RuntimeError):
                self._call(server, "/v1/unload_lora_adapter", {"lora_name": adapter.name}, timeout=timeout)
        shutil.rmtree(adapter.view, ignore_errors=True)

    def _probe(self, server: Server) -> bool:
        """As SGLang's, and a server that rejoins loads the current adapter (a restarted one has none)."""
        alive = super()._probe(server)
        with self.adapter_lock:
            adapter = self.adapters[-1] if self.adapters else None
        if alive and adapter is not None:
            try:
                self._load_adapter_into(server, adapter)
            except (ServerFailed, RuntimeError) as exc:
                log.warning("%s rejoined and could not load the LoRA adapter of version %d: %s", server.url,
                            adapter.version, exc)
        return server.alive

    def _call(self, server: Server, path: str, body: dict, timeout: float | None = None) -> None:
        """POST `body`; RuntimeError when the server refuses it (4xx), ServerFailed when it fails."""
        kwargs = {"timeout": timeout} if timeout is not None else {}
        response = self._request(server, "POST", path, json=body, **kwargs)
        if response.status_code != 200:
            raise RuntimeError(f"{server.url}{path} refused the request: HTTP {response.status_code}: "
                               f"{response.text[:300]}")

    def close(self) -> None:
        for adapter in self.adapters:  # each engine loads its own
            self._unload(adapter, timeout=5.0)
        super().close()
        self.rows.shutdown(wait=False, cancel_futures=True)


def _piece(choice: dict) -> Piece:
    """One /inference/v1/generate choice: its tokens, their log-probs, each one's weight version."""
    token_ids = [int(token) for token in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    if [int(entry["token_id"]) for entry in content] != token_ids:
        raise ValueError(f"log-probs for {len(content)} tokens do not match the {len(token_ids)} generated")
    versions = [0] * len(token_ids)
    for span in choice.get("weight_versions") or []:
        version = parse_version(span["version"])
        for position in range(span["start"], min(span["end"], len(token_ids))):
            versions[position] = version
    reason = choice.get("finish_reason")
    finish: Literal["stop", "length", "preempted", "refused"] = (
        "stop" if reason == "stop" else "length" if reason == "length" else
        "preempted" if reason == "abort" else "refused")
    return Piece(token_ids, [float(entry["logprob"]) for entry in content], versions, finish,
                 "" if finish != "refused" else f"finish_reason {reason!r}")
