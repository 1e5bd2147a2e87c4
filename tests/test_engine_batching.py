"""How the episode runner batches engine calls (`rollout.engine_batch_wait_s`): a call waits for 3/4 of the
trajectories in flight, but never longer than the wait for the first one; a real torch engine on the tiny model."""

from __future__ import annotations

import threading
import time

import pytest

from async_rl import Judgement, StepResult, Task
from async_rl.config_load import load_config
from async_rl.model import ensure_model_dir, load_tokenizer
from rollout.engines import SamplingParams
from rollout.engines.torch_engine import TorchEngine
from rollout.runner import EpisodeRunner


class TurnsEnv:
    """Three turns; the env made first in a group answers at once, the others after `slow_s` (a slow tool)."""

    made = 0
    lock = threading.Lock()

    def __init__(self, slow_s: float) -> None:
        with TurnsEnv.lock:
            self.fast = TurnsEnv.made % 16 == 0
            TurnsEnv.made += 1
        self.slow_s, self.turns = slow_s, 0

    def reset(self, task):
        return "go"

    def step(self, action):
        if not self.fast:
            time.sleep(self.slow_s)
        self.turns += 1
        return StepResult("go", 0.0, self.turns == 3)

    def judge(self):
        return Judgement(1.0, True)


class Factory:
    def __init__(self, slow_s: float) -> None:
        self.slow_s = slow_s

    def make(self):
        return TurnsEnv(self.slow_s)

    def tasks(self, split):
        return [Task("t", {})]


class Sink:
    def __init__(self) -> None:
        self.stages: list[tuple[float, int, int]] = []  # (time, member, stage)
        self.outcomes = 0

    def stage(self, episode, generation, reward, terminal):
        self.stages.append((time.monotonic(), episode.member, episode.stages))

    def outcome(self, episode, judgement, reason):
        assert reason == "", reason
        self.outcomes += 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    config = load_config(None, [f"run.dir={tmp_path_factory.mktemp('runs')}", "run.seed=3"])
    return ensure_model_dir(config.model, config.run_dir, config.run.seed, words=["go", "a", "b"])


def run_group(model_dir, slow_s: float, batch_wait_s: float, calls: list[tuple[int, int]]) -> Sink:
    """One group of 16 to the end; `calls` gets (rows, trajectories in flight) of every engine call."""
    tokenizer = load_tokenizer(model_dir)
    sink = Sink()
    params = SamplingParams(max_new_tokens=1, stop_token_ids=[tokenizer.eos_token_id])
    runner = EpisodeRunner("turns", Factory(slow_s), TorchEngine(model_dir, seed=0), tokenizer, params, 256, sink,
                           16, batch_wait_s=batch_wait_s)
    generate = runner._generate

    def recorded(ready):
        calls.append((len(ready), runner.acting()))
        generate(ready)

    runner._generate = recorded
    runner.start_group("g", Task("t", {}), 16)
    deadline = time.monotonic() + 60
    try:
        while not runner.idle():
            assert time.monotonic() < deadline, "the group did not finish"
            runner.pump(0.05)
    finally:
        runner.close()
    return sink


def test_a_call_waits_for_three_quarters_of_the_trajectories_in_flight(model_dir):
    """A wait longer than any step: each call starts only once 3/4 of those in flight wait for it, so the 15 slow
    trajectories go in big calls, and every trajectory still finishes (the 3/4 is of those still in flight)."""
    calls: list[tuple[int, int]] = []
    sink = run_group(model_dir, slow_s=0.05, batch_wait_s=30.0, calls=calls)
    assert sink.outcomes == 16 and len(sink.stages) == 48
    assert all(4 * rows >= 3 * acting for rows, acting in calls), calls
    assert sum(rows for rows, _ in calls) == 48 and len(calls) <= 6  # 3 turns of 16 in few calls, not 48


def test_the_first_waiting_trajectory_goes_after_the_wait_even_when_the_rest_are_busy(model_dir):
    """The fast trajectory's turns go alone in a call (1 row of 16 in flight) after at most ~the wait, while the 15
    slow tools are still running: gathering never holds a trajectory for others' tools."""
    calls: list[tuple[int, int]] = []
    sink = run_group(model_dir, slow_s=1.5, batch_wait_s=0.05, calls=calls)
    assert sink.outcomes == 16
    fast = [t for t, member, _ in sink.stages if member == 0]
    slow_first = min(t for t, member, _ in sink.stages if member != 0)
    assert len(fast) == 3 and fast[-1] < slow_first  # all three fast turns before the first slow step returned
    assert (1, 16) in calls
