"""The learner's `distributed` transport to SGLang servers (`rollout.sglang.weight_sync: distributed`): SGLang's
HTTP calls around the broadcast of async_rl/weights/distributed.py, as an `async_rl.weights` publisher; and the
shape every server kind's such transport shares (learner/vllm_sync.py, vLLM's, overrides the calls only).

The learner (rank 0) pushes every tensor to every server over a torch.distributed group it owns with them, then
WeightsPublished(format="distributed") tells the workers the version moved: /init_weights_update_group once, then
per version /pause_generation → /begin_weight_update → /update_weights_from_distributed (+ one broadcast per
tensor) → /end_weight_update → /continue_generation. (`disk` sync is async_rl/weights/hf_dir.py's HF directories,
loaded by each worker: rollout/engines/sglang.py.)

The server-side HTTP calls block until the learner joins the collective, so they run on threads while this thread
broadcasts.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from async_rl.protocol import WeightsPublished
from async_rl.security import server_tls
from async_rl.weights.distributed import BroadcastGroup
from learner.settings import SGLangSyncSettings, VLLMSyncSettings

log = logging.getLogger("async_rl.learner")

GROUP_NAME = "async_rl_weights"
CACHE_NOT_FLUSHED = "cache was not flushed"  # SGLang's 400 after an in_place update: the weights did change

logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would drown the learner's log


@dataclass(frozen=True)
class Tensors:
    """What the servers are told of a version's tensors before the broadcast: their names, dtypes ("float32", ...)
    and shapes, in the order they are broadcast."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> Tensors:
        return cls(list(tensors), [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
                   [list(t.shape) for t in tensors.values()])


class DistributedWeightSync:
    """The learner's side of the servers' weight-update group: rank 0 here, the servers' ranks after it. An
    `async_rl.weights.base.Publisher` of format "distributed" (nothing on disk: `write` pushes, `prune` has nothing
    to remove). `headers`: of the HTTP requests to the servers (async_rl/security.py `sglang_headers`);
    `admin_headers`, when the servers have an admin key (`sglang_admin_headers`), of the calls that change them (join,
    pause, update, resume: SGLang's admin routes take that key alone), `headers` then for reads only. The server
    calls are the methods below `push`; a subclass for another server kind overrides them (learner/vllm_sync.py)."""

    format = "distributed"
    kind = "SGLang"
    key_hint = ("servers started with --admin-api-key take that key alone there: give the learner it in "
                "rollout.sglang.admin_key_file or SGLANG_ADMIN_API_KEY (docs/sglang.md#keys)")

    def __init__(self, config: SGLangSyncSettings | VLLMSyncSettings, headers: dict[str, str],
                 admin_headers: dict[str, str] | None = None) -> None:
        self.config = config
        self.urls = [url.rstrip("/") for url in config.urls]
        verify = server_tls(config.urls, config.ca_file, f"rollout.{self.kind.lower()}.ca_file")
        self.http = httpx.Client(timeout=config.request_timeout_s, headers=admin_headers or headers, verify=verify)
        self.reads = (httpx.Client(timeout=config.request_timeout_s, headers=headers, verify=verify) if admin_headers
                      else self.http)
        self.threads = ThreadPoolExecutor(max_workers=len(self.urls), thread_name_prefix="weight-sync")
        ranks = [self._ranks(url) for url in self.urls]
        self.world_size = 1 + sum(ranks)
        offsets = [1 + sum(ranks[:i]) for i in range(len(self.urls))]
        for url in self.urls:  # a learner that died left its group behind on the server
            left = self._leave(url)
            if left.status_code in (401, 403):  # refused here, not as a join the group would wait 300 s for
                raise RuntimeError(f"{url}: HTTP {left.status_code}: the server refuses the learner's key on the "
                                   f"routes that change its weights ({left.request.url.path}): {self.key_hint}")
        # The store first: a port already taken fails here, before any server is asked to join it.
        self.secret = self._store_secret()
        self.group = BroadcastGroup(config.dist_master_addr, config.dist_master_port, self.world_size,
                                    config.dist_backend, GROUP_NAME, self.secret)
        joins = [self.threads.submit(self._join, url, offset) for url, offset in zip(self.urls, offsets, strict=True)]
        self.group.join()
        for join in joins:
            join.result()
        log.info("weight-update group with %d %s server(s) (world %d, %s)", len(self.urls), self.kind,
                 self.world_size, config.dist_backend)

    def push(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Every server takes `state_dict` as policy `version`; generation is paused around the update."""
        tensors = self.group.on_device(state_dict)
        described = Tensors.of(tensors)
        self._pause()
        try:
            self._begin()
            try:
                updates = [self.threads.submit(self._update, url, described, version) for url in self.urls]
                self.group.broadcast(tensors)
                for update in updates:
                    update.result()
            except BaseException:
                self._abandon()
                raise
            self._finish(version)
        finally:
            self._resume()
        log.info("policy version %d pushed to %d server(s)", version, len(self.urls))

    def write(self, state_dict: dict[str, torch.Tensor], version: int) -> WeightsPublished:
        self.push(state_dict, version)
        return WeightsPublished(version=version, path="", format="distributed")

    def prune(self, keep: int) -> None:
        """Nothing on disk to remove."""

    # --- the server calls (SGLang's) ---------------------------------------------------------------

    def _store_secret(self) -> bytes | None:
        """The group store's secret, or None: SGLang's `/init_weights_update_group` takes no secret and joins a plain
        store (docs/architecture.md, "Security": only the network policy guards it)."""
        return None

    def _ranks(self, url: str) -> int:
        """The ranks one server takes in the group (one per tensor-parallel worker)."""
        return int(self._call(url, "GET", "/get_server_info", client=self.reads).get("tp_size", 1))

    def _leave(self, url: str) -> httpx.Response:
        """Leave the group if the server is in one (best effort: before joining, and at close)."""
        return self.http.post(url + "/destroy_weights_update_group", json={"group_name": GROUP_NAME})

    def _join(self, url: str, rank_offset: int) -> None:
        """The server joins the group (blocks until the learner has: called on a thread)."""
        self._call(url, "POST", "/init_weights_update_group", self._group(rank_offset))

    def _group(self, rank_offset: int) -> dict[str, Any]:
        """What a server is told to join: the learner's store, the server's first rank, the group's size."""
        return {"master_address": self.config.dist_master_addr, "master_port": self.config.dist_master_port,
                "rank_offset": rank_offset, "world_size": self.world_size, "group_name": GROUP_NAME,
                "backend": self.config.dist_backend}

    def _pause(self) -> None:
        self._on_all("/pause_generation", {"mode": self.config.pause_mode})

    def _begin(self) -> None:
        self._on_all("/begin_weight_update", {})

    def _update(self, url: str, tensors: Tensors, version: int) -> None:
        """One server receives the broadcast (blocks until it is over: called on a thread) and labels it `version`."""
        response = self.http.post(url + "/update_weights_from_distributed", json={
            "names": tensors.names, "dtypes": tensors.dtypes, "shapes": tensors.shapes, "group_name": GROUP_NAME,
            "weight_version": str(version)})
        if response.status_code == 400 and CACHE_NOT_FLUSHED in response.text:
            # The weights and the tokens' version did change; /get_model_info keeps the old label until told.
            # abort_all_requests defaults to true there: it would abort the very requests frozen in place.
            self._call(url, "POST", "/update_weight_version",
                       {"new_version": str(version), "abort_all_requests": False})
            log.info("%s: updated while requests ran in place; cache flush deferred", url)
        elif response.status_code != 200:
            raise RuntimeError(f"{url}/update_weights_from_distributed: HTTP {response.status_code}: "
                               f"{response.text[:300]}")

    def _finish(self, version: int) -> None:
        self._on_all("/end_weight_update", {})

    def _abandon(self) -> None:
        """After a failed update: SGLang ends it as any other."""
        self._on_all("/end_weight_update", {})

    def _resume(self) -> None:
        self._on_all("/continue_generation", {})

    # --- HTTP ---------------------------------------------------------------------------------------

    def _on_all(self, path: str, body: dict, timeout: float | None = None) -> None:
        """POST `body` to every server at once; RuntimeError if one refused it."""
        for call in [self.threads.submit(self._call, url, "POST", path, body, timeout) for url in self.urls]:
            call.result()

    def _call(self, url: str, method: str, path: str, body: dict | None = None, timeout: float | None = None,
              client: httpx.Client | None = None) -> Any:
        """One request (`timeout`: longer than rollout.<kind>.request_timeout_s, for a call that waits on purpose;
        `client`: `self.reads` for a read, else the admin key's where the servers have one)."""
        response = (client or self.http).request(method, url + path, json=body,
                                                 timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout)
        if response.status_code != 200:
            raise RuntimeError(f"{url}{path}: HTTP {response.status_code}: {response.text[:300]}")
        return response.json() if response.content else {}

    def close(self) -> None:
        for url in self.urls:
            try:
                self._leave(url)
            except httpx.HTTPError as exc:
                log.warning("%s: could not leave the weight-update group: %s", url, exc)
        self.group.close()
        self.threads.shutdown(wait=False)
        self.http.close()
        if self.reads is not self.http:
            self.reads.close()
