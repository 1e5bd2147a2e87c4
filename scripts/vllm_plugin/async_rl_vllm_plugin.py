"""vLLM weight-transfer backend "async_rl": receive the async-rl learner's broadcast of every tensor and load it.

The learner (async_rl/weights/distributed.py `BroadcastGroup`, driven by learner/vllm_sync.py) is rank 0 of a
torch.distributed group it hosts (a TCPStore at master_address:master_port, keys under the group's name, gloo on
CPU or nccl on GPU); each vLLM worker joins it here at rank rank_offset + its rank within the server
(`/init_weight_transfer_engine`), exactly as SGLang's `/init_weights_update_group` joins the same group. A version is
then `/start_weight_update` (vLLM's layerwise reload begins), `/update_weights` with the tensors' names, dtypes and
shapes in the order the learner broadcasts them (each received into a fresh tensor and handed to the model's
`load_weights`, checkpoint names), `/finish_weight_update` (the reload is finalized). vLLM's own backends (nccl,
ipc, ...) need CUDA; this one runs on vLLM's CPU build too.

Registered with vLLM's `WeightTransferEngineFactory` by the `vllm.general_plugins` entry point (loaded in every vLLM
process, the engine core and its workers included); a server uses it with `--weight-transfer-config
'{"backend": "async_rl"}'` (scripts/start_vllm_server.py passes it). Installed into the server venv, without
dependencies, by scripts/build_vllm_env.sh; imports nothing of async-rl.

The group's store is keyed: the learner hands each server a fresh secret (`store_secret`) and every value in the
store is signed with it (`KeyedStore`, a copy of async_rl/weights/keyed_store.py's), so a process that reaches the
learner's TCPStore without the secret cannot join the group or point this worker at itself; a join without a secret
is refused.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, GroupName, PrefixStore, _new_process_group_helper, _world
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "async_rl"  # the name `--weight-transfer-config` asks for
GROUP_TIMEOUT = datetime.timedelta(minutes=5)  # as the learner's (async_rl/weights/distributed.py)


def register() -> None:
    """The entry point: make "async_rl" a weight-transfer backend (idempotent: vLLM may load plugins twice)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, BroadcastWeightTransferEngine)


@dataclass
class BroadcastInitInfo(WeightTransferInitInfo):
    """`/init_weight_transfer_engine`'s init_info: the learner's group (the same keys as SGLang's
    `/init_weights_update_group`)."""

    master_address: str
    master_port: int
    rank_offset: int  # this server's first rank (the learner is 0; servers before it take theirs)
    world_size: int  # the learner and every worker of every server
    group_name: str
    backend: str = "gloo"  # or "nccl"
    store_secret: str = ""  # hex: the key of the group's store (required: a join without one is refused)


@dataclass
class BroadcastUpdateInfo(WeightTransferUpdateInfo):
    """`/update_weights`'s update_info: the tensors of one version, in the order the learner broadcasts them."""

    names: list[str]
    dtype_names: list[str]  # torch dtype names: "float32", "bfloat16", ...
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"{len(self.names)} names, {len(self.dtype_names)} dtype_names, {len(self.shapes)} "
                             "shapes: one of each per tensor")


class BroadcastWeightTransferEngine(WeightTransferEngine[BroadcastInitInfo, BroadcastUpdateInfo]):
    """One vLLM worker's member of the learner's broadcast group."""

    init_info_cls = BroadcastInitInfo
    update_info_cls = BroadcastUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: dist.ProcessGroup | None = None
        self.receive_device = torch.device("cpu")

    def init_transfer_engine(self, init_info: BroadcastInitInfo) -> None:
        """Join the group (blocks until every rank has: the learner joins as this call waits). A group joined
        before (a learner that died) is left first."""
        self.shutdown()
        if len(init_info.store_secret) < 32:
            raise ValueError("init_info.store_secret: the weight-sync group's store key (hex, from the async-rl "
                             "learner) is required; refusing to join an unkeyed store")
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        store = dist.TCPStore(init_info.master_address, init_info.master_port, init_info.world_size,
                              is_master=False, timeout=GROUP_TIMEOUT)
        self.group, _ = _new_process_group_helper(
            init_info.world_size, rank, [], Backend(init_info.backend),
            KeyedStore(PrefixStore(init_info.group_name, store), bytes.fromhex(init_info.store_secret)),
            group_name=GroupName(init_info.group_name), timeout=GROUP_TIMEOUT)
        _world.pg_group_ranks[self.group] = {i: i for i in range(init_info.world_size)}
        self.receive_device = self.device if init_info.backend == "nccl" else torch.device("cpu")

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """The base class's, without its `torch.accelerator.synchronize()` (no accelerator on vLLM's CPU build;
        with nccl, the current CUDA stream's)."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.receive_device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def receive_weights(self, update_info: BroadcastUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("no weight-update group: call /init_weight_transfer_engine first")
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes,
                                           strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype_name), device=self.receive_device)
            dist.broadcast(tensor, src=0, group=self.group)
            self.model.load_weights([(name, tensor.to(self.device))])

    def shutdown(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


class KeyedStore(dist.Store):
    """async_rl/weights/keyed_store.py's `KeyedStore`: every value signed (HMAC-SHA256 of key and value under the
    group's secret) on `set` and checked on `get`."""

    def __init__(self, inner: dist.Store, secret: bytes) -> None:
        super().__init__()
        self.inner, self.secret = inner, secret

    def _tag(self, key: str, value: bytes) -> bytes:
        return hmac.new(self.secret, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value: bytes | str) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(key, value + self._tag(key, value))

    def get(self, key: str) -> bytes:
        signed = self.inner.get(key)
        value, tag = signed[:-32], signed[-32:]
        if len(signed) < 32 or not hmac.compare_digest(tag, self._tag(key, value)):
            raise PermissionError(f"weight-sync store: the value of {key!r} is not signed with this group's secret")
        return value

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)
