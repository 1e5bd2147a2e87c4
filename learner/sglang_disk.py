"""The learner loads each `disk` version into the SGLang servers itself, with their admin key.

SGLang servers started with `--admin-api-key` as well as `--api-key` take only the admin key on their weight,
pause and abort routes (`/update_weights_from_disk` among them), and the API key only on generation and reads. The
rollout workers hold the API key alone (a compromised worker can generate and nothing else), so with an admin key
(`rollout.sglang.admin_key_file`) the worker cannot load a version from disk as it does without one
(rollout/engines/sglang.py). Here the learner's rank 0 writes the HF directory as before, has every server load it
(`/update_weights_from_disk`, labelled with the version; with `pause_mode: abort`, running requests aborted), and
announces it as "distributed": in the servers already, nothing for a worker to load, each reads the servers'
version and labels its tokens with the version the server reports (as with the broadcast, learner/sglang_sync.py).

A server that fails the load or does not answer is logged and skipped: it keeps its older version, which its tokens
carry, and loads the next version the learner publishes. Nothing waits on it longer than
`rollout.sglang.request_timeout_s`.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import torch

from async_rl.errors import WeightsError
from async_rl.protocol import WeightsPublished
from async_rl.security import server_tls
from async_rl.weights.hf_dir import HFDirPublisher
from learner.settings import SGLangSyncSettings

log = logging.getLogger("async_rl.learner")

KEY_CHECK_GROUP = "async-rl-key-check"  # a weight-update group no one joins: leaving it changes nothing


class ServerDiskLoad:
    """A `Publisher` (async_rl/weights/base.py) of format "distributed": `hf_dir` writes each version, then every
    server of `config.urls` loads it, called with `admin_headers` (the admin key's)."""

    format = "distributed"

    def __init__(self, hf_dir: HFDirPublisher, config: SGLangSyncSettings, admin_headers: dict[str, str]) -> None:
        self.hf_dir, self.config = hf_dir, config
        self.urls = [url.rstrip("/") for url in config.urls]
        self.admin = httpx.Client(timeout=config.request_timeout_s, headers=admin_headers,
                                  verify=server_tls(config.urls, config.ca_file, "rollout.sglang.ca_file"))
        self.threads = ThreadPoolExecutor(max_workers=max(1, len(self.urls)), thread_name_prefix="disk-load")
        for url in self.urls:
            self._check_key(url)

    def _check_key(self, url: str) -> None:
        """Refuse at start a key the server refuses on its admin routes (else every version would fail to load and
        the run would train on without publishing): a call that changes nothing (leaving a group that no one has
        joined). A server that does not answer yet is left to the loads."""
        try:
            reply = self.admin.post(url + "/destroy_weights_update_group", json={"group_name": KEY_CHECK_GROUP})
        except httpx.HTTPError:
            return
        if reply.status_code in (401, 403):
            raise WeightsError(f"{url}: HTTP {reply.status_code}: the server refuses the learner's admin key "
                               "(rollout.sglang.admin_key_file or SGLANG_ADMIN_API_KEY) on the routes that load "
                               "weights: give the learner the key the servers run with --admin-api-key "
                               "(docs/sglang.md#keys)")

    def write(self, state_dict: dict[str, torch.Tensor], version: int) -> WeightsPublished:
        """Write version `version`, load it into every server that answers; WeightsError when none took it (the
        learner then announces nothing and the next version tries again)."""
        notice = self.hf_dir.write(state_dict, version)
        loads = {url: self.threads.submit(self._load, url, notice.path, version) for url in self.urls}
        failed = {url: problem for url, load in loads.items() if (problem := load.result()) is not None}
        for url, problem in failed.items():
            log.error("%s did not load policy version %d (%s); it generates on its older weights, labelled as such, "
                      "until a later version loads", url, version, problem)
        if len(failed) == len(self.urls):
            raise WeightsError(f"no SGLang server loaded {notice.path} (policy version {version}): "
                               + "; ".join(f"{url}: {problem}" for url, problem in failed.items()))
        log.info("policy version %d loaded into %d/%d SGLang server(s) from %s", version,
                 len(self.urls) - len(failed), len(self.urls), notice.path)
        return WeightsPublished(version=version, path=notice.path, format=self.format)

    def _load(self, url: str, path: str, version: int) -> str | None:
        """One server loads `path` as `version`: None, or what went wrong."""
        body: dict[str, Any] = {"model_path": path, "weight_version": str(version)}
        if self.config.pause_mode == "abort":
            body["abort_all_requests"] = True
        try:
            response = self.admin.post(url + "/update_weights_from_disk", json=body)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        if response.status_code != 200:
            return f"HTTP {response.status_code}: {response.text[:300]}"
        return None

    def prune(self, keep: int) -> None:
        """The servers hold what they loaded in memory: older directories go as without the admin key."""
        self.hf_dir.prune(keep)

    def close(self) -> None:
        self.threads.shutdown(wait=False)
        self.admin.close()
