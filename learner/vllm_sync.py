"""The learner's `distributed` transport to vLLM servers (`rollout.vllm.weight_sync: distributed`): vLLM's
weight-transfer routes around the broadcast of async_rl/weights/distributed.py, as an `async_rl.weights` publisher.

The shape is SGLang's (learner/sglang_sync.py `DistributedWeightSync`, subclassed: the learner is rank 0 of a
torch.distributed group it hosts, gloo or nccl, and broadcasts every tensor while the servers receive on threads);
the calls are vLLM 0.32's, answered on the servers' side by the `async_rl` weight-transfer backend
(scripts/vllm_plugin/, which scripts/start_vllm_server.py asks for with `--weight-transfer-config`):

* once: `/init_weight_transfer_engine` {init_info: master address and port, rank_offset (the server's first rank;
  its ranks are `/get_world_size`'s), world_size, group_name, backend, store_secret (the group store's key, fresh
  for each group: async_rl/weights/keyed_store.py)} (`/shutdown_weight_transfer_engine` first: a learner that died
  left its group behind);
* per version: `/pause?mode=` (rollout.vllm.pause_mode: in_place `wait`, abort `abort`, keep `keep`) →
  `/start_weight_update` → `/update_weights` {update_info: names, dtype_names, shapes} (+ one broadcast per tensor)
  → `/finish_weight_update` {weight_version} (vLLM then sets `/weight_info`'s label, as `/update_weight_version`
  does) → `/resume`, always.

A receive that failed has already ended the update in the server (vLLM's worker drops it), so no finish follows it;
the server resumes on the weights it had, or the ones it got before the failure.
"""

from __future__ import annotations

import httpx

from async_rl.config import VLLM_PAUSE_MODES
from async_rl.weights.keyed_store import new_secret
from learner.settings import VLLMSyncSettings
from learner.sglang_sync import DistributedWeightSync, Tensors


class VLLMWeightSync(DistributedWeightSync):
    """The learner's side of the vLLM servers' weight-update group. `headers`: async_rl/security.py
    `vllm_headers`."""

    kind = "vLLM"
    key_hint = "check rollout.vllm.api_key_file (or VLLM_API_KEY) against the servers' --api-key"
    config: VLLMSyncSettings

    def __init__(self, config: VLLMSyncSettings, headers: dict[str, str]) -> None:
        super().__init__(config, headers)

    def _ranks(self, url: str) -> int:
        return int(self._call(url, "GET", "/get_world_size").get("world_size", 1))

    def _leave(self, url: str) -> httpx.Response:
        return self.http.post(url + "/shutdown_weight_transfer_engine")

    def _store_secret(self) -> bytes:
        return new_secret()  # fresh for each group; the plugin refuses a join without one

    def _join(self, url: str, rank_offset: int) -> None:
        assert self.secret is not None
        init_info = {**self._group(rank_offset), "store_secret": self.secret.hex()}
        self._call(url, "POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def _pause(self) -> None:
        # `wait` lasts as long as the longest running request (each bounded by request_timeout_s).
        self._on_all(f"/pause?mode={VLLM_PAUSE_MODES[self.config.pause_mode]}", {},
                     timeout=2 * self.config.request_timeout_s + 10)

    def _begin(self) -> None:
        self._on_all("/start_weight_update", {})

    def _update(self, url: str, tensors: Tensors, version: int) -> None:
        self._call(url, "POST", "/update_weights", {"update_info": {
            "names": tensors.names, "dtype_names": tensors.dtypes, "shapes": tensors.shapes}})

    def _finish(self, version: int) -> None:
        self._on_all("/finish_weight_update", {"weight_version": str(version)})

    def _abandon(self) -> None:
        """Nothing: the worker whose receive failed ended the update itself (a finish would be refused)."""

    def _resume(self) -> None:
        self._on_all("/resume", {})
