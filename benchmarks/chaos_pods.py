"""The pods and the nemesis of benchmarks/chaos.py: each role's process restarted as a pod's restart policy would,
and the faults done to them (kill, pause, partition, slow link, full disk, torn log or checkpoint).

A `Pod` runs `python -m launch.cli ROLE --config CFG` in its network namespace (tests/netns.py) in a session of its
own, its output appended to logs/<name>.log. The pods' restart is what deploy/k8s does, not `async-rl train`'s
launcher: the same command again in the same run directory, so the replay rebuilds itself from its log and the
learner resumes from its latest good checkpoint (both do that by themselves on an existing run directory).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from disk_helpers import fill  # noqa: E402
from netns import Network  # noqa: E402

from learner import checkpoint  # noqa: E402
from replay.log_format import HEADER, SEGMENT  # noqa: E402

RESTART_DELAY_S = 0.5  # a restart policy's back-off, kept short: the soak wants many recoveries


class Pod:
    """One role: its command (`argv()`, asked again at every start), its process, its starts and exits."""

    def __init__(self, name: str, argv: Callable[[], list[str]], network: Network, logs: Path) -> None:
        self.name, self.argv, self.network, self.logs = name, argv, network, logs
        self.process: subprocess.Popen | None = None
        self.starts: list[float] = []
        self.exits: list[int] = []
        self.unexpected: list[int] = []  # exit codes of exits neither the nemesis nor the harness caused
        self.expecting = False  # a kill or stop was sent: the next exit is ours
        self.down_since: float | None = None
        self.done = False  # exited for good (the learner at its budget; every pod at the end)
        self.paused = False

    def start(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        with (self.logs / f"{self.name}.log").open("a") as log:
            log.write(f"--- chaos: start {len(self.starts) + 1} at {time.time():.3f}\n")
            log.flush()
            self.process = subprocess.Popen(["ip", "netns", "exec", self.network.ns(self.name), *self.argv()],
                                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.logs,
                                            start_new_session=True)
        self.starts.append(time.monotonic())
        self.down_since = None

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def reap(self) -> int | None:
        """The exit code of a process that ended since the last call (None: still running, or already reaped)."""
        if self.process is None or self.down_since is not None or self.process.poll() is None:
            return None
        self.down_since = time.monotonic()
        self.exits.append(self.process.returncode)
        if not self.expecting:
            self.unexpected.append(self.process.returncode)
        self.expecting = False
        return self.process.returncode

    def due_restart(self, now: float) -> bool:
        return not self.done and self.down_since is not None and now - self.down_since >= RESTART_DELAY_S

    def signal(self, signum: int) -> None:
        """`signum` to the pod's whole process group (a role's helpers too)."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended in between
                os.killpg(self.process.pid, signum)

    def kill(self) -> None:
        """SIGKILL, and wait until it is gone (it is then reaped, and restarted by the supervisor)."""
        self.expecting = True
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait()
        self.paused = False
        self.reap()

    def pause(self, frozen: bool) -> None:
        self.paused = frozen
        self.signal(signal.SIGSTOP if frozen else signal.SIGCONT)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (after SIGCONT), then SIGKILL past `timeout_s`; it stays down."""
        self.done = self.expecting = True
        self.pause(False)
        self.signal(signal.SIGTERM)
        if self.process is None:
            return
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.process.wait()
        self.reap()


class Disk:
    """A small tmpfs that stands for a role's volume; `fill` and `free` it."""

    def __init__(self, mount: Path, size: str) -> None:
        self.mount, self.size = mount, size
        self.filler: Path | None = None
        self.mounted = False

    def open(self) -> Disk:
        self.mount.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", str(self.mount)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"cannot mount a tmpfs on {self.mount} (needs root): {done.stderr.strip()}")
        self.mounted = True
        return self

    def fill(self) -> None:
        self.filler = fill(self.mount)

    def free(self) -> None:
        if self.filler is not None:
            self.filler.unlink(missing_ok=True)
            self.filler = None

    def close(self) -> None:
        self.free()
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.mount)], check=False, capture_output=True)
            self.mounted = False


TRUNCATE_WITHIN = 16384  # a truncating tear cuts the last segment at a random offset in its last this many bytes


def tear_log(replay_dir: Path, rng: random.Random, keep: Path | None = None, truncate: bool = False) -> str:
    """Tear the end of the replay's log (the replay is down), one of two ways, drawn half and half:
    - frame: what a crash mid-write leaves, a frame cut off mid-write (its header promises more bytes than follow);
      nothing acknowledged is touched;
    - truncate: a disk that loses acknowledged bytes: the last segment cut at a random offset in its last
      TRUNCATE_WITHIN bytes (mid-frame or not), fsynced and acknowledged frames among what is cut. A copy of the
      segment as it was is written to `keep` first (`<n>-<segment name>`) so the checker can read what was cut.
    `truncate`: truncate whatever the draw (the draw is made all the same, so the bytes that follow do not change).
    Returns what was done (a line of the fault's detail: "truncate <name> <old size> -> <new size>" or "frame ...")."""
    segments = sorted(p for p in replay_dir.iterdir() if SEGMENT.fullmatch(p.name))
    if not segments:
        return "no segment to tear"
    last = segments[-1]
    size = last.stat().st_size
    if (rng.random() < 0.5 or truncate) and size > 0:
        cut = rng.randint(max(0, size - TRUNCATE_WITHIN), size - 1)
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            n = len(list(keep.iterdir()))
            (keep / f"{n:04d}-{last.name}").write_bytes(last.read_bytes())
        os.truncate(last, cut)
        return f"truncate {last.name} {size} -> {cut}"
    length = rng.randint(64, 4096)
    with open(last, "ab") as f:
        f.write(HEADER.pack(length, rng.getrandbits(32)) + rng.randbytes(rng.randint(0, length - 1)))
    return f"frame {last.name}: a frame of {length} bytes cut off"


def tear_checkpoint(directory: Path, rng: random.Random) -> str:
    """The newest good checkpoint's largest file truncated at a random offset (a node crash or a bad disk), when an
    older good one is left to fall back to (the learner refuses to start with none: by design, not a finding)."""
    good = [v for v in sorted(checkpoint.versions(directory), reverse=True)
            if checkpoint.problem(directory / f"v{v}") is None]
    if len(good) < 2:
        return "no checkpoint to tear (fewer than two good ones)"
    tag = directory / f"v{good[0]}"
    files = sorted((p for p in tag.rglob("*") if p.is_file() and p.name != checkpoint.MANIFEST),
                   key=lambda p: p.stat().st_size)
    victim = files[-1]
    size = victim.stat().st_size
    keep = rng.randint(0, max(0, size - 1))  # a random offset: anything from an empty file to one byte short
    os.truncate(victim, keep)
    return f"{victim.relative_to(directory)}: truncated {size} -> {keep} bytes"
