"""The `distributed` format's transport: the learner as rank 0 of a torch.distributed group (NCCL or gloo) with the
receivers, broadcasting every tensor of a version to them; no file is written, so the notice's path is "".

The group is built the way SGLang builds its side of it (`/init_weights_update_group`: store keys under the group
name, a TCPStore hosted by rank 0); the receivers' own calls around a broadcast (SGLang's HTTP API) are their
role's (learner/sglang_sync.py). A receiver outside the group has nothing to load: it refuses the format by name
(async_rl/weights/base.py `loader_for`). With a `secret` the store is keyed (async_rl/weights/keyed_store.py): a
process without it cannot join.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, GroupName, PrefixStore, _new_process_group_helper, _world

from async_rl.weights.keyed_store import KeyedStore

GROUP_TIMEOUT = datetime.timedelta(minutes=5)


class BroadcastGroup:
    """Rank 0 of a `world_size` group named `name`, hosting its store at `master_addr:master_port` from the start (a
    port already taken fails here, before any receiver is asked to join: one that joined another's store would
    wait on it). `join` blocks until every other rank has joined (the caller has them join on other threads
    meanwhile). `secret`: the group's store is keyed with it (every rank must hold it); None: a plain store, which
    anyone who reaches the port can join (SGLang's `/init_weights_update_group` joins no other)."""

    def __init__(self, master_addr: str, master_port: int, world_size: int, backend: str, name: str,
                 secret: bytes | None = None) -> None:
        self.backend, self.world_size, self.name, self.secret = backend, world_size, name, secret
        self.store = dist.TCPStore(master_addr, master_port, world_size, is_master=True, timeout=GROUP_TIMEOUT,
                                   wait_for_workers=False)  # they connect once asked to join; `join` waits for them
        self.group: dist.ProcessGroup | None = None

    def join(self) -> None:
        store: dist.Store = PrefixStore(self.name, self.store)
        if self.secret is not None:
            store = KeyedStore(store, self.secret)
        self.group, _ = _new_process_group_helper(self.world_size, 0, [], Backend(self.backend), store,
                                                  group_name=GroupName(self.name), timeout=GROUP_TIMEOUT)
        _world.pg_group_ranks[self.group] = {i: i for i in range(self.world_size)}

    def on_device(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors where the backend sends them from: CUDA for nccl, host memory for gloo."""
        device = "cuda" if self.backend == "nccl" else "cpu"
        return {name: t.detach().to(device).contiguous() for name, t in state_dict.items()}

    def broadcast(self, tensors: dict[str, torch.Tensor]) -> None:
        """Every tensor to every rank, in the dict's order (the receivers were told that order)."""
        if self.group is None:
            raise RuntimeError(f"broadcast group {self.name}: not joined")
        for tensor in tensors.values():
            dist.broadcast(tensor, src=0, group=self.group)

    def close(self) -> None:
        """Leave the group and stop hosting its store (the port is free again)."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
        del self.store
