"""`async-rl train`, the flow of a local run: check what can be refused, create the run directory, start the replay,
the learner and the rollout workers as separate OS processes (launch/supervise.py; a rollout worker builds the tiny
model's directory, the learner waits for it) with the live display (launch/dashboard.py) until the learner stops,
then evaluate the final weights. The last stdout line is one JSON object with the run's result.

The launcher itself imports no torch: the learner, the rollout workers and the final evaluation are forked from a
fork server that imported torch, transformers and DeepSpeed once (launch/forkserver.py). Where there is none (a
machine with a GPU), they start as new processes and the evaluation's code is imported here, on a thread, once the
learner has trained its first version.

Ctrl-C (or SIGTERM) reaches the launcher alone, which then stops the learner first (it writes the summary) and the
others after it. A role that dies is started again within `run.max_restarts`; a role that cannot be is reported
by name with the tail of its log, and the run stops with a non-zero exit (`async-rl train --resume RUN_DIR`
continues it)."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

from rich.console import Console

from async_rl.config import Config
from async_rl.durable import write_atomically
from launch import forkserver
from launch.dashboard import Dashboard
from launch.preflight import preflight
from launch.rundir import create_run_dir, fresh_run_dir, keys_for_loopback
from launch.supervise import Child, Supervisor
from replay.log_format import check_format
from rollout.envs.base import load_factory

log = logging.getLogger("launch.train")


def train(config: Config, resume: bool = False) -> int:
    """Run every role until the learner stops; returns the exit code. `resume`: `config` is a run's own
    (async_rl.config_load.load_run_config): its directory is reused (logs and metrics.jsonl appended) and the learner
    resumes from its latest checkpoint there."""
    preflight(config, resume)
    if resume and config.replay.durable:
        check_format(config.run_dir / "replay")  # a log this build cannot read: refused before any role starts
    load_factory(config.env.name, config.env.kwargs)  # a bad env.name or env.kwargs stops here, before the run dir
    if not resume:
        config = keys_for_loopback(fresh_run_dir(config))
    config_path = create_run_dir(config, resume)
    env = dict(os.environ, ASYNC_RL_RUN_START=str(time.time()), OMP_NUM_THREADS=str(config.run.threads_per_process))
    console = Console(stderr=True)
    console.print(f"[bold]async-rl[/] {'resuming' if resume else 'run dir'} [cyan]{config.run_dir}[/] (logs in "
                  f"{config.run_dir / 'logs'})")
    forks = forkserver.ForkServer(env, config.run_dir / "logs" / "forkserver.log") if forkserver.usable() else None
    try:
        supervisor = Supervisor(config, config_path, env, console, forks)
        preload = None if forks is not None else threading.Thread(target=_import_evaluation, name="import-evaluation",
                                                                  daemon=True)
        failed, interrupted = _supervise(supervisor, config, console, preload)
        if preload is not None and preload.is_alive():
            preload.join()  # not left importing into an interpreter that is shutting down
        if failed is not None:
            console.print(supervisor.failure(failed), soft_wrap=True)  # unwrapped: the command must copy-paste
            return 1
        result = _result(config, supervisor.children[0], console)
        if result is None:
            return 1
        if config.run.eval_samples_per_task > 0 and not interrupted:
            result.update(_evaluate(config, console, forks, env, config_path))
        print(json.dumps(result), flush=True)
        return 130 if interrupted else 0
    finally:
        if forks is not None:
            forks.close()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _import_evaluation() -> None:
    import rollout.evaluate  # noqa: F401 - torch, transformers and the engine, for the final evaluation


def _supervise(supervisor: Supervisor, config: Config, console: Console,
               preload: threading.Thread | None) -> tuple[Child | None, bool]:
    """Until the learner finishes, a role fails for good (returned), or Ctrl-C / SIGTERM (True); then every
    process is stopped. `preload` (if any) starts once the learner has trained a version (the roles' own imports
    done)."""
    # SIGINT explicitly too: a shell without job control starts background commands with SIGINT ignored, and
    # Python then never installs its KeyboardInterrupt handler, so `kill -INT` would be ignored.
    previous_handlers = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with Dashboard(config, console) as dashboard:
            while True:
                time.sleep(0.5)
                dashboard.update(supervisor.children)
                if preload is not None and preload.ident is None and config.run.eval_samples_per_task > 0 and (
                        config.run_dir / "metrics.jsonl").exists():
                    preload.start()
                if supervisor.learner_finished():
                    return None, False
                failed = supervisor.restart_dead()
                if failed is not None:
                    return failed, False
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping every process[/]")
        return None, True
    finally:
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
        supervisor.stop_all()


ROLLOUT_COUNTS = ("sandbox_executions", "sandbox_executions_without_namespaces")  # rollout side, into the summary


def _result(config: Config, learner: Child, console: Console) -> dict | None:
    """The run's result from the summary the learner wrote, or None (said on the console) if it wrote none. Once
    every role has stopped, the rollout side's counts (`rollout_counts`) are added to summary.json and the result:
    the learner cannot know them."""
    summary_path = config.run_dir / "summary.json"
    if not summary_path.exists():
        console.print(f"[red]the learner wrote no summary; see {learner.log_path}[/]")
        return None
    summary = json.loads(summary_path.read_text())
    counts = rollout_counts(config.run_dir / "metrics")
    if any(summary.get(key) != value for key, value in counts.items()):
        summary.update(counts)
        write_atomically(summary_path, json.dumps(summary, indent=2), durable=False)
    result = {key: summary.get(key) for key in ("final_success_rate", "env_steps", "versions", "wall_s", "run_dir")}
    result["stop_reason"] = summary.get("stop_reason")
    result.update(counts)
    return result


def rollout_counts(metrics_dir: Path) -> dict[str, int]:
    """The rollout workers' cumulative counts (ROLLOUT_COUNTS) over the run, from their metrics lines: per worker
    file, the last count of each process (a restarted worker counts from 0 again: a count that went down began a
    new process), summed over workers. A torn last line is skipped."""
    totals = dict.fromkeys(ROLLOUT_COUNTS, 0)
    for path in sorted(metrics_dir.glob("rollout-*.jsonl")):
        last: dict[str, int] = {}
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            for key in ROLLOUT_COUNTS:
                value = record.get(key) if isinstance(record, dict) else None
                if not isinstance(value, int):
                    continue
                if value < last.get(key, 0):  # a new process: the one before it ended at `last`
                    totals[key] += last[key]
                last[key] = value
        for key, value in last.items():
            totals[key] += value
    return totals


def _evaluate(config: Config, console: Console, forks: forkserver.ForkServer | None, env: dict[str, str],
              config_path: Path) -> dict:
    """The final weights on every task (the windowed training metric is noisy): `async-rl evaluate` forked from the
    fork server, else in this process, which imported torch and the model code during the run (a new process took
    19 s to import them and exit around a 0.6 s evaluation, the 2-core machine at load 12). The evaluation's log
    goes to logs/evaluate.log; a failure leaves the run's result without it."""
    console.print("evaluating the final weights on every task ...")
    log_path = config.run_dir / "logs" / "evaluate.log"
    if forks is not None and forks.alive():
        return _evaluate_forked(forks, env, config_path, log_path, console)
    import torch
    from transformers.utils import logging as hf_logging

    from rollout.evaluate import evaluate

    # Here, in the launcher's own process, as launch/roles.py does for a role (`train` leaves torch alone there).
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(config.run.threads_per_process)
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


def _evaluate_forked(forks: forkserver.ForkServer, env: dict[str, str], config_path: Path, log_path: Path,
                     console: Console) -> dict:
    """`async-rl evaluate --config CONFIG` forked: its JSON line from logs/evaluate.json, or {} (said) on a failure."""
    out_path = log_path.with_suffix(".json")
    try:
        code = forks.start(["evaluate", "--config", str(config_path)], str(log_path), env, str(out_path)).wait()
        lines = out_path.read_text().splitlines() if code == 0 else []
        return json.loads(lines[-1]) if lines else _evaluation_failed(console, log_path)
    except (OSError, ValueError):
        return _evaluation_failed(console, log_path)


def _evaluation_failed(console: Console, log_path: Path) -> dict:
    log.error("evaluation failed; see %s", log_path)
    console.print(f"[red]evaluation failed; see {log_path}[/]")
    return {}
