"""The learner's `distributed` transport to SGLang servers (`rollout.sglang.weight_sync: distributed`): SGLang's
HTTP calls around the broadcast of async_rl/weights/distributed.py, as an `async_rl.weights` publisher.

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
from typing import Any

import httpx
import torch

from async_rl.config import SGLangConfig
from async_rl.protocol import WeightsPublished
from async_rl.security import sglang_headers
from async_rl.weights.distributed import BroadcastGroup

log = logging.getLogger("async_rl.learner")

GROUP_NAME = "async_rl_weights"
CACHE_NOT_FLUSHED = "cache was not flushed"  # SGLang's 400 after an in_place update: the weights did change

logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would drown the learner's log


class DistributedWeightSync:
    """The learner's side of SGLang's weight-update group: rank 0 here, the servers' ranks after it. An
    `async_rl.weights.base.Publisher` of format "distributed" (nothing on disk: `write` pushes, `prune` has nothing
    to remove)."""

    format = "distributed"

    def __init__(self, config: SGLangConfig) -> None:
        self.config = config
        self.urls = [url.rstrip("/") for url in config.urls]
        self.http = httpx.Client(timeout=config.request_timeout_s, headers=sglang_headers(config.api_key_file))
        self.threads = ThreadPoolExecutor(max_workers=len(self.urls), thread_name_prefix="sglang-sync")
        tp_sizes = [int(self._call(url, "GET", "/get_server_info").get("tp_size", 1)) for url in self.urls]
        self.world_size = 1 + sum(tp_sizes)
        offsets = [1 + sum(tp_sizes[:i]) for i in range(len(self.urls))]
        for url in self.urls:  # a learner that died left its group behind on the server
            self.http.post(url + "/destroy_weights_update_group", json={"group_name": GROUP_NAME})
        joins = [
            self.threads.submit(self._call, url, "POST", "/init_weights_update_group", {
                "master_address": config.dist_master_addr,
                "master_port": config.dist_master_port,
                "rank_offset": offset,
                "world_size": self.world_size,
                "group_name": GROUP_NAME,
                "backend": config.dist_backend,
            })
            for url, offset in zip(self.urls, offsets, strict=True)
        ]
        self.group = BroadcastGroup(config.dist_master_addr, config.dist_master_port, self.world_size,
                                    config.dist_backend, GROUP_NAME)
        for join in joins:
            join.result()
        log.info("weight-update group with %d SGLang server(s) (world %d, %s)", len(self.urls), self.world_size,
                 config.dist_backend)

    def push(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Every server takes `state_dict` as policy `version`; generation is paused around the update."""
        tensors = self.group.on_device(state_dict)
        body = {
            "names": list(tensors),
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()],
            "group_name": GROUP_NAME,
            "weight_version": str(version),
        }
        self._on_all("/pause_generation", {"mode": self.config.pause_mode})
        try:
            self._on_all("/begin_weight_update", {})
            try:
                updates = [self.threads.submit(self._update, url, body) for url in self.urls]
                self.group.broadcast(tensors)
                for update in updates:
                    update.result()
            finally:
                self._on_all("/end_weight_update", {})
        finally:
            self._on_all("/continue_generation", {})
        log.info("policy version %d pushed to %d server(s)", version, len(self.urls))

    def write(self, state_dict: dict[str, torch.Tensor], version: int) -> WeightsPublished:
        self.push(state_dict, version)
        return WeightsPublished(version=version, path="", format="distributed")

    def prune(self, keep: int) -> None:
        """Nothing on disk to remove."""

    def _update(self, url: str, body: dict) -> None:
        response = self.http.post(url + "/update_weights_from_distributed", json=body)
        if response.status_code == 400 and CACHE_NOT_FLUSHED in response.text:
            # The weights and the tokens' version did change; /get_model_info keeps the old label until told.
            # abort_all_requests defaults to true there: it would abort the very requests frozen in place.
            self._call(url, "POST", "/update_weight_version",
                       {"new_version": body["weight_version"], "abort_all_requests": False})
            log.info("%s: updated while requests ran in place; cache flush deferred", url)
        elif response.status_code != 200:
            raise RuntimeError(f"{url}/update_weights_from_distributed: HTTP {response.status_code}: "
                               f"{response.text[:300]}")

    def _on_all(self, path: str, body: dict) -> None:
        for call in [self.threads.submit(self._call, url, "POST", path, body) for url in self.urls]:
            call.result()

    def _call(self, url: str, method: str, path: str, body: dict | None = None) -> Any:
        response = self.http.request(method, url + path, json=body)
        if response.status_code != 200:
            raise RuntimeError(f"{url}{path}: HTTP {response.status_code}: {response.text[:300]}")
        return response.json() if response.content else {}

    def close(self) -> None:
        for url in self.urls:
            try:
                self.http.post(url + "/destroy_weights_update_group", json={"group_name": GROUP_NAME})
            except httpx.HTTPError as exc:
                log.warning("%s: could not leave the weight-update group: %s", url, exc)
        self.group.close()
        self.threads.shutdown(wait=False)
        self.http.close()
