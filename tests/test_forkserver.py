"""The fork server that `async-rl train` forks its roles from (launch/forkserver.py): a forked command's output, exit
code and signal, a role that dies with the server, and what a run's roles cost to start with it and without."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from optional_packages import skip_module
from test_pipeline import running

from launch import forkserver
from launch.forkserver import ForkServer

if not forkserver.usable():  # off on purpose with a GPU or ASYNC_RL_FORK_SERVER=0; anything else is a failure in CI
    skip_module("no fork server here (not Linux, a GPU, or ASYNC_RL_FORK_SERVER=0)",
                expected=bool(glob.glob("/dev/nvidia[0-9]*")) or os.environ.get("ASYNC_RL_FORK_SERVER") == "0")


@pytest.fixture(scope="module")
def server():
    forks = ForkServer(dict(os.environ))
    yield forks
    forks.close()
    assert forks.process.returncode == 0  # closing its pipe ends it


def test_a_forked_command_writes_its_output_and_exit_code(server, tmp_path):
    log, out = tmp_path / "config.log", tmp_path / "config.out"
    child = server.start(["config", "run.seed=7"], str(log), dict(os.environ), str(out))
    assert child.wait(timeout=120) == 0 and child.returncode == 0
    assert yaml.safe_load(out.read_text())["run"]["seed"] == 7  # `async-rl config`, run in the forked child
    bad = server.start(["config", "run.seed=oops"], str(log), dict(os.environ), str(out))
    assert bad.wait(timeout=60) == 2
    assert "run.seed" in log.read_text()  # its stderr went to the log


def test_a_role_dies_with_a_signal_or_with_the_server(tmp_path):
    """A SIGKILLed role reports -9, as Popen does; a role whose server is killed gets SIGTERM and stops."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"run": {"dir": str(tmp_path), "name": "r"},
                                      "replay": {"endpoint": f"ipc://{tmp_path}/replay.sock"},
                                      "learner": {"publish_endpoint": f"ipc://{tmp_path}/weights.sock"}}))
    forks = ForkServer(dict(os.environ))
    try:
        def wait_listening(times: int, role) -> None:  # noqa: ANN001 - ForkedProcess
            deadline = time.monotonic() + 60
            log = tmp_path / "replay.log"
            while not log.exists() or log.read_text().count("replay service listening") < times:
                assert role.poll() is None, f"the role exited ({role.returncode}) before it listened"
                assert time.monotonic() < deadline, (tmp_path / "replay.log").read_text()[-2000:]
                time.sleep(0.05)

        first = forks.start(["replay", "--config", str(config)], str(tmp_path / "replay.log"), dict(os.environ))
        wait_listening(1, first)  # up and serving (a fixed 1 s sleep guessed it)
        first.kill()
        assert first.wait(timeout=30) == -signal.SIGKILL
        second = forks.start(["replay", "--config", str(config)], str(tmp_path / "replay.log"), dict(os.environ))
        wait_listening(2, second)
    finally:
        forks.process.kill()
        forks.process.wait()
    deadline = time.monotonic() + 30
    while running(second.pid):
        assert time.monotonic() < deadline, "the role outlived its fork server"
        time.sleep(0.2)
    assert "replay service stopped" in (tmp_path / "replay.log").read_text()  # SIGTERM: it stopped cleanly


@pytest.mark.slow
def test_a_runs_roles_are_forked_and_start_for_less_cpu(tmp_path):
    """Slow: two short real runs. With the fork server its pid is in processes.json, the learner and worker are its
    children, and the run's processes spend less CPU than when every role imports torch itself."""
    def run(name: str, extra_env: dict[str, str]) -> tuple[dict, float]:
        args = [sys.executable, "-m", "launch.cli", "train", f"run.dir={tmp_path}", f"run.name={name}",
                "run.max_versions=3", "run.target_success=null"]
        before = os.times()
        done = subprocess.run(args, capture_output=True, text=True, timeout=300, env={**os.environ, **extra_env})
        after = os.times()
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout.strip().splitlines()[-1])["eval_version"] == 3  # evaluated (forked)
        cpu = (after.children_user + after.children_system) - (before.children_user + before.children_system)
        return json.loads((tmp_path / name / "processes.json").read_text()), cpu

    forked, forked_cpu = run("forked", {})
    assert "forkserver" in forked
    for role in ("learner", "rollout-0"):
        assert f"forked by the fork server (pid {forked['forkserver']})" in _log_lines(tmp_path / "forked", role)
    fresh, fresh_cpu = run("fresh", {"ASYNC_RL_FORK_SERVER": "0"})
    assert "forkserver" not in fresh
    assert forked_cpu < 0.8 * fresh_cpu, (forked_cpu, fresh_cpu)


def _log_lines(run_dir, role: str) -> str:
    return (run_dir / "logs" / f"{role}.log").read_text()


def test_a_request_given_up_on_does_not_answer_the_next(tmp_path):
    """A start that timed out (the server still importing) gets its answer late; the next start skips it and gets
    its own."""
    forks = ForkServer(dict(os.environ), tmp_path / "forkserver.log")
    try:
        with pytest.raises(OSError, match="did not start config"):
            forks.start(["config"], str(tmp_path / "a.log"), dict(os.environ), str(tmp_path / "a.out"), timeout_s=0.01)
        second = forks.start(["config", "run.seed=2"], str(tmp_path / "b.log"), dict(os.environ),
                             str(tmp_path / "b.out"))
        assert second.wait(timeout=120) == 0
        assert yaml.safe_load((tmp_path / "b.out").read_text())["run"]["seed"] == 2
        assert forks._started.empty()  # both answers were read: the late one skipped, this one taken
    finally:
        forks.close()
