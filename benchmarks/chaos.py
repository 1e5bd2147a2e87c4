"""A chaos soak: the pod roles in their own network namespaces, restarted as pods are, under a seeded nemesis; then
a checker verifies the run's history (docs/results.md, "Chaos soak").

    python benchmarks/chaos.py --minutes 1 --gap-s 4 --seed 1     # the short form CI runs (tests/test_chaos.py)
    python benchmarks/chaos.py --minutes 50 --gap-s 2.5 --seed 7    # the long soak (docs/results.md)

The replay, the learner (one rank, DeepSpeed on the CPU) and two rollout workers each run `python -m launch.cli
ROLE --config CFG` in a network namespace of their own (tests/netns.py), over TCP with CURVE on, the run directory
standing for the shared volume; the replay's log and the learner's checkpoints and weights live on small tmpfs
volumes of their own. A supervisor starts each role again when it exits (benchmarks/chaos_pods.py). Once the
learner has trained its first version, the nemesis runs for --minutes, one fault every --gap-s on average, each
drawn from random.Random(--seed): its kind from a shuffled deck of the six, its time, its target and duration:
  kill       SIGKILL of any role (restarted by its supervisor)
  pause      SIGSTOP of any role for 1-12 s, then SIGCONT (past replay.lease_timeout_s=5 about half the time)
  partition  any role's link down for 1-10 s (`ip link set ... down`), then up
  slow       any role's link shaped to 64 kbit/s both ways for 3-12 s (`tc qdisc ... tbf`; this kernel has no
             netem, so no packet loss or added delay beyond the bucket's queue: what it queues past 2 s is dropped)
  disk       the replay's or the learner's volume filled to ENOSPC for 2-10 s, then freed
  torn       SIGKILL of the replay or the learner, then, before its restart, the replay's log or the newest
             checkpoint torn (tear_log: half the time, drawn, a frame cut off mid-write, half the time, and always
             the first time, the last segment truncated at a random offset in its last 16 KiB, acknowledged frames
             among what is cut, a copy kept in OUT/torn/ for the checker; tear_checkpoint: its largest file
             truncated at a random offset)
A fault whose target is down, or under a fault it has not recovered from (no learner version since its heal), goes
to another role, or waits up to 10 s for one, or is skipped. When the window ends every fault is healed and the
learner is restarted (SIGTERM, then the same command) with run.max_versions set 10 above its version: the run's
budget, which it must reach. Then every role is stopped and benchmarks/chaos_check.py checks the history, joining
the workers' ack journals (OUT/run/acks/) with the learner's per-item log. One JSON summary is printed (and written
to OUT/summary.json): the faults by kind, restarts, recovery times (heal, thaw or restart to the learner's next
version), acked stages trained, pending, given up by reason and lost, stages trained twice or without a sender,
what the tears cut, corrections dropped by fault, the worst ledger residual, the checker's verdict, the seed and the
command. Exit code 0 when the checker passed.

Needs root (namespaces, tmpfs, tc). Every loop is bounded in time; namespaces, mounts and processes are removed
on the way out, also after a failure.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import json
import random
import shlex
import shutil
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

KINDS = ("kill", "pause", "partition", "slow", "disk", "torn")
ROLES = ("replay", "learner", "rollout-0", "rollout-1")
HOSTS = {"replay": ["async-rl-replay"], "learner": ["async-rl-learner"], "rollout-0": [], "rollout-1": []}
STATEFUL = ("replay", "learner")  # the roles with a volume: disk and torn faults
DURATION_S = {"pause": (1.0, 12.0), "partition": (1.0, 10.0), "slow": (3.0, 12.0), "disk": (2.0, 10.0)}
SLOW_RATE = "64kbit"
DRAIN_VERSIONS = 10
WARMUP_S = 300.0  # the first version must come within this long
DRAIN_S = 300.0  # and the budget within this long after the window
UNBOUNDED = 1_000_000  # the learner's budget while the nemesis runs
POSTPONE_S, MAX_POSTPONED = 1.0, 10  # a fault with no free target waits, then is skipped


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the nemesis runs (default 30)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the schedule of faults and the run")
    parser.add_argument("--gap-s", type=float, default=6.0, help="mean seconds between two faults (default 6)")
    parser.add_argument("--out", type=Path, default=None,
                        help="an empty or new directory for the run, its logs and summary.json (default: a new "
                        "benchmarks/out/chaos-SEED, -2, -3, ...)")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.gap_s <= 0:
        parser.error("--minutes and --gap-s must be > 0")
    return args


@dataclass
class Fault:
    """One fault of the schedule, and what became of it."""

    at: float  # seconds into the window
    kind: str
    targets: list[str]  # in order of preference: the first one not busy is hit
    duration_s: float
    target: str | None = None
    injected_at: float | None = None  # seconds into the window (`at`, or later when postponed)
    detail: str = ""
    healed_at: float | None = None  # seconds into the window: restart, thaw, link up, space freed
    recovery_s: float | None = None  # from healed_at to the learner's next version
    postponed: int = 0  # times it waited POSTPONE_S for a target
    skipped: bool = False


def schedule(seed: int, window_s: float, gap_s: float) -> list[Fault]:
    """The faults of the window, from random.Random(seed) alone: kinds dealt from shuffled decks of all six."""
    rng = random.Random(seed)
    faults, deck, at = [], [], rng.uniform(0.2, 1.0) * gap_s
    while at < window_s:
        if not deck:
            deck = list(KINDS)
            rng.shuffle(deck)
        kind = deck.pop()
        targets = list(STATEFUL if kind in ("disk", "torn") else ROLES)
        rng.shuffle(targets)
        low, high = DURATION_S.get(kind, (0.0, 0.0))
        faults.append(Fault(round(at, 3), kind, targets, round(rng.uniform(low, high), 3)))
        at += rng.uniform(0.5, 1.5) * gap_s
    return faults


def write_config(work: Path, seed: int) -> Path:
    """The run's config (the pods' ConfigMap): the cluster's endpoints and CURVE, the tiny model and small budgets of
    tests/test_faults.py's FAULT_RUN, the replay's log compacted only at a start (the checker replays all of it)."""
    from async_rl.config_load import dump_config, load_config
    from launch.cli import main as async_rl

    with contextlib.redirect_stdout(io.StringIO()):  # it prints the files it wrote: stdout is the summary's
        assert async_rl(["keys", str(work / "curve")]) == 0
    config = load_config(None, [
        f"run.dir={work}", "run.name=run", f"run.seed={seed}", f"run.max_versions={UNBOUNDED}",
        "run.target_success=null", "run.eval_samples_per_task=0", "run.metrics_every_s=2", "wandb.mode=disabled",
        "replay.endpoint=tcp://async-rl-replay:5555", "learner.publish_endpoint=tcp://async-rl-learner:5556",
        f"security.curve_dir={work / 'curve'}", "rollout.workers=2", "rollout.group_size=4", "rollout.max_inflight=8",
        "rollout.ack_timeout_s=2", "env.kwargs.num_tasks=4", "env.kwargs.step_latency_s=0.01",
        "env.kwargs.outcome_delay_s=0.3", "learner.device=cpu", "learner.min_batch_items=4",
        "learner.batch_wait_s=0.2", "learner.checkpoint_every=5", "learner.log_item_ids=true",
        "learner.request_timeout_s=3", "algo.max_staleness=2", "replay.lease_timeout_s=5",
        "replay.batch_ack_timeout_s=20", "replay.max_open_groups=64", "replay.compact_every=100000000",
    ])
    path = config.run_dir / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    dump_config(config, path)
    return path


class Soak:
    """The run: network, volumes, pods, the nemesis' faults and the versions the learner wrote."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        from chaos_pods import Disk, Pod
        from netns import Network

        self.args, self.work = args, work
        self.rng = random.Random(args.seed + 1)  # the tears' bytes
        self.run_dir = work / "run"
        self.config = write_config(work, args.seed)
        self.logs = work / "logs"
        self.logs.mkdir(exist_ok=True)
        self.network = Network(HOSTS)
        self.disks = {"replay": Disk(self.run_dir / "replay", "128m"), "learner": Disk(work / "learner-disk", "32m")}
        self.budget = UNBOUNDED
        cli = [sys.executable, "-m", "launch.cli"]
        argv = {"replay": lambda: [*cli, "replay", "--config", str(self.config)],
                "learner": lambda: [*cli, "learner", "--config", str(self.config), f"run.max_versions={self.budget}"],
                **{f"rollout-{i}": (lambda i=i: [*cli, "rollout", "--config", str(self.config), "--index", str(i)])
                   for i in range(2)}}
        self.pods = {name: Pod(name, argv[name], self.network, self.logs) for name in ROLES}
        self.faults: list[Fault] = []
        self.active: list[tuple[float, Fault]] = []  # (heal time into the window, fault) of faults still on
        self.window_start = 0.0
        self.window_start_unix: float | None = None  # the same moment on the wall clock (the pods' logs use it)
        self.versions: list[tuple[float, int]] = []  # (monotonic time, version) of each metrics line
        self.skipped: list[Fault] = []  # faults whose every target was down or under another fault
        self._metrics_offset = 0
        self.archived = 0

    # --- set-up and tear-down ---

    def open(self) -> None:
        self.network.open()
        for disk in self.disks.values():
            disk.open()
        for sub in ("checkpoints", "weights"):  # the learner's volume holds both
            (self.disks["learner"].mount / sub).mkdir()
            (self.run_dir / sub).symlink_to(self.disks["learner"].mount / sub)
        for pod in self.pods.values():
            pod.start()

    def close(self) -> None:
        """Everything down and removed, whatever state it is in (also from atexit)."""
        for pod in self.pods.values():
            pod.stop(timeout_s=20)
        self.archive()
        self.network.close()  # the links' qdiscs go with their namespaces
        for name, disk in self.disks.items():
            if disk.mounted:  # the volume as the run left it, for the checker and a post-mortem
                shutil.copytree(disk.mount, self.work / "volumes" / name, symlinks=True, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("filler", "lock"))
            disk.close()

    def archive(self) -> None:
        from chaos_check import archive_log

        if self.disks["replay"].mounted:
            self.archived += archive_log(self.run_dir / "replay", self.work / "replay-archive")

    # --- the loop's parts ---

    def now(self) -> float:
        return time.monotonic() - self.window_start

    def supervise(self) -> None:
        """Restart what exited (its log archived first, while it is down); the learner at its budget stays down."""
        for pod in self.pods.values():
            if pod.name == "learner" and not pod.running() and self.learner_finished():
                pod.done = pod.expecting = True  # at its budget: it stopped by itself, as asked
            pod.reap()
            if pod.due_restart(time.monotonic()):
                if pod.name == "replay":
                    self.archive()
                pod.start()
                for fault in self.faults:
                    if fault.target == pod.name and fault.kind in ("kill", "torn") and fault.healed_at is None:
                        fault.healed_at = self.now()

    def learner_finished(self) -> bool:
        summary = self.run_dir / "summary.json"
        if self.budget == UNBOUNDED or not summary.exists():
            return False
        done = json.loads(summary.read_text())
        return done.get("stop_reason") == "max_versions" and done.get("versions") == self.budget

    def read_versions(self) -> None:
        """New metrics lines: each is a version; it ends the recovery of every fault healed before it."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return
        with path.open("rb") as f:
            f.seek(self._metrics_offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._metrics_offset += len(complete)
        for line in complete.splitlines():
            version = json.loads(line)["version"]
            self.versions.append((time.monotonic(), version))
            for fault in self.faults:
                if fault.healed_at is not None and fault.recovery_s is None and fault.healed_at <= self.now():
                    fault.recovery_s = round(self.now() - fault.healed_at, 3)

    def busy(self) -> set[str]:
        """The roles down, or with a fault not yet recovered from (on, or healed with no learner version since): a
        role is hit again only once the run went on after its last fault (a learner killed again before its restart
        has trained would soak nothing but its start-up)."""
        down = {name for name, pod in self.pods.items() if not pod.running()}
        return down | {fault.target for fault in self.faults if fault.recovery_s is None}

    def inject(self, fault: Fault) -> None:
        from chaos_pods import tear_checkpoint, tear_log

        free = [t for t in fault.targets if t not in self.busy()]
        if not free:
            fault.postponed += 1
            if fault.postponed > MAX_POSTPONED:
                fault.skipped = True
                self.skipped.append(fault)
            return
        pod = fault.target = free[0]
        fault.injected_at = round(self.now(), 3)
        self.faults.append(fault)
        if fault.kind in ("kill", "torn"):
            self.pods[pod].kill()
            if fault.kind == "torn":
                if pod == "replay":  # the first tear of the log truncates it: every soak, the short one too, has one
                    first = not any(f.kind == "torn" and f.target == "replay" for f in self.faults if f is not fault)
                    fault.detail = tear_log(self.run_dir / "replay", self.rng, self.work / "torn", truncate=first)
                else:
                    fault.detail = tear_checkpoint(self.run_dir / "checkpoints", self.rng)
            return
        if fault.kind == "pause":
            self.pods[pod].pause(True)
        elif fault.kind == "partition":
            self.network.cut(pod, True)
        elif fault.kind == "slow":
            self.network.slow(pod, SLOW_RATE)
        elif fault.kind == "disk":
            self.disks[pod].fill()
        self.active.append((fault.injected_at + fault.duration_s, fault))

    def heal(self, fault: Fault) -> None:
        if fault.kind == "pause":
            self.pods[fault.target].pause(False)
        elif fault.kind == "partition":
            self.network.cut(fault.target, False)
        elif fault.kind == "slow":
            self.network.slow(fault.target, None)
        elif fault.kind == "disk":
            self.disks[fault.target].free()
        fault.healed_at = self.now()

    def step(self) -> None:
        self.supervise()
        self.read_versions()
        for entry in [entry for entry in self.active if entry[0] <= self.now()]:
            self.active.remove(entry)
            self.heal(entry[1])
        time.sleep(0.1)

    # --- the phases ---

    def warm_up(self) -> None:
        deadline = time.monotonic() + WARMUP_S
        while not self.versions:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no learner version within {WARMUP_S:.0f} s: see {self.logs}")
            self.step()

    def nemesis(self) -> float:
        self.window_start, self.window_start_unix = time.monotonic(), time.time()
        window_s = self.args.minutes * 60
        planned = schedule(self.args.seed, window_s, self.args.gap_s)
        while self.now() < window_s:
            for fault in [f for f in planned if f.at + f.postponed * POSTPONE_S <= self.now()]:
                self.inject(fault)
                if fault.target is not None or fault.skipped:
                    planned.remove(fault)
            self.step()
        for _, fault in self.active:
            self.heal(fault)
        self.active.clear()
        return window_s

    def drain(self) -> float:
        """Every role up, then the learner restarted at its budget (its version + DRAIN_VERSIONS); until it is
        reached."""
        started = time.monotonic()
        while not all(pod.running() for pod in self.pods.values()):
            if time.monotonic() - started > DRAIN_S:
                raise RuntimeError("the roles did not all come back after the window")
            self.step()
        while not self.versions or self.versions[-1][0] < started:  # a version after the heal: the run goes on
            if time.monotonic() - started > DRAIN_S:
                raise RuntimeError("no learner version after the window")
            self.step()
        self.budget = max(v for _, v in self.versions) + DRAIN_VERSIONS
        self.pods["learner"].stop()  # SIGTERM: it checkpoints and stops; started again with the budget
        self.pods["learner"].done = False
        while not self.pods["learner"].done:
            if time.monotonic() - started > DRAIN_S:
                raise RuntimeError(f"the learner did not reach its budget v{self.budget} within {DRAIN_S:.0f} s")
            self.step()
        return time.monotonic() - started


def recoveries(faults: list[Fault]) -> dict[str, dict]:
    by_kind: dict[str, dict] = {}
    for kind in KINDS:
        times = [f.recovery_s for f in faults if f.kind == kind and f.recovery_s is not None]
        by_kind[kind] = {"n": len(times), "median_s": round(statistics.median(times), 2) if times else None,
                         "max_s": max(times) if times else None,
                         "unrecovered": sum(1 for f in faults if f.kind == kind and f.recovery_s is None)}
    return by_kind


def fresh(path: Path) -> Path:
    """`path`, or `path`-2, -3, ...: the first that does not exist."""
    n, candidate = 1, path
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def run(args: argparse.Namespace) -> dict:
    from chaos_check import check

    work = (args.out or fresh(REPO / "benchmarks" / "out" / f"chaos-{args.seed}")).resolve()
    if work.exists() and any(work.iterdir()):
        raise SystemExit(f"chaos: {work} is not empty (a run of its own each time: pass another --out)")
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    soak = Soak(args, work)
    atexit.register(soak.close)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally below cleans up
    failure, warm_up_s, window_s, drain_s = None, None, None, None
    try:
        soak.open()
        soak.warm_up()
        warm_up_s = round(time.monotonic() - started, 1)
        window_s = soak.nemesis()
        drain_s = round(soak.drain(), 1)
    except RuntimeError as exc:  # a phase past its time limit: a finding, checked and reported like the rest
        failure = str(exc)
    finally:
        soak.close()
        atexit.unregister(soak.close)
    target = soak.budget if soak.budget != UNBOUNDED else max((v for _, v in soak.versions), default=0)
    faults = soak.faults
    (work / "faults.jsonl").write_text("".join(json.dumps(asdict(f)) + "\n" for f in faults))  # the checker reads it
    (work / "summary.json").write_text(json.dumps({"window_start_unix": soak.window_start_unix}))
    numbers, problems = check(soak.run_dir, work / "replay-archive", work / "volumes" / "replay", target)
    problems = [failure] * (failure is not None) + problems
    problems += [f"{name} exited by itself with {pod.unexpected} (see {soak.logs / name}.log)"
                 for name, pod in soak.pods.items() if pod.unexpected]
    summary = {
        "passed": not problems, "problems": problems,
        "command": shlex.join(["python", "benchmarks/chaos.py", *sys.argv[1:]]), "seed": args.seed,
        "wall_s": round(time.monotonic() - started, 1), "warm_up_s": warm_up_s, "window_s": window_s,
        "drain_s": drain_s, "window_start_unix": soak.window_start_unix, "faults": len(faults),
        "faults_by_kind": {kind: sum(1 for f in faults if f.kind == kind) for kind in KINDS},
        "faults_skipped": len(soak.skipped),
        "restarts": {name: len(pod.starts) - 1 for name, pod in soak.pods.items()},
        "exit_codes": {name: sorted(set(pod.exits)) for name, pod in soak.pods.items()},
        "unexpected_exits": {name: pod.unexpected for name, pod in soak.pods.items()},
        "recovery_to_next_version": recoveries(faults), "replay_files_archived": soak.archived, **numbers,
        "out": str(work),
    }
    (work / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = run(args)
    print(json.dumps(summary))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
