"""The roles of a local run as child processes: each runs `async-rl ROLE --config <run_dir>/config.yaml` (the same
command a cluster pod runs) in its own session, so that Ctrl-C reaches the launcher alone; started again when it
dies, at most `run.max_restarts` times each; stopped learner first. The learner and the rollout workers are forked
from the run's fork server when there is one (launch/forkserver.py: the imports paid once), the replay (no torch)
and every role where there is none start as `python -m launch.cli ...`.

A restarted learner resumes from its latest checkpoint (the replay rolls back to it and abandons what a dead worker
held); a durable replay rebuilds its state from its write-ahead log. A role past its restarts, a replay with
`replay.durable=false` (its state died with it), or a role stopped by a config error (exit CONFIG_EXIT_CODE, which
would only stop again) is not started again: the run stops (`async-rl train --resume RUN_DIR` continues it)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from rich.console import Console

from async_rl.config import Config
from async_rl.errors import CONFIG_EXIT_CODE
from launch.forkserver import ForkedProcess, ForkServer, die_with_parent

log = logging.getLogger("launch.supervise")

STOP_GRACE_S = 20.0


def cli_command(*args: str) -> list[str]:
    """The `async-rl` command as this interpreter runs it (a child sees the launcher's environment and path)."""
    return [sys.executable, "-m", "launch.cli", *args]


@dataclass
class Child:
    name: str
    process: subprocess.Popen | ForkedProcess
    log_path: Path
    log_file: IO | None = field(repr=False)  # the launcher's handle on the log (None: a forked role opened its own)


def _stop_with_launcher(launcher_pid: int):
    """A `preexec_fn` (runs in the child between fork and exec): the kernel sends the child SIGTERM when the
    launcher dies, even by SIGKILL, so no role outlives it (children are in their own sessions, so nothing
    else would reach them). Linux only; elsewhere a killed launcher still leaves its children running."""
    return (lambda: die_with_parent(launcher_pid)) if sys.platform.startswith("linux") else None


def _start(name: str, args: list[str], config_path: Path, env: dict[str, str], forks: ForkServer | None) -> Child:
    log_path = config_path.parent / "logs" / f"{name}.log"
    if forks is not None and name != "replay" and forks.alive():
        try:
            return Child(name, forks.start([*args, "--config", str(config_path)], str(log_path), env), log_path, None)
        except OSError as exc:
            log.warning("%s; starting %s as a new process", exc, name)
    log_file = open(log_path, "ab")  # noqa: SIM115 - closed in Supervisor.stop_all or at the restart
    process = subprocess.Popen(
        cli_command(*args, "--config", str(config_path)),
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=_stop_with_launcher(os.getpid()),
    )
    return Child(name, process, log_path, log_file)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Supervisor:
    """The run's children, [learner, replay, rollout-0, ...], and how often each was started again."""

    def __init__(self, config: Config, config_path: Path, env: dict[str, str], console: Console,
                 forks: ForkServer | None = None) -> None:
        self.config, self.config_path, self.env, self.console = config, config_path, env, console
        self.forks = forks
        self.roles = {"learner": ["learner"], "replay": ["replay"]}
        self.roles.update({f"rollout-{i}": ["rollout", "--index", str(i)] for i in range(config.rollout.workers)})
        # The replay first: it starts in a second while the fork server imports (the others wait for it).
        replay = _start("replay", self.roles["replay"], config_path, env, forks)
        self.children = [replay if name == "replay" else _start(name, args, config_path, env, forks)
                         for name, args in self.roles.items()]
        self._write_pids()
        self.restarts = {name: 0 for name in self.roles if name != "replay" or config.replay.durable}

    def _write_pids(self) -> None:
        pids = {c.name: c.process.pid for c in self.children}
        if self.forks is not None:
            pids["forkserver"] = self.forks.process.pid
        (self.config_path.parent / "processes.json").write_text(json.dumps(pids))

    def learner_finished(self) -> bool:
        return self.children[0].process.poll() == 0

    def restart_dead(self) -> Child | None:
        """Start again every dead role that may be; returns the first that may not (the run stops), or None."""
        dead = [c for c in self.children if c.process.poll() is not None]
        failed = [child for child in dead if not self._may_restart(child)]
        for child in dead:
            if child not in failed:
                self._restart(child)
        return failed[0] if failed else None

    def _may_restart(self, child: Child) -> bool:
        config_error = child.process.returncode == CONFIG_EXIT_CODE  # it would stop the same way again
        return child.name in self.restarts and self.restarts[child.name] < self.config.run.max_restarts \
            and not config_error

    def _restart(self, child: Child) -> None:
        self.restarts[child.name] += 1
        code, count, most = child.process.returncode, self.restarts[child.name], self.config.run.max_restarts
        log.warning("%s died (exit code %s); starting it again (restart %d of %d)", child.name, code, count, most)
        self.console.print(f"[yellow]{child.name} died (exit code {code}); restart {count} of {most}[/]")
        if child.log_file is not None:
            child.log_file.close()
        self.children[self.children.index(child)] = _start(child.name, self.roles[child.name], self.config_path,
                                                           self.env, self.forks)
        self._write_pids()

    def failure(self, failed: Child) -> str:
        """Which role stopped the run and why, the command that continues it, and the tail of the role's log."""
        code = failed.process.returncode
        again = f" after {self.restarts[failed.name]} restart(s)" if self.restarts.get(failed.name) else ""
        if code == CONFIG_EXIT_CODE:
            again = " on a config error, not restarted"
        return (f"[red bold]{failed.name} died (exit code {code}){again}; the run is stopped[/] (continue it with "
                f"async-rl train --resume {self.config.run_dir}). Last lines of {failed.log_path}:\n"
                f"{_tail(failed.log_path)}")

    def stop_all(self) -> None:
        """SIGTERM the learner first (it finishes its step and writes the summary), then the rollout workers (they
        deliver what they already sent), then the replay service."""
        children = self.children
        for group in (children[:1], children[2:], children[1:2]):
            for child in group:
                if child.process.poll() is None:
                    child.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for child in group:
                try:
                    child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0f s; killing it", child.name, STOP_GRACE_S)
                    child.process.kill()
                    child.process.wait()
        for child in children:
            if child.log_file is not None:
                child.log_file.close()
