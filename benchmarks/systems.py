"""The system's parts against their physical limits, each measured next to its bare baseline in one invocation.

The machine is shared, so every part is timed in CPU seconds of the processes doing the work (time.process_time:
another tenant's load does not count against us), with the wall-clock ratio printed next to it. Ours and the
baseline alternate in rounds; a ratio is the median over back-to-back pairs.

  transport  stage records/s from a DEALER in this process to a ROUTER in another (tcp loopback), encoded and
             decoded by async_rl.protocol through async_rl.transport, pipelined (no per-record ack; one reply
             closes each round) ÷ raw ZeroMQ messages of the same byte sizes over the same socket pair and the
             same receiver process. Rate = the pipe's CPU-bound capacity, 1 / max(sender, receiver CPU per
             message), ZeroMQ I/O threads included. Two record sizes: the trap environment's (2 observation
             tokens + 1 action token) and an agent's (512 + 128). Target >= 0.5.
  learner    trained tokens/s of the learner's path (TrainItems -> learner.step.train_on_items: balanced shards,
             sequences packed into rows, token-budgeted micro-batches, the project's loss, DeepSpeed backward and
             one engine step with gradient clipping) ÷ bare torch forward + backward + AdamW on the very same packed
             micro-batches (position ids) with a copy of the same model. Target >= 0.9. The batches are real ones:
             random-policy trap-env traffic through the replay service, served at learner.batch_tokens /
             min_batch_items. Also, side by side: the padding waste of the packed layout (target <= 10%) and of
             one right-padded item per row, and the same learner with learner.packing=false.
  replay     CPU inside ReplayService.handle per stage record, over a group's whole life (lease, records,
             outcomes, batch requests and acks until its corrections are trained), while 10^3 versus 10^6 other
             records are held in open groups (10^4 with --quick). Ratio large ÷ small, target <= 1.5. Memory per
             stored token: tracemalloc over a fill of open groups ÷ the tokens they hold (RSS delta as a check).
  durable    stage records/s of ReplayService.handle with the write-ahead log (replay/wal.py: each message
             appended, one write + fsync per round of N messages, as the socket loop does per poll round) ÷
             the same service in memory, on one recorded message stream (30 groups: leases, records, outcomes,
             batch requests and acks), fresh services alternating. Wall clock: fsync waits for the disk, it
             uses no CPU. N = 1 (an idle replay: one message per round) to 256; the headline is N = 64, a busy
             replay's round (the loop takes what arrived during the last fsync, so rounds grow with load).
             Target >= 0.5.

Every process runs one thread (OMP_NUM_THREADS=1, torch.set_num_threads(1)).

    python benchmarks/systems.py            # about 3 minutes on an idle machine, plus the durable part's fsyncs
    python benchmarks/systems.py --quick    # about 30 s (the guard part with 30 and 300 open groups, not 3,000)
    # the learner on a 4x wider, 2x deeper model, ~30x the parameters (fixed per-step costs shrink against its work)
    python benchmarks/systems.py --only learner --rounds 5 --set model.hidden_size=256 --set model.num_layers=4 \
        --set model.num_heads=8 --set model.num_kv_heads=4 --set model.intermediate_size=512

The last stdout line is JSON: {"transport_ratio", "learner_ratio", "replay_scale_ratio", "bytes_per_token",
"durable_ratio", ...}.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch or numpy start their thread pools; the cores are shared
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402 - after the thread pinning above
import json  # noqa: E402
import logging  # noqa: E402
import multiprocessing  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
from pathlib import Path  # noqa: E402

import msgspec  # noqa: E402
import zmq  # noqa: E402

from async_rl.config import Config  # noqa: E402
from async_rl.config_load import load_config  # noqa: E402
from async_rl.protocol import LOGPROB, TOKEN, LeaseRequest, StageRecord, encode, pack  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _systems_parts import (  # noqa: E402
    RecordingDriver,
    ReplayDriver,
    Round,
    open_sender,
    receiver,
    send_round,
)
from common import paired_ratio  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "out" / "systems"
TARGETS = {"transport": 0.5, "learner": 0.9, "replay": 1.5, "padding": 0.10, "durable": 0.5}
HEADLINE_ROUND = 64  # messages per fsync of the durable replay's headline ratio (one poll round of a busy replay)


def free_endpoint() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


# --- transport ---------------------------------------------------------------------------------------


def stage_records(observation_tokens: int, action_tokens: int, count: int) -> list[StageRecord]:
    """Distinct records of one size, with ids like a running worker's (`g123/4`)."""
    return [
        StageRecord(
            msg_id=n, worker_id="rollout-0", group_id=f"g{n // 64}", trajectory_id=f"g{n // 64}/{n % 16}",
            member=n % 16, task_id=str(n % 16), stage_index=n % 4,
            observation_tokens=pack([(n + t) % 30 for t in range(observation_tokens)], TOKEN),
            action_tokens=pack([n % 30] * action_tokens, TOKEN), behaviour_logprobs=pack([-1.5] * action_tokens,
            LOGPROB), policy_versions=pack([n // 1000] * action_tokens, TOKEN), stage_reward=1.0, terminal=False,
        )
        for n in range(count)
    ]


def measure_transport(messages: int, rounds_per_size: int) -> dict:
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of this process is shared
    results = {}
    for name, (observation, action) in {"trap": (2, 1), "agent": (512, 128)}.items():
        records = stage_records(observation, action, 1000)
        records = (records * (messages // len(records) + 1))[:messages]
        raw = [os.urandom(len(encode(r))) for r in records[:1000]]
        raw = (raw * (messages // len(raw) + 1))[:messages]
        endpoint = free_endpoint()
        process = spawn.Process(target=receiver, args=(endpoint,))  # one receiver for both: the same setup
        process.start()
        context = zmq.Context()
        sender = open_sender(context, endpoint)
        rounds: dict[str, list[Round]] = {"protocol": [], "raw": []}
        try:
            send_round(sender, records[: messages // 10], protocol=True)  # warm up the pipe and both code paths
            send_round(sender, raw[: messages // 10], protocol=False)
            for _ in range(rounds_per_size):
                rounds["raw"].append(send_round(sender, raw, protocol=False))
                rounds["protocol"].append(send_round(sender, records, protocol=True))
        finally:
            sender.send(b"stop")
            sender.close()
            context.term()
            process.join(timeout=10)
        ours, bare = rounds["protocol"], rounds["raw"]
        results[name] = {
            "bytes": statistics.mean(len(encode(r)) for r in records[:1000]),
            "protocol_capacity_per_s": statistics.median(r.capacity_per_s for r in ours),
            "raw_capacity_per_s": statistics.median(r.capacity_per_s for r in bare),
            "ratio": paired_ratio([r.capacity_per_s for r in ours], [r.capacity_per_s for r in bare]),
            "protocol_wall_per_s": statistics.median(r.per_s for r in ours),
            "raw_wall_per_s": statistics.median(r.per_s for r in bare),
            "wall_ratio": paired_ratio([r.per_s for r in ours], [r.per_s for r in bare]),
            "cpu_us": {kind: {"sender": statistics.median(r.sender_cpu_us for r in rs),
                              "receiver": statistics.median(r.receiver_cpu_us for r in rs)}
                       for kind, rs in rounds.items()},
        }
    return results


# --- learner -----------------------------------------------------------------------------------------


def base_config(name: str, extra: list[str] = ()) -> Config:
    return load_config(None, [f"run.dir={OUT}", f"run.name={name}", "wandb.mode=disabled", "replay.durable=false",
                              *extra])


def measure_learner(num_batches: int, rounds: int, overrides: list[str] = ()) -> dict:
    import torch
    import torch.nn.functional as F

    from async_rl.loss import policy_loss, token_logprobs_and_entropy
    from async_rl.model import load_model
    from learner.attention import use_attention
    from learner.batch import collate
    from learner.engine import build_engine
    from learner.settings import LearnerSettings
    from learner.step import layout_metrics, rank_micro_batches, train_on_items
    from replay.server import build_service
    from rollout.prepare import prepare_model_dir
    from rollout.settings import RolloutSettings

    torch.set_num_threads(1)
    config = base_config("learner", overrides)
    padded_config = base_config("learner", [*overrides, "learner.packing=false"])
    settings, padded = LearnerSettings.from_config(config), LearnerSettings.from_config(padded_config)
    batches = [b.items for b in ReplayDriver(build_service(config), config, seed=0).collect_batches(num_batches)]
    # the bare baseline's tensors: the very micro-batches (packed rows, position ids) the learner trains on
    tensors = [[batch for batch, _ in rank_micro_batches(items, 0, 1, settings.step)] for items in batches]
    real = sum(item.num_tokens() for items in batches for item in items)
    packed_slots = sum(t.tokens.numel() for micro in tensors for t in micro)
    padded_slots = sum(collate(items).tokens.numel() for items in batches)

    # the learner waits for the rollout side to build it
    model_dir = prepare_model_dir(RolloutSettings.from_config(config).model_dir)
    engine, reference = build_engine(settings.engine, model_dir)
    padded_engine, _ = build_engine(padded.engine, model_dir)
    attention = engine.module.config._attn_implementation  # learner.attention resolved (learner/attention.py)

    def bare_copy(fused: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """A fresh copy of the model and its AdamW (torch's default step on CPU, or the learner's fused one)."""
        model = load_model(model_dir).train()
        use_attention(model, attention)  # the learner's attention kernel: the same work
        return model, torch.optim.AdamW(model.parameters(), lr=config.learner.lr,
                                        weight_decay=config.learner.weight_decay, fused=fused)

    bare, optimizer = bare_copy(fused=False)
    # Two more bare loops, so that the headline's baseline (torch's defaults) is not the only yardstick: the same
    # fused AdamW step as the learner's, and the learner's whole math (the project's loss with IS weights and the
    # entropy bonus, gradient clipping, the fused step) in plain torch: the latter's gap is the framework alone
    # (planning and collating, finite checks, DeepSpeed's wrappers).
    bare_fused, fused = bare_copy(fused=True)
    bare_same, same = bare_copy(fused=True)

    def ours(version: int = 0) -> None:
        for items in batches:
            version, _ = train_on_items(engine, reference, items, version, settings.step)

    def ours_padded(version: int = 0) -> None:  # the same code with learner.packing=false: one item per row
        for items in batches:
            version, _ = train_on_items(padded_engine, None, items, version, padded.step)

    def nll_loop(model: torch.nn.Module, step: torch.optim.Optimizer) -> None:
        for micro in tensors:
            for t in micro:
                logits = model(**t.model_inputs()).logits[:, :-1]
                nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t.tokens[:, 1:].reshape(-1),
                                      reduction="none")
                loss = (nll * t.loss_mask.reshape(-1)).sum() / t.loss_mask.sum()
                loss.backward()
            step.step()
            step.zero_grad(set_to_none=True)

    def same_math(version: int = 0) -> None:
        algo = config.algo
        for micro in tensors:
            for t in micro:
                logp, entropy = token_logprobs_and_entropy(bare_same(**t.model_inputs()).logits, t.tokens,
                                                           config.rollout.temperature, entropy=algo.entropy_coef > 0)
                loss, _ = policy_loss(logp, t.behaviour_logp, t.advantages, t.staleness(version), t.loss_mask, algo,
                                      entropy=entropy)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(bare_same.parameters(), config.learner.grad_clip)
            same.step()
            same.zero_grad(set_to_none=True)

    runs = {"ours": ours, "bare": lambda: nll_loop(bare, optimizer), "padded": ours_padded,
            "bare_fused": lambda: nll_loop(bare_fused, fused), "bare_same": same_math}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    wall: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():  # warm-up: allocator, autograd graph caches
        run()
    for _ in range(rounds):
        for name, run in runs.items():
            started, cpu_started = time.perf_counter(), time.process_time()
            run()
            cpu[name].append(time.process_time() - cpu_started)
            wall[name].append(time.perf_counter() - started)
    ours_s, bare_s, padded_s = (statistics.median(cpu[name]) for name in ("ours", "bare", "padded"))
    return {
        "rounds_cpu_s": cpu, "rounds_wall_s": wall, "batches": len(batches), "attention": attention,
        "items_per_batch": statistics.mean(len(b) for b in batches),
        "real_tokens_per_batch": real / len(batches), "packed_tokens_per_batch": packed_slots / len(batches),
        "padded_tokens_per_batch": padded_slots / len(batches),
        "micro_batches_per_batch": statistics.mean(layout_metrics(b, 1, settings.step.layout)["micro_batches"]
                                                   for b in batches),
        "padding_frac": 1 - real / packed_slots, "padding_frac_unpacked": 1 - real / padded_slots,
        # throughput in real (trained) tokens per CPU second
        "ours_tokens_per_s": real / ours_s, "bare_tokens_per_s": real / bare_s, "padded_tokens_per_s": real / padded_s,
        "ratio": paired_ratio(cpu["bare"], cpu["ours"]),  # tokens/s ours ÷ bare = time bare ÷ ours
        "fused_ratio": paired_ratio(cpu["bare_fused"], cpu["ours"]),
        "same_math_ratio": paired_ratio(cpu["bare_same"], cpu["ours"]),
        "bare_fused_tokens_per_s": real / statistics.median(cpu["bare_fused"]),
        "bare_same_tokens_per_s": real / statistics.median(cpu["bare_same"]),
        "wall_ratio": paired_ratio(wall["bare"], wall["ours"]),
        "packed_vs_padded_ratio": paired_ratio(cpu["padded"], cpu["ours"]),
        "ours_ms_per_step": 1000 * ours_s / len(batches), "bare_ms_per_step": 1000 * bare_s / len(batches),
    }


# --- replay ------------------------------------------------------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fill(config: Config, records: int):  # noqa: ANN201 - (ReplayService, ReplayDriver)
    """A service holding `records` stage records in open groups: every member but the last sends its stages and
    no outcome arrives, so no stage group completes and nothing is queued."""
    from replay.server import build_service

    service = build_service(config)
    driver = ReplayDriver(service, config, seed=records)
    while driver.records < records:
        driver.play_group("filler", members=config.rollout.group_size - 1, outcomes=False)
    return service, driver


def measure_replay(sizes: tuple[int, int], groups_per_round: int, rounds: int, memory_records: int,
                   guard_groups: tuple[int, ...]) -> dict:
    # Admission would stop the fill at (v + max_staleness + 1) * groups_per_step groups: lift it. The correction
    # guard's admission too (it bounds open groups to what can be corrected in time, and its checks scan them:
    # O(open groups) per lease, quadratic over this fill; measured on its own by measure_guard).
    config = base_config("replay", ["algo.groups_per_step=100000000", "algo.correction_guard=false"])
    tracemalloc.start()
    _, driver = fill(config, memory_records)
    traced, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    memory = {"records": driver.records, "tokens": driver.tokens, "bytes_per_token": traced / driver.tokens,
              "bytes_per_record": traced / driver.records}
    del driver

    services = {}
    for size in sizes:
        before, started = rss_bytes(), time.perf_counter()
        service, driver = fill(config, size)
        services[size] = service
        if size == sizes[-1]:
            memory.update(rss_records=driver.records, rss_bytes_per_token=(rss_bytes() - before) / driver.tokens,
                          fill_s=time.perf_counter() - started)
    cost: dict[int, list[float]] = {size: [] for size in sizes}
    for r in range(rounds):
        for size, service in services.items():  # the same traffic (seed r) against each store
            driver = ReplayDriver(service, config, seed=r)
            for _ in range(groups_per_round):
                driver.play_group(f"worker-r{r}")
                driver.train_all(config.learner.batch_tokens)
            cost[size].append(driver.handle_s / driver.records)
    small, large = sizes
    return {"sizes": list(sizes), "us_per_record": {str(s): 1e6 * statistics.median(cost[s]) for s in sizes},
            "ratio": paired_ratio(cost[large], cost[small]), "rounds_s_per_record": cost, **memory,
            "guard": measure_guard(open_groups=guard_groups, leases=100, rounds=rounds)}


def measure_guard(open_groups: tuple[int, ...], leases: int, rounds: int) -> dict:
    """CPU per lease with the correction guard on ÷ off, with G groups open (their outcomes pending): the guard's
    admission check scans the pending groups and queued corrections, O(G) per lease. The staleness bound is lifted
    so that the guard admits every group (it still does all its work); in a real run it bounds G itself."""
    from replay.server import build_service

    configs = {guard: base_config("guard", ["algo.groups_per_step=100000000", f"algo.correction_guard={guard}",
                                            "algo.max_correction_staleness=100000000"]) for guard in (True, False)}
    result = {}
    for count in open_groups:
        per_lease: dict[bool, list[float]] = {True: [], False: []}
        for r in range(rounds):
            for guard, config in configs.items():
                driver = ReplayDriver(build_service(config), config, seed=r)
                for _ in range(count):
                    assert driver.play_group("filler", members=1, outcomes=False), "the guard refused a lease"
                driver.handle_s = 0.0
                for i in range(leases):
                    driver.handle(b"leaser", LeaseRequest(worker_id="leaser", msg_id=10**9 + i))
                per_lease[guard].append(driver.handle_s / leases)
        result[str(count)] = {"us_per_lease_on": 1e6 * statistics.median(per_lease[True]),
                              "us_per_lease_off": 1e6 * statistics.median(per_lease[False]),
                              "ratio": paired_ratio(per_lease[True], per_lease[False])}
    return result


# --- durability: the write-ahead log -------------------------------------------------------------------


def measure_durability(groups: int, rounds: int, round_sizes: tuple[int, ...]) -> dict:
    """One recorded message stream (whole groups: leases, records, outcomes, batch requests and acks) played into
    a fresh ReplayService per round, in memory and durable (replay.server.run's logging: every message appended,
    one write + fsync per `round_size` messages, as the socket loop does per poll round), alternating."""
    import shutil

    from replay.log_format import Received
    from replay.server import build_service, handle_safely
    from replay.wal import ReplayLog

    config = base_config("wal", ["algo.groups_per_step=100000000"])
    recorder = RecordingDriver(build_service(config), config, seed=0)
    for _ in range(groups):
        recorder.play_group("worker-0")
        recorder.train_all(config.learner.batch_tokens)
    stream, records = recorder.stream, recorder.records
    directory = OUT / "wal"

    def in_memory(_: int) -> None:
        service = build_service(config)
        for identity, message in stream:
            service.handle(identity, message, 0.0)

    def durable(round_size: int) -> None:
        shutil.rmtree(directory, ignore_errors=True)
        service, wal = build_service(config), ReplayLog(directory, fsync=True)
        wal.compact(service, 0.0)  # opens the first segment, as a start does
        for n, (identity, message) in enumerate(stream, 1):
            wal.append(Received(identity, 0.0, encode(message)))
            handle_safely(service, identity, message, 0.0)
            if n % round_size == 0:
                wal.commit()
        wal.commit()
        wal.close()

    results: dict = {"messages": len(stream), "records": records, "round_sizes": list(round_sizes)}
    for round_size in round_sizes:
        wall: dict[str, list[float]] = {"memory": [], "durable": []}
        for _ in range(rounds):
            for name, play in (("memory", in_memory), ("durable", durable)):
                started = time.perf_counter()
                play(round_size)
                wall[name].append(time.perf_counter() - started)
        results[str(round_size)] = {
            "memory_records_per_s": records / statistics.median(wall["memory"]),
            "durable_records_per_s": records / statistics.median(wall["durable"]),
            "ratio": paired_ratio(wall["memory"], wall["durable"]),  # records/s durable ÷ memory
            "rounds_wall_s": wall,
        }
    shutil.rmtree(directory, ignore_errors=True)
    return results


# --- report ------------------------------------------------------------------------------------------


def report(transport: dict | None, learner: dict | None, replay: dict | None, durability: dict | None) -> None:
    from rich.console import Console
    from rich.table import Table

    def met(value: float, target: float, higher_is_better: bool = True) -> str:
        ok = value >= target if higher_is_better else value <= target
        return "[green]yes[/]" if ok else "[red]no[/]"

    table = Table(title="systems: ours ÷ bare baseline, measured side by side")
    for column in ("part", "ours", "baseline", "ratio", "target", "met"):
        table.add_column(column, justify="right" if column != "part" else "left")
    for name, t in (transport or {}).items():
        table.add_row(f"transport, {name} record ({t['bytes']:.0f} B), CPU-bound capacity",
                      f"{t['protocol_capacity_per_s']:,.0f} rec/s", f"{t['raw_capacity_per_s']:,.0f} msg/s",
                      f"{t['ratio']:.2f}", ">= 0.5", met(t["ratio"], 0.5))
        table.add_row(f"transport, {name} record, wall clock (shared cores)", f"{t['protocol_wall_per_s']:,.0f} rec/s",
                      f"{t['raw_wall_per_s']:,.0f} msg/s", f"{t['wall_ratio']:.2f}", "", "")
    if learner:
        target = TARGETS["learner"]
        table.add_row(f"learner ({learner['items_per_batch']:.0f} items, {learner['real_tokens_per_batch']:.0f} "
                      f"tokens in {learner['packed_tokens_per_batch']:.0f} packed slots/batch, attention "
                      f"{learner['attention']})",
                      f"{learner['ours_tokens_per_s']:,.0f} tok/s", f"{learner['bare_tokens_per_s']:,.0f} tok/s",
                      f"{learner['ratio']:.2f}", f">= {target}", met(learner["ratio"], target))
        table.add_row("learner, wall clock (shared cores)", "", "", f"{learner['wall_ratio']:.2f}", "", "")
        table.add_row("learner ÷ bare with the learner's fused AdamW step",
                      f"{learner['ours_tokens_per_s']:,.0f} tok/s", f"{learner['bare_fused_tokens_per_s']:,.0f} tok/s",
                      f"{learner['fused_ratio']:.2f}", "", "")
        table.add_row("learner ÷ bare with the learner's math (loss, entropy, clip, fused AdamW)",
                      f"{learner['ours_tokens_per_s']:,.0f} tok/s", f"{learner['bare_same_tokens_per_s']:,.0f} tok/s",
                      f"{learner['same_math_ratio']:.2f}", "", "")
        table.add_row("learner packed ÷ the same learner unpacked (one item per row)",
                      f"{learner['ours_tokens_per_s']:,.0f} tok/s", f"{learner['padded_tokens_per_s']:,.0f} tok/s",
                      f"{learner['packed_vs_padded_ratio']:.2f}", "", "")
        table.add_row("learner padding waste, packed (unpacked)", f"{learner['padding_frac']:.1%}",
                      f"{learner['padding_frac_unpacked']:.1%}", "", f"<= {TARGETS['padding']:.0%}",
                      met(learner["padding_frac"], TARGETS["padding"], higher_is_better=False))
    if replay:
        small, large = replay["sizes"]
        table.add_row(f"replay µs/record, {large:.0e} ÷ {small:.0e} held",
                      f"{replay['us_per_record'][str(large)]:.1f} µs", f"{replay['us_per_record'][str(small)]:.1f} µs",
                      f"{replay['ratio']:.2f}", "<= 1.5", met(replay["ratio"], 1.5, higher_is_better=False))
        for count, g in replay["guard"].items():
            table.add_row(f"replay lease with the correction guard ÷ without, {count} groups open",
                          f"{g['us_per_lease_on']:.0f} µs", f"{g['us_per_lease_off']:.0f} µs", f"{g['ratio']:.1f}",
                          "", "")
        table.add_row("replay memory / stored token", f"{replay['bytes_per_token']:.0f} B (tracemalloc)",
                      f"{replay['rss_bytes_per_token']:.0f} B (RSS)", "", "", "")
    if durability:
        for round_size in durability["round_sizes"]:
            d = durability[str(round_size)]
            table.add_row(f"durable replay, {round_size} messages per fsync, wall clock",
                          f"{d['durable_records_per_s']:,.0f} rec/s",
                          f"{d['memory_records_per_s']:,.0f} rec/s (memory)",
                          f"{d['ratio']:.2f}", f">= {TARGETS['durable']}" if round_size == HEADLINE_ROUND else "",
                          met(d["ratio"], TARGETS["durable"]) if round_size == HEADLINE_ROUND else "")
    Console(width=160).print(table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer messages and rounds; 10^4 records, not 10^6")
    parser.add_argument("--only", choices=("transport", "learner", "replay", "durability"), action="append",
                        help="measure only this part (repeatable); default: all four")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for the learner part (repeatable), e.g. model.hidden_size=256: the "
                             "default tiny model makes the learner's fixed per-step costs look large")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of the learner part (default 3 with --quick, else 11)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    OUT.mkdir(parents=True, exist_ok=True)
    quick, parts = args.quick, set(args.only or ("transport", "learner", "replay", "durability"))
    transport = learner = replay = durability = None
    if "transport" in parts:
        transport = measure_transport(messages=10_000 if quick else 50_000, rounds_per_size=3 if quick else 11)
    if "learner" in parts:
        learner = measure_learner(num_batches=8, rounds=args.rounds or (3 if quick else 11), overrides=args.set)
    if "replay" in parts:
        replay = measure_replay((10**3, 10**4 if quick else 10**6), groups_per_round=30, rounds=3 if quick else 11,
                                memory_records=20_000, guard_groups=(30, 300) if quick else (30, 300, 3000))
    if "durability" in parts:
        durability = measure_durability(groups=30, rounds=2 if quick else 7,
                                        round_sizes=(1, HEADLINE_ROUND) if quick else (1, 16, HEADLINE_ROUND, 256))
    report(transport, learner, replay, durability)
    raw = {"transport": transport, "learner": learner, "replay": replay, "durability": durability, "quick": quick,
           "overrides": args.set, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    name = "systems" + ("-quick" if quick else "") + ("" if len(parts) == 4 else "-" + "-".join(sorted(parts))) + (
        "-set" if args.set else "")
    (OUT / f"{name}.json").write_text(json.dumps(raw, indent=1))
    headline = {}
    if transport:
        headline.update(transport_ratio=transport["trap"]["ratio"],
                        transport_ratio_agent_record=transport["agent"]["ratio"],
                        transport_wall_ratio={name: t["wall_ratio"] for name, t in transport.items()})
    if learner:
        headline.update(learner_ratio=learner["ratio"], learner_wall_ratio=learner["wall_ratio"],
                        learner_fused_ratio=learner["fused_ratio"], learner_same_math_ratio=learner["same_math_ratio"],
                        padding_frac=learner["padding_frac"], padding_frac_unpacked=learner["padding_frac_unpacked"],
                        packed_vs_padded_ratio=learner["packed_vs_padded_ratio"],
                        learner_attention=learner["attention"], learner_tokens_per_s=learner["ours_tokens_per_s"])
    if replay:
        headline.update(replay_scale_ratio=replay["ratio"], bytes_per_token=replay["bytes_per_token"],
                        guard_lease_ratio={count: g["ratio"] for count, g in replay["guard"].items()},
                        replay_us_per_record=replay["us_per_record"], rss_bytes_per_token=replay["rss_bytes_per_token"])
    if durability:
        headline.update(durable_ratio=durability[str(HEADLINE_ROUND)]["ratio"],
                        durable_ratio_by_round={size: durability[str(size)]["ratio"]
                                                for size in durability["round_sizes"]})
    print(msgspec.json.encode(headline).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
