"""The `distributed` weight transport's group store, keyed (async_rl/weights/keyed_store.py): the learner's
BroadcastGroup (async_rl/weights/distributed.py) with a receiver holding the group's secret broadcasts; a process
without it (a plain store, as anyone who reaches the port has, or another secret) cannot join: the learner refuses
its value naming the key, and it receives nothing. Real TCPStore, real gloo group, receivers in processes of
their own."""

from __future__ import annotations

import datetime
import multiprocessing
import queue

import pytest
import torch
import torch.distributed as dist
from sglang_server import free_port
from torch.distributed.distributed_c10d import Backend, GroupName, PrefixStore, _new_process_group_helper, _world

from async_rl.weights.distributed import BroadcastGroup
from async_rl.weights.keyed_store import KeyedStore, new_secret

GROUP = "async_rl_weights"
TIMEOUT = datetime.timedelta(seconds=60)


def receiver(port: int, secret: bytes | None, results: multiprocessing.Queue) -> None:
    """Rank 1 of a world of 2, as the vLLM plugin joins (scripts/vllm_plugin/), with `secret` (None: a plain store,
    as SGLang's join or a stranger has)."""
    try:
        store: dist.Store = PrefixStore(GROUP, dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=TIMEOUT))
        if secret is not None:
            store = KeyedStore(store, secret)
        group, _ = _new_process_group_helper(2, 1, [], Backend("gloo"), store, group_name=GroupName(GROUP),
                                             timeout=TIMEOUT)
        _world.pg_group_ranks[group] = {0: 0, 1: 1}
        tensor = torch.zeros(4)
        dist.broadcast(tensor, src=0, group=group)
        results.put(("received", tensor.tolist()))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put(("refused", str(exc)))


def start_receiver(port: int, secret: bytes | None) -> tuple[multiprocessing.Process, multiprocessing.Queue]:
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    process = spawn.Process(target=receiver, args=(port, secret, results), daemon=True)
    process.start()
    return process, results


@pytest.mark.slow
def test_a_receiver_with_the_groups_secret_joins_and_receives_the_broadcast():
    port, secret = free_port(), new_secret()
    group = BroadcastGroup("127.0.0.1", port, 2, "gloo", GROUP, secret)
    process, results = start_receiver(port, secret)
    try:
        group.join()
        group.broadcast({"w": torch.arange(4.0)})
        assert results.get(timeout=120) == ("received", [0.0, 1.0, 2.0, 3.0])
    finally:
        group.close()
        process.join(30)
        if process.is_alive():
            process.kill()


@pytest.mark.slow
@pytest.mark.parametrize("stranger", ["no secret", "another secret"])
def test_a_process_without_the_groups_secret_cannot_join(stranger):
    port = free_port()
    group = BroadcastGroup("127.0.0.1", port, 2, "gloo", GROUP, new_secret())
    process, results = start_receiver(port, None if stranger == "no secret" else new_secret())
    try:
        with pytest.raises(Exception, match="is not signed with this group's secret"):  # noqa: B017 - c10d's type
            group.join()  # the stranger's address is refused before any connection to it
        assert group.group is None
        try:
            outcome = results.get(timeout=5)
        except queue.Empty:
            outcome = None  # still waiting on a group that will never form
        assert outcome is None or outcome[0] == "refused", outcome  # it received nothing
    finally:
        group.close()
        process.kill()
        process.join(30)


def test_the_store_refuses_a_value_written_without_the_secret():
    """What a stranger with a plain client of the same TCPStore can do: list and read the keys (the signed values are
    readable), and write one; a keyed reader refuses what it wrote, and a value of its own moved to another key."""
    port, secret = free_port(), new_secret()
    master = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    keyed = KeyedStore(PrefixStore(GROUP, master), secret)
    stranger = dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=TIMEOUT)
    keyed.set("rank/0", b"10.0.0.1:1234")
    assert keyed.get("rank/0") == b"10.0.0.1:1234"
    [name] = stranger.list_keys()
    stranger.set(f"{GROUP}/rank/1", b"10.6.6.6:1234")  # claims rank 1's address
    stranger.set(f"{GROUP}/rank/2", stranger.get(name))  # replays rank 0's signed value under another key
    for key in ("rank/1", "rank/2"):
        with pytest.raises(PermissionError, match=rf"'{key}' is not signed with this group's secret"):
            keyed.get(key)
