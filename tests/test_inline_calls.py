"""Env calls inline on the owner's loop thread (rollout/inline_calls.py, rollout/env_calls.py), with a real runner,
engine and tiny model: instant calls never leave the loop's thread; a call past the budget moves the loop to a new
thread while it runs, finishes as a pool call (or is abandoned at its time limit), and sends its kind to the pools."""

from __future__ import annotations

import threading
import time

import pytest

from async_rl import Judgement, StepResult, Task
from async_rl.config_load import load_config
from async_rl.model import ensure_model_dir, load_tokenizer
from rollout.engines import SamplingParams
from rollout.engines.torch_engine import TorchEngine
from rollout.inline_calls import InlineCalls, LoopMoved
from rollout.runner import EpisodeRunner

WORDS = ["a", "b"]


class RecordingEnv:
    """Two steps; records the thread of each call; the step of a trajectory in `block` waits for `release`."""

    def __init__(self, owner: Factory):
        self.owner, self.steps = owner, 0

    def reset(self, task):
        self.owner.threads.append(("reset", threading.current_thread().name))
        return "go"

    def step(self, action):
        self.owner.threads.append(("step", threading.current_thread().name))
        self.steps += 1
        time.sleep(self.owner.step_wait_s)  # a tool that waits (a request, a sandbox): no CPU, but no return either
        if self.steps == 1 and self.owner.block_next.is_set():
            self.owner.block_next.clear()
            self.owner.blocked.set()
            self.owner.release.wait(60)  # in C (a lock): nothing can interrupt it
        return StepResult("again", 0.5, self.steps >= 2)

    def judge(self):
        self.owner.threads.append(("judge", threading.current_thread().name))
        return Judgement(1.0, True)


class Factory:
    def __init__(self):
        self.threads: list[tuple[str, str]] = []
        self.step_wait_s = 0.0
        self.block_next, self.blocked, self.release = threading.Event(), threading.Event(), threading.Event()

    def tasks(self, split):
        return [Task("t", {})]

    def make(self):
        return RecordingEnv(self)


class Sink:
    def __init__(self):
        self.outcomes: list[tuple[str, str]] = []
        self.stages = 0

    def stage(self, episode, generation, reward, terminal):
        self.stages += 1

    def outcome(self, episode, judgement, reason):
        self.outcomes.append((episode.trajectory_id, reason))


class Owner:
    """A worker's loop in miniature: pump until told to stop, restarted on a new thread when a call is moved."""

    def __init__(self, runner_args, budget_s=0.05, step_timeout_s=30.0):
        self.threads_started, self.moved_threads_ended = 0, 0
        self.stop = threading.Event()
        self.inline = InlineCalls(budget_s, self.start)
        self.runner = EpisodeRunner(*runner_args, step_timeout_s=step_timeout_s, inline=self.inline)

    def start(self):
        self.threads_started += 1
        threading.Thread(target=self.loop, name=f"loop-{self.threads_started}", daemon=True).start()

    def loop(self):
        try:
            while not self.stop.is_set():
                self.runner.pump(0.01)
        except LoopMoved:
            self.moved_threads_ended += 1

    def close(self):
        self.stop.set()
        self.inline.close()
        self.runner.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    config = load_config(None, [f"run.dir={tmp_path_factory.mktemp('runs')}", "run.seed=3"])
    return ensure_model_dir(config.model, config.run_dir, config.run.seed, WORDS)


def runner_args(factory, sink, model_dir):
    tokenizer = load_tokenizer(model_dir)
    params = SamplingParams(max_new_tokens=1, stop_token_ids=[tokenizer.eos_token_id])
    return ("inline-test", factory, TorchEngine(model_dir, seed=0), tokenizer, params, 256, sink, 8)


def wait_for(condition, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_instant_calls_run_on_the_loops_own_thread(model_dir):
    factory, sink = Factory(), Sink()
    owner = Owner(runner_args(factory, sink, model_dir), budget_s=1.0)  # no move however busy the machine
    try:
        owner.runner.start_group("g", Task("t", {}), 4)
        owner.start()
        wait_for(lambda: len(sink.outcomes) == 4)
    finally:
        owner.close()
    assert sorted(sink.outcomes) == [(f"g/{i}", "") for i in range(4)] and sink.stages == 8
    assert {name for _, name in factory.threads} == {"loop-1"}  # reset, both steps and the judge: no hand-off
    assert [kind for kind, _ in factory.threads].count("judge") == 4
    assert owner.inline.moved == 0 and owner.threads_started == 1 and owner.runner.calls.pooled_kinds == set()


def test_steps_that_wait_go_to_the_pool_where_they_overlap_without_moving_the_loop(model_dir):
    """Steps that each wait 20 ms, within a 100 ms budget: inline they would run one after another (16 trajectories
    x 2 steps = 0.64 s of waiting); their mean passes a twentieth of the budget (5 ms) by the 5th call, steps go to
    the pool, and the trajectories' waits overlap there. No loop move: nothing overran the budget."""
    factory, sink = Factory(), Sink()
    factory.step_wait_s = 0.02
    owner = Owner(runner_args(factory, sink, model_dir), budget_s=0.1)
    try:
        owner.runner.start_group("g", Task("t", {}), 16)
        owner.start()
        wait_for(lambda: len(sink.outcomes) == 16)
    finally:
        owner.close()
    steps = [name for kind, name in factory.threads if kind == "step"]
    inline = [name for name in steps if name.startswith("loop-")]
    assert len(steps) == 32 and 1 <= len(inline) <= 5
    # (a loaded machine may hold a call past the budget: a move sends steps to the pool all the same)
    assert owner.runner.calls.pooled_kinds == {"step"} and owner.inline.moved <= 1
    assert all(reason == "" for _, reason in sink.outcomes)


def test_a_call_past_the_budget_moves_the_loop_and_finishes_as_a_pool_call(model_dir):
    """One step blocks in a lock: within the budget the loop goes on on a new thread, the other trajectories finish
    while it is still blocked, and when it returns its trajectory finishes too; steps then run on the pool, until
    64 of them in a row were quick: then inline again."""
    factory, sink = Factory(), Sink()
    owner = Owner(runner_args(factory, sink, model_dir), budget_s=0.3)
    factory.block_next.set()
    try:
        owner.runner.start_group("g", Task("t", {}), 4)
        owner.start()
        assert factory.blocked.wait(60)
        wait_for(lambda: len(sink.outcomes) == 3)  # the others, while the blocked step still holds loop-1
        # (a loaded machine may hold an instant call past the budget too: each move starts one more loop thread)
        assert owner.inline.moved >= 1 and owner.threads_started == owner.inline.moved + 1
        assert owner.moved_threads_ended <= owner.inline.moved - 1 and "step" in owner.runner.calls.pooled_kinds
        owner.runner.start_group("h", Task("t", {}), 2)  # a later group: its steps on the pool
        wait_for(lambda: len(sink.outcomes) == 5)
        factory.release.set()
        wait_for(lambda: len(sink.outcomes) == 6)
        wait_for(lambda: owner.moved_threads_ended == owner.inline.moved)  # each written-off thread left (LoopMoved)
        steps_of_h = [name for kind, name in factory.threads[-10:] if kind == "step"]
        assert steps_of_h and all(name.startswith("env-step-") for name in steps_of_h)
        for n in range(20):  # 4 quick pool steps a group: inline again after 64
            if "step" not in owner.runner.calls.pooled_kinds:
                break
            owner.runner.start_group(f"q{n}", Task("t", {}), 2)
            wait_for(lambda n=n: len(sink.outcomes) == 6 + 2 * (n + 1))
        assert "step" not in owner.runner.calls.pooled_kinds
        mark = len(factory.threads)
        owner.runner.start_group("back", Task("t", {}), 2)
        wait_for(lambda: sum(t.startswith("back/") for t, _ in sink.outcomes) == 2)
    finally:
        owner.close()
    assert all(reason == "" for _, reason in sink.outcomes)  # within step_timeout_s: nothing abandoned
    latest = f"loop-{owner.threads_started}"
    assert [name for kind, name in factory.threads[mark:] if kind == "step"] == [latest] * 4
    assert owner.runner.plugin_timeouts == 0


def test_a_moved_call_that_never_returns_is_abandoned_at_its_limit(model_dir):
    factory, sink = Factory(), Sink()
    owner = Owner(runner_args(factory, sink, model_dir), budget_s=0.3, step_timeout_s=3.0)
    factory.block_next.set()
    try:
        owner.runner.start_group("g", Task("t", {}), 2)
        owner.start()
        wait_for(lambda: len(sink.outcomes) == 2)
        abandoned = [reason for _, reason in sink.outcomes if reason]
        assert abandoned == ["timeout: env 'inline-test' step did not return within 3 s"]
        assert owner.runner.plugin_timeouts == 1 and owner.runner.hung_calls() == 1
    finally:
        factory.release.set()
        owner.close()


def test_a_call_that_finishes_after_the_runner_closed_writes_nothing_to_a_reused_descriptor(tmp_path):
    """The Waker's byte of a late call (a pool step that returned after close) must not land in whatever file the
    process opened next under the closed pipe's number."""
    import os

    from rollout.plugin_calls import Waker

    waker = Waker()
    number = waker._write_fd
    waker.wake()
    waker.close()
    other = os.open(tmp_path / "other", os.O_WRONLY | os.O_CREAT)
    os.dup2(other, number)  # the number reused, as the next open may
    try:
        waker.wake()
    finally:
        os.close(number)
        os.close(other)
    assert (tmp_path / "other").read_bytes() == b""


class RaceEnv:
    """One step. The first env made blocks its step on `release_step`; the second blocks its judge on
    `release_judge`; the others are instant."""

    def __init__(self, owner: RaceFactory, index: int):
        self.owner, self.index = owner, index

    def reset(self, task):
        return "go"

    def step(self, action):
        if self.index == 0:
            self.owner.release_step.wait(60)
        return StepResult(None, 0.0, True)

    def judge(self):
        if self.index == 1:
            self.owner.judge_blocked.set()
            self.owner.release_judge.wait(60)
        return Judgement(1.0, True)


class RaceFactory(Factory):
    def __init__(self):
        super().__init__()
        self.made = 0
        self.release_step, self.release_judge, self.judge_blocked = (threading.Event(), threading.Event(),
                                                                    threading.Event())

    def make(self):
        self.made += 1
        return RaceEnv(self, self.made - 1)


def test_a_moved_call_that_returns_leaves_the_next_threads_hung_call_watched(model_dir):
    """A's step is moved; the loop's new thread runs B's judge inline, which hangs; A's step then returns. The
    watchdog must still see B's judge (the old thread must not clear the new thread's call) and move it too, so
    that a later group runs while B's judge still hangs."""
    factory, sink = RaceFactory(), Sink()
    owner = Owner(runner_args(factory, sink, model_dir), budget_s=0.3)
    try:
        owner.runner.start_group("g", Task("t", {}), 2)
        owner.start()
        assert factory.judge_blocked.wait(60)  # B's judge, inline on the loop's second thread
        factory.release_step.set()  # A's step returns on the written-off first thread
        wait_for(lambda: owner.inline.moved >= 2)
        owner.runner.start_group("later", Task("t", {}), 2)
        wait_for(lambda: sum(t.startswith("later/") for t, _ in sink.outcomes) == 2)
    finally:
        factory.release_judge.set()
        owner.close()
