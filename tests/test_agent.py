"""Pieces of the episode runner: task draws, chat-template observations, the action budget near the limit."""

from __future__ import annotations

from collections import Counter

from rollout_helpers import settings_of

from async_rl.config_load import load_config
from async_rl.model import byte_tokenizer
from rollout.envs.base import Task
from rollout.envs.hunt import factory as hunt_factory
from rollout.envs.trap import factory as trap_factory
from rollout.runner import Prompter, sampling_params
from rollout.worker import TaskSampler

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_tasks_are_drawn_evenly_in_a_seeded_order():
    tasks = [Task(str(i), {}) for i in range(5)]
    sampler = TaskSampler(tasks, seed=1)
    draws = [sampler.next().id for _ in range(20)]
    assert Counter(draws) == {str(i): 4 for i in range(5)}  # each task once per pass of 5
    assert all(sorted(draws[p * 5 : p * 5 + 5]) == [str(i) for i in range(5)] for p in range(4))
    again = TaskSampler(tasks, seed=1)
    assert [again.next().id for _ in range(20)] == draws
    other = TaskSampler(tasks, seed=2)
    assert [other.next().id for _ in range(20)] != draws


def test_a_plain_tokenizer_appends_observations_as_they_are():
    tokenizer = byte_tokenizer()
    prompter = Prompter(tokenizer)
    assert not prompter.chat
    assert tokenizer.decode(prompter.first("Task: x\n")) == "Task: x\n"
    assert tokenizer.decode(prompter.next("Tool: ok\n")) == "Tool: ok\n"
    assert prompter.next("") == []


def test_a_chat_template_wraps_observations_as_user_turns():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = TEMPLATE
    prompter = Prompter(tokenizer)
    assert prompter.chat
    assert tokenizer.decode(prompter.first("solve it")) == "<|user|>solve it<|end|><|assistant|>"
    # After the assistant's action, the next observation is the template's text for one more user turn.
    assert tokenizer.decode(prompter.next("3 tests failed")) == "<|user|>3 tests failed<|end|><|assistant|>"


def test_the_action_budget_comes_from_the_config_or_the_env():
    runner = settings_of(load_config(None, [])).runner
    tokenizer = byte_tokenizer()
    assert sampling_params(runner, trap_factory(), tokenizer).max_new_tokens == 1
    assert sampling_params(runner, hunt_factory(), tokenizer).max_new_tokens == 2
    assert sampling_params(runner, object(), tokenizer).max_new_tokens == 256  # type: ignore[arg-type]
    runner = settings_of(load_config(None, ["rollout.max_new_tokens=7", "rollout.stop=['</tool>']"])).runner
    params = sampling_params(runner, hunt_factory(), tokenizer)
    assert params.max_new_tokens == 7 and params.stop == ["</tool>"] and params.stop_token_ids == [1]


def test_the_kernel_imports_no_environment():
    """async_rl/ knows no environment: no module of the kernel names a built-in env or its words."""
    from pathlib import Path

    kernel = Path(__file__).resolve().parent.parent / "async_rl"
    for path in kernel.glob("*.py"):
        text = path.read_text()
        for needle in ("rollout.envs.trap", "rollout.envs.hunt", "TrapEnv", "async_rl.vocab", "stage_word"):
            assert needle not in text, f"{path.name} mentions {needle}"


def test_the_judge_pool_reuses_idle_threads_and_runs_slow_calls_side_by_side():
    import threading
    import time

    from rollout.plugin_calls import ElasticPool

    pool = ElasticPool(name="test-judge-reuse", idle_s=0.5)
    for n in range(50):  # one after the other: one thread does them all
        assert pool.submit(lambda x: x * 2, n).result(timeout=5) == n * 2
    assert pool.threads() == 1
    gate, started = threading.Event(), threading.Semaphore(0)

    def blocked() -> bool:
        started.release()
        return gate.wait(5)

    slow = [pool.submit(blocked) for _ in range(8)]  # eight at once: eight threads, none waits for another
    assert all(started.acquire(timeout=5) for _ in slow), "not all eight calls started: one waited for another"
    all_started = time.monotonic()
    assert pool.threads() == 8 and not any(f.done() for f in slow)
    hung = pool.submit(time.sleep, 3)  # a call that does not return soon holds its thread, not the next call
    assert pool.submit(lambda: "next").result(timeout=2) == "next"
    opened = time.monotonic()
    gate.set()
    assert all(f.result(timeout=5) for f in slow)
    assert all(f.elapsed_s >= opened - all_started for f in slow), "each call's time covers its wait"
    deadline = time.monotonic() + 5
    while pool.threads() > 1 and time.monotonic() < deadline:  # idle threads end after idle_s; the hung one stays
        time.sleep(0.05)
    assert pool.threads() == 1 and not hung.done()


def test_the_prompters_token_cache_returns_what_the_tokenizer_does_and_stays_bounded(monkeypatch):
    from rollout import prompting

    monkeypatch.setattr(prompting, "CACHED_TEXTS", 4)
    tokenizer = byte_tokenizer()
    prompter = Prompter(tokenizer)
    texts = [f"Tool: {n}\n" for n in range(10)] * 2
    for text in texts:
        ids = prompter.next(text)
        assert ids == list(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(0)  # a caller's list is its own: the cache is not changed through it
    assert prompter.next("Tool: 9\n") == list(tokenizer("Tool: 9\n", add_special_tokens=False)["input_ids"])
    assert len(prompter._encoded) == 4
    first = prompter.first("Task: x\n")  # the first observation keeps its special tokens, cached apart
    assert first == list(tokenizer("Task: x\n")["input_ids"])
    assert prompter.next("Task: x\n") == list(tokenizer("Task: x\n", add_special_tokens=False)["input_ids"])
