"""Publishing weights to SGLang rollout servers, by either path of `rollout.sglang.weight_sync`.

    disk:         <run_dir>/weights/hf-v{N}/ (config.json + model.safetensors), then WeightsPublished(format="hf-dir");
                  each rollout worker has its servers load it with /update_weights_from_disk.
    distributed:  the learner (rank 0) pushes every tensor to every server over a torch.distributed group it
                  owns with them, then WeightsPublished(format="distributed") tells the workers the version moved:
                  /init_weights_update_group once, then per version
                  /pause_generation → /begin_weight_update → /update_weights_from_distributed (+ one broadcast
                  per tensor) → /end_weight_update → /continue_generation.

The server-side HTTP calls of the distributed path block until the learner joins the collective, so they run on
threads while this thread broadcasts.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist
import zmq
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

from async_rl.config import Config, SGLangConfig
from async_rl.durable import write_manifest
from async_rl.hf_io import prune_stale_load_views
from async_rl.model import WeightsError, save_weights
from async_rl.protocol import WeightsPublished
from async_rl.security import CurveKeys, load_keys, sglang_headers
from learner.publisher import WeightPublisher

log = logging.getLogger("async_rl.learner")

GROUP_NAME = "async_rl_weights"
GROUP_TIMEOUT = datetime.timedelta(minutes=5)
CACHE_NOT_FLUSHED = "cache was not flushed"  # SGLang's 400 after an in_place update: the weights did change
HF_FILES = ("config.json", "generation_config.json")

logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would drown the learner's log


def write_hf_dir(state_dict: dict[str, torch.Tensor], model_dir: Path, target: Path) -> Path:
    """An HF model directory SGLang can load: the model's config files and the new weights, with a manifest of their
    sizes and crc32s (checked by the rollout worker before a server loads it: rollout/engines/sglang.py), made
    atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        for name in HF_FILES:
            if (model_dir / name).exists():
                shutil.copy(model_dir / name, staging / name)
        save_weights(state_dict, staging / "model.safetensors")
        write_manifest(staging)
    except OSError as exc:  # a full disk: WeightsError names the weights file, this the copy
        shutil.rmtree(staging, ignore_errors=True)
        raise WeightsError(f"{staging}: could not write the model directory: {exc}") from None
    except WeightsError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(target, ignore_errors=True)  # a re-publish of the same version
    os.rename(staging, target)
    return target


class DistributedWeightSync:
    """The learner's side of SGLang's weight-update group: rank 0 here, the servers' ranks after it."""

    def __init__(self, config: SGLangConfig) -> None:
        self.config = config
        self.urls = [url.rstrip("/") for url in config.urls]
        self.http = httpx.Client(timeout=config.request_timeout_s, headers=sglang_headers(config))
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
        self.group = self._join_group()
        for join in joins:
            join.result()
        log.info("weight-update group with %d SGLang server(s) (world %d, %s)", len(self.urls), self.world_size,
                 config.dist_backend)

    def _join_group(self) -> dist.ProcessGroup:
        """Build the group exactly as SGLang does on its side (store keys under the group name), as rank 0."""
        store = dist.TCPStore(self.config.dist_master_addr, self.config.dist_master_port, self.world_size,
                              is_master=True, timeout=GROUP_TIMEOUT)
        group, _ = _new_process_group_helper(self.world_size, 0, [], Backend(self.config.dist_backend),
                                             PrefixStore(GROUP_NAME, store), group_name=GROUP_NAME,
                                             timeout=GROUP_TIMEOUT)
        _world.pg_group_ranks[group] = {i: i for i in range(self.world_size)}
        return group

    def push(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Every server takes `state_dict` as policy `version`; generation is paused around the update."""
        device = "cuda" if self.config.dist_backend == "nccl" else "cpu"
        tensors = {name: t.detach().to(device).contiguous() for name, t in state_dict.items()}
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
                for tensor in tensors.values():
                    dist.broadcast(tensor, src=0, group=self.group)
                for update in updates:
                    update.result()
            finally:
                self._on_all("/end_weight_update", {})
        finally:
            self._on_all("/continue_generation", {})
        log.info("policy version %d pushed to %d server(s)", version, len(self.urls))

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
        dist.destroy_process_group(self.group)
        self.threads.shutdown(wait=False)
        self.http.close()


class SGLangWeightPublisher(WeightPublisher):
    """The WeightPublisher for `rollout.engine: sglang`: HF directories (disk) or a push to the servers."""

    def __init__(self, context: zmq.Context, endpoint: str, weights_dir: Path, keep: int, model_dir: Path,
                 config: SGLangConfig, curve: CurveKeys | None = None) -> None:
        super().__init__(context, endpoint, weights_dir, keep, curve)
        self.model_dir = model_dir
        self.sync = DistributedWeightSync(config) if config.weight_sync == "distributed" else None

    def _write(self, state_dict: dict[str, torch.Tensor], version: int) -> WeightsPublished:
        if self.sync is not None:
            self.sync.push(state_dict, version)
            return WeightsPublished(version=version, path="", format="distributed")
        path = write_hf_dir(state_dict, self.model_dir, self.weights_dir / f"hf-v{version}")
        return WeightsPublished(version=version, path=str(path), format="hf-dir")

    def _prune(self) -> None:
        dirs = sorted(self.weights_dir.glob("hf-v*"), key=lambda p: int(p.name[4:]))
        for old in dirs[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)  # a worker loading it reads its own links (rollout/engines/sglang)
        prune_stale_load_views(self.weights_dir)

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
        super().close()


def make_publisher(context: zmq.Context, config: Config, model_dir: Path) -> WeightPublisher:
    """The publisher the learner's rank 0 uses, by `rollout.engine`."""
    learner, weights_dir, curve = config.learner, config.run_dir / "weights", load_keys(config, "learner")
    if config.rollout.engine == "sglang":
        return SGLangWeightPublisher(context, learner.publish_endpoint, weights_dir, learner.keep_weights,
                                     model_dir, config.rollout.sglang, curve)
    return WeightPublisher(context, learner.publish_endpoint, weights_dir, learner.keep_weights, curve)
