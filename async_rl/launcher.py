"""`async-rl train`: replay, learner and rollout workers as separate OS processes on this machine.

Each child runs `python -m async_rl.cli ROLE --config <run_dir>/config.yaml` (the same command a cluster pod
runs), in its own session so that Ctrl-C reaches the launcher alone, which then stops the learner first (it
writes the summary) and the others after it. A role that dies is started again, at most `run.max_restarts` times
each (the learner resumes from its latest checkpoint, the replay rolls back to it and abandons what a dead worker
held; a durable replay rebuilds its state from its write-ahead log); a role past its restarts (or a replay with
`replay.durable=false`, or a role stopped by a config error, exit CONFIG_EXIT_CODE, which would only stop again)
is reported by name with the tail of its log, and the run stops with a non-zero exit (`async-rl train --resume
RUN_DIR` continues it).
The last stdout line is one JSON object with the run's result.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from rich.columns import Columns
from rich.console import Console
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table

from async_rl.config import Config, configured_model_path, dump_config
from async_rl.errors import CONFIG_EXIT_CODE, ConfigError
from async_rl.security import ROLES, load_keys

log = logging.getLogger("async_rl.launcher")

STOP_GRACE_S = 20.0


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log_path: Path
    log_file: IO = field(repr=False)


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _local_endpoint(endpoint: str, socket_path: Path) -> str:
    """`auto` (or a configured loopback port that is taken) becomes a Unix socket in the run directory: unlike a
    "free" port, no other run on the machine can take it between now and the bind."""
    loopback = endpoint.startswith("tcp://127.0.0.1:")
    if endpoint != "auto" and (not loopback or _port_free("127.0.0.1", int(endpoint.rsplit(":", 1)[1]))):
        return endpoint
    if len(str(socket_path.resolve())) < 100:  # the limit of a Unix socket path
        replacement = f"ipc://{socket_path.resolve()}"
    else:
        replacement = f"tcp://127.0.0.1:{_free_port()}"
    if endpoint != "auto":
        log.info("%s is in use; using %s", endpoint, replacement)
    return replacement


def _fresh_run_dir(config: Config) -> Config:
    """Never write over an earlier run: `runs/local` becomes `runs/local-2`, `-3`, ..."""
    import msgspec

    name, n = config.run.name, 1
    while (Path(config.run.dir) / name).exists():
        n += 1
        name = f"{config.run.name}-{n}"
    run_dir = Path(config.run.dir) / name
    replay = msgspec.structs.replace(
        config.replay, endpoint=_local_endpoint(config.replay.endpoint, run_dir / "replay.sock")
    )
    learner = msgspec.structs.replace(
        config.learner, publish_endpoint=_local_endpoint(config.learner.publish_endpoint, run_dir / "weights.sock")
    )
    run = msgspec.structs.replace(config.run, name=name)
    return msgspec.structs.replace(config, run=run, replay=replay, learner=learner)


def _check_run_dir_creatable(run_dir: Path) -> None:
    """Fail at once, naming the path, if the run directory cannot be created (before anything is started).
    Probes the nearest existing ancestor by creating and removing a directory in it (os.access says yes to root
    on a read-only mount)."""
    existing = run_dir.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"run.dir: cannot create the run directory {run_dir}: {existing} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".async-rl-probe-", dir=existing))
    except OSError as exc:
        raise ConfigError(
            f"run.dir: cannot create the run directory {run_dir}: {existing} is not writable ({exc.strerror})"
        ) from None


def preflight(config: Config, resume: bool = False) -> None:
    """What `async-rl train` can refuse before creating anything, and before importing torch (seconds on a busy
    machine) unless a device is set to cuda: a missing or invalid model.path, cuda without a GPU, missing CURVE keys,
    a run directory that cannot be created. Raises ConfigError naming the path or the key."""
    configured_model_path(config)
    _check_devices(config)
    for role in ROLES:  # security.curve_dir: every role's key files are there (all roles run here)
        load_keys(config, role)
    if not resume:
        _check_run_dir_creatable(_fresh_run_dir(config).run_dir)


def _check_devices(config: Config) -> None:
    """learner.device or rollout.device (torch engine) set to cuda on a machine where torch sees no GPU: refused
    here, before any role starts (a rollout worker that found out itself would be restarted to the same error).
    torch is imported only when cuda is asked for."""
    asked = [("learner.device", config.learner.device)]
    if config.rollout.engine == "torch":
        asked.append(("rollout.device", config.rollout.device))
    asked = [(key, value) for key, value in asked if value == "cuda"]
    if asked:
        import torch

        from async_rl.model import resolve_device

        for key, value in asked:
            resolve_device(value, key, torch.cuda.is_available())


def resume_config(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config of the run in `run_dir` (its config.yaml, with `overrides` on top), pointed at that directory
    wherever the command runs from. Raises ConfigError naming what is missing."""
    import msgspec

    from async_rl.config import load_config

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--resume: {run_dir} is not a run directory (no config.yaml)")
    config = load_config(run_dir / "config.yaml", list(overrides))
    run = msgspec.structs.replace(config.run, dir=str(run_dir.resolve().parent), name=run_dir.resolve().name)
    return msgspec.structs.replace(config, run=run)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _stop_with_launcher(launcher_pid: int):
    """A `preexec_fn` (runs in the child between fork and exec): the kernel sends the child SIGTERM when the
    launcher dies, even by SIGKILL, so no role outlives it (children are in their own sessions, so nothing
    else would reach them). Linux only; elsewhere a killed launcher still leaves its children running."""

    def arm() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher_pid:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return arm if sys.platform.startswith("linux") else None


def _start(name: str, args: list[str], config_path: Path, run_dir: Path, env: dict[str, str]) -> Child:
    log_path = run_dir / "logs" / f"{name}.log"
    log_file = open(log_path, "ab")  # noqa: SIM115 - closed in _stop_all
    process = subprocess.Popen(
        [sys.executable, "-m", "async_rl.cli", *args, "--config", str(config_path)],
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


def _stop_all(children: list[Child]) -> None:
    """SIGTERM the learner first (it finishes its step and writes the summary), then the rollout workers (they
    deliver what they already sent), then the replay service. `children` is [learner, replay, workers...]."""
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
        child.log_file.close()


class MetricsTail:
    """Follows <run_dir>/metrics.jsonl, the learner's one-line-per-step record, while the learner appends to it.

    Only whole lines are read: the bytes after the last newline are a line being written and wait for the next
    poll. (Iterating the file as text read such a tail as one line and, once the writer had added the rest, the
    rest as another: `json.loads` of half a line killed `async-rl train` mid-run, seen on 2026-11-26.) A line that
    is still not JSON is skipped: the display never stops a run."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.last = path, 0, {}

    def poll(self) -> dict:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.last
        whole = data[: data.rfind(b"\n") + 1]
        self.offset += len(whole)
        for line in whole.splitlines():
            try:
                parsed = json.loads(line)
            except ValueError:
                log.warning("metrics.jsonl: skipped a line that is not JSON: %r", line[:80])
                continue
            if isinstance(parsed, dict):
                self.last = parsed
        return self.last


def _budget_progress(config: Config, metrics: dict, elapsed: float) -> tuple[float, str]:
    """How far the run is to its nearest budget (the largest fraction of any set budget) and which one."""
    run = config.run
    fractions = []
    if run.max_versions:
        fractions.append((metrics.get("version", 0) / run.max_versions, f"{run.max_versions} versions"))
    if run.max_env_steps:
        fractions.append((metrics.get("env_steps", 0) / run.max_env_steps, f"{run.max_env_steps} env steps"))
    if run.max_wall_s:
        fractions.append((elapsed / run.max_wall_s, f"{run.max_wall_s:.0f} s"))
    if not fractions:
        return 0.0, "no budget"
    fraction, name = max(fractions)
    return min(fraction, 1.0), name


def _progress(config: Config, metrics: dict, elapsed: float) -> tuple[float, str]:
    """The progress bar's fraction and text: toward what will stop the run. With run.target_success, the long-window
    success rate against the target (the stop rule; no ETA, learning is not linear), then the nearest cap;
    without, the nearest cap with the ETA its pace gives."""
    fraction, budget = _budget_progress(config, metrics, elapsed)
    learning_s = metrics.get("wall_s", 0.0)  # since the launcher started, at the learner's last step
    eta = f"{learning_s * (1 - fraction) / fraction:.0f} s" if 0 < fraction < 1 else "-"
    cap = f"{100 * fraction:.0f}% of {budget}, ETA {eta}"
    target = config.run.target_success
    if target is None:
        return fraction, cap
    success = metrics.get("success_rate_long", 0.0)
    return min(success / target, 1.0) if target > 0 else 1.0, f"success {success:.3f} of target {target}; cap: {cap}"


def _state(child: Child) -> str:
    code = child.process.poll()
    if code is None:
        return f"[green]{child.name}[/]"
    return f"[dim]{child.name} done[/]" if code == 0 else f"[red]{child.name} exited {code}[/]"


def _table(metrics: dict, elapsed: float, children: list[Child], config: Config) -> Table:
    table = Table(title="async-rl train", show_header=False, expand=False)
    table.add_column(style="bold cyan")
    table.add_column()
    fraction, progress = _progress(config, metrics, elapsed)
    learning_s = metrics.get("wall_s", 0.0)  # since the launcher started, at the learner's last step
    target = config.run.target_success
    rows = [
        ("progress", Columns([ProgressBar(total=1.0, completed=fraction, width=30), progress])),
        ("elapsed", f"{elapsed:.0f} s"),
        ("policy version", metrics.get("version", 0)),
        ("env steps", metrics.get("env_steps", 0)),
        ("throughput", "{:.1f} env steps/s, {:.2f} versions/s, {:.0f} tokens/s trained".format(
            metrics.get("env_steps", 0) / learning_s if learning_s else 0.0,
            metrics.get("version", 0) / learning_s if learning_s else 0.0, metrics.get("tokens_per_s", 0.0))),
        ("success rate (long window)", "{:.3f} ({:.3f}){}".format(
            metrics.get("success_rate", 0.0), metrics.get("success_rate_long", 0.0),
            f", target {target}" if target is not None else "")),
        ("stage reward", f"{metrics.get('stage_reward_mean', 0.0):.3f}"),
        ("staleness mean / max imm / max corr", "{:.2f} / {} / {}".format(
            metrics.get("staleness_mean", 0.0), metrics.get("staleness_max_immediate", 0),
            metrics.get("staleness_max_correction", 0))),
        ("items immediate / correction", f"{metrics.get('items_immediate', 0)} / {metrics.get('items_correction', 0)}"),
        ("ledger residual", f"{metrics.get('ledger_residual_max', 0.0):.1e}"),
        ("processes", " ".join(_state(c) for c in children)),
    ]
    for key, value in rows:
        table.add_row(key, value if isinstance(value, Columns) else str(value))
    return table


def _evaluate(config: Config, console: Console) -> dict:
    """The final weights on every task (the windowed training metric is noisy), as `async-rl evaluate` does, in this
    process: it has torch and the model code loaded already. A new `async-rl evaluate` process took 19 s to import
    them and exit around a 0.6 s evaluation (the 2-core machine at load 12, 2026-11-27). The evaluation's log goes
    to logs/evaluate.log; a failure leaves the run's result without it."""
    from rollout.evaluate import evaluate

    console.print("evaluating the final weights on every task ...")
    log_path = config.run_dir / "logs" / "evaluate.log"
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [evaluate] %(name)s: %(message)s"))
    root = logging.getLogger()
    saved, root.handlers = root.handlers, [handler]
    try:
        return evaluate(config, max(1, config.run.eval_samples_per_task))
    except Exception:  # any failure of the evaluation: the run's own result stands
        log.exception("evaluation failed")
        console.print(f"[red]evaluation failed; see {log_path}[/]")
        return {}
    finally:
        root.handlers = saved
        handler.close()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def train(config: Config, resume: bool = False) -> int:
    """Run every role until the learner stops. `resume`: `config` is a run's own (`resume_config`): its directory is
    reused (logs and metrics.jsonl appended) and the learner resumes from its latest checkpoint there."""
    # The rollout side owns the environment (rollout/prepare.py); the launcher only composes the roles. A bad
    # env.name or env.kwargs stops here, before the run directory or any process exists.
    from rollout.prepare import load_env, prepare_model_dir

    preflight(config, resume)
    factory = load_env(config)
    if not resume:
        config = _fresh_run_dir(config)
    run_dir = config.run_dir
    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=resume)
    except OSError as exc:
        raise ConfigError(f"run.dir: cannot create the run directory {run_dir}: {exc}") from None
    config_path = run_dir / "config.yaml"
    dump_config(config, config_path)
    prepare_model_dir(config, factory)  # once, before the roles race for it (its tokenizer depends on the env)
    env = dict(os.environ, ASYNC_RL_RUN_START=str(time.time()), OMP_NUM_THREADS=str(config.run.threads_per_process))
    console = Console(stderr=True)
    console.print(f"[bold]async-rl[/] {'resuming' if resume else 'run dir'} [cyan]{run_dir}[/] (logs in "
                  f"{run_dir / 'logs'})")

    roles = [("learner", ["learner"]), ("replay", ["replay"])]
    roles += [(f"rollout-{i}", ["rollout", "--index", str(i)]) for i in range(config.rollout.workers)]
    children = [_start(name, args, config_path, run_dir, env) for name, args in roles]
    (run_dir / "processes.json").write_text(json.dumps({c.name: c.process.pid for c in children}))
    # A role that dies is started again: the learner resumes from its checkpoint (the replay rolls back to it), a
    # worker's leases are abandoned, and a durable replay rebuilds its state from its write-ahead log (a replay
    # with replay.durable=false is not: its state died with it).
    restarts = {name: 0 for name, _ in roles if name != "replay" or config.replay.durable}
    interrupted = failed = None
    started = time.monotonic()
    metrics = MetricsTail(run_dir / "metrics.jsonl")
    # SIGINT explicitly too: a shell without job control starts background commands with SIGINT ignored, and
    # Python then never installs its KeyboardInterrupt handler, so `kill -INT` would be ignored.
    previous_handlers = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    last_plain = 0.0
    try:
        with Live(console=console, refresh_per_second=2, transient=False) as live:
            while True:
                time.sleep(0.5)
                elapsed = time.monotonic() - started
                live.update(_table(metrics.poll(), elapsed, children, config))
                if not console.is_terminal and elapsed - last_plain >= 15:
                    last_plain = elapsed
                    m = metrics.last
                    log.info("t=%.0fs version=%s env_steps=%s success=%.3f", elapsed, m.get("version", 0),
                             m.get("env_steps", 0), m.get("success_rate", 0.0))
                learner = children[0].process.poll()
                if learner == 0:
                    break
                dead = [c for c in children if c.process.poll() is not None]
                for child in dead[:]:
                    config_error = child.process.returncode == CONFIG_EXIT_CODE  # it would stop the same way again
                    if child.name in restarts and restarts[child.name] < config.run.max_restarts and not config_error:
                        restarts[child.name] += 1
                        log.warning("%s died (exit code %s); starting it again (restart %d of %d)", child.name,
                                    child.process.returncode, restarts[child.name], config.run.max_restarts)
                        console.print(f"[yellow]{child.name} died (exit code {child.process.returncode}); "
                                      f"restart {restarts[child.name]} of {config.run.max_restarts}[/]")
                        child.log_file.close()
                        index = children.index(child)
                        children[index] = _start(child.name, dict(roles)[child.name], config_path, run_dir, env)
                        (run_dir / "processes.json").write_text(json.dumps({c.name: c.process.pid for c in children}))
                        dead.remove(child)
                if dead:
                    failed = dead[0]
                    break
    except KeyboardInterrupt:
        interrupted = True
        console.print("[yellow]interrupted: stopping every process[/]")
    finally:
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
        _stop_all(children)

    if failed is not None:
        code = failed.process.returncode
        again = f" after {restarts[failed.name]} restart(s)" if restarts.get(failed.name) else ""
        if code == CONFIG_EXIT_CODE:
            again = " on a config error, not restarted"
        console.print(f"[red bold]{failed.name} died (exit code {code}){again}; the run is stopped[/] (continue it "
                      f"with async-rl train --resume {run_dir}). Last lines of {failed.log_path}:\n"
                      f"{_tail(failed.log_path)}", soft_wrap=True)  # unwrapped: the command must copy-paste
        return 1
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        console.print(f"[red]the learner wrote no summary; see {children[0].log_path}[/]")
        return 1
    summary = json.loads(summary_path.read_text())
    result = {key: summary.get(key) for key in ("final_success_rate", "env_steps", "versions", "wall_s", "run_dir")}
    result["stop_reason"] = summary.get("stop_reason")
    if config.run.eval_samples_per_task > 0 and not interrupted:
        result.update(_evaluate(config, console))
    print(json.dumps(result), flush=True)
    return 130 if interrupted else 0
