"""The trap environment (docs/algorithm.md): deterministic tasks, traps that pay now and fail later, retries."""

import math
import random
import time

import pytest

from rollout.envs.base import Judgement, Task
from rollout.envs.trap import TrapEnv, TrapSettings, make_task, symbol
from rollout.envs.trap import factory as trap_factory


def as_task(task_id: int) -> Task:
    return Task(id=str(task_id), data={"task": task_id})


def step(env: TrapEnv, action: str) -> tuple[str, float, bool]:
    result = env.step(action)
    return result.observation or "", result.reward, result.done


def play(env: TrapEnv, task_id: int, actions: list[str]) -> list[tuple[str, float, bool]]:
    env.reset(as_task(task_id))
    return [step(env, a) for a in actions]


def wrong_choice(task, stage: int, choices: int) -> int:
    """A choice that is neither the code nor the trap at `stage`."""
    return next(c for c in range(choices) if c != task.code[stage] and task.traps.get(stage) != c)


def test_tasks_are_deterministic_per_seed_and_differ_across_seeds():
    env = TrapSettings(seed=3)
    assert [make_task(env, t) for t in range(env.num_tasks)] == [make_task(env, t) for t in range(env.num_tasks)]
    other = TrapSettings(seed=4)
    assert [make_task(env, t) for t in range(16)] != [make_task(other, t) for t in range(16)]


def test_task_has_distinct_trap_stages_whose_trap_symbol_is_not_the_code():
    env = TrapSettings(seed=1, stages=5, choices=4, traps=3)
    for t in range(env.num_tasks):
        task = make_task(env, t)
        assert len(task.code) == 5 and all(0 <= c < 4 for c in task.code)
        assert len(task.traps) == 3
        assert all(task.traps[s] != task.code[s] for s in task.traps)


def test_reset_returns_the_task_and_first_stage():
    assert TrapEnv(TrapSettings()).reset(as_task(7)) == "task7 stage1"


def test_the_exact_code_earns_every_stage_reward_and_outcome_one():
    config = TrapSettings(seed=2)
    task = make_task(config, 5)
    env = TrapEnv(config)
    steps = play(env, 5, [symbol(c) for c in task.code])
    assert [r for _, r, _ in steps] == [1.0] * config.stages
    assert [o for o, _, _ in steps] == ["ok stage2", "ok stage3", "ok stage4", ""]
    assert [d for _, _, d in steps] == [False, False, False, True]
    assert env.judge().score == 1.0


def test_a_trap_pays_the_stage_reward_but_the_outcome_is_zero():
    config = TrapSettings(seed=2)
    task = make_task(config, 0)
    trap_stage, trap_choice = next(iter(task.traps.items()))
    actions = [symbol(trap_choice if s == trap_stage else c) for s, c in enumerate(task.code)]
    env = TrapEnv(config)
    steps = play(env, 0, actions)
    assert [r for _, r, _ in steps] == [1.0] * config.stages
    assert steps[-1][2] is True
    assert env.judge().score == 0.0


def test_a_miss_retries_the_stage_then_ends_the_episode():
    config = TrapSettings(seed=0, retries=1)
    task = make_task(config, 1)
    wrong = symbol(wrong_choice(task, 0, config.choices))
    env = TrapEnv(config)
    assert play(env, 1, [wrong, wrong]) == [("miss stage1", 0.0, False), ("", 0.0, True)]
    assert env.judge().score == 0.0


def test_a_retry_that_finds_the_code_still_succeeds():
    config = TrapSettings(seed=0, retries=1)
    task = make_task(config, 1)
    actions = [symbol(wrong_choice(task, 0, config.choices))] + [symbol(c) for c in task.code]
    env = TrapEnv(config)
    steps = play(env, 1, actions)
    assert len(steps) == config.stages + 1 and steps[-1][2]
    assert env.judge().score == 1.0


@pytest.mark.parametrize("action", ["", "  ", "AB", "A B", "z", "<eos>", symbol(25)])
def test_anything_but_one_known_symbol_is_a_miss(action):
    config = TrapSettings(choices=6, retries=0)
    env = TrapEnv(config)
    env.reset(as_task(0))
    assert step(env, action) == ("", 0.0, True)


def test_the_action_is_stripped_before_parsing():
    config = TrapSettings(seed=0)
    task = make_task(config, 0)
    env = TrapEnv(config)
    env.reset(as_task(0))
    assert step(env, f"  {symbol(task.code[0])}\n") == ("ok stage2", 1.0, False)


def test_retries_make_trajectory_lengths_vary():
    config = TrapSettings(seed=0, retries=2)
    rng = random.Random(0)
    env = TrapEnv(config)
    lengths = set()
    for episode in range(200):
        env.reset(as_task(episode % config.num_tasks))
        done, n = False, 0
        while not done:
            _, _, done = step(env, symbol(rng.randrange(config.choices)))
            n += 1
        lengths.add(n)
    assert len(lengths) >= 4


def expected_random_success(config: TrapSettings, code) -> float:
    """P(outcome = 1) of a uniform random policy: per stage, the code before a trap or the last retry."""
    c, attempts = config.choices, config.retries + 1
    p = 1.0
    for s in range(config.stages):
        if s in code.traps:  # each attempt: code 1/c, trap 1/c (ends hope), miss (c-2)/c
            p *= sum(((c - 2) / c) ** a / c for a in range(attempts))
        else:
            p *= 1 - ((c - 1) / c) ** attempts
    return p


@pytest.mark.parametrize("retries", [0, 1])
def test_a_random_policy_succeeds_at_the_rate_of_chance(retries):
    config = TrapSettings(seed=5, num_tasks=4, stages=3, choices=3, traps=1, retries=retries)
    rng = random.Random(11)
    env = TrapEnv(config)
    episodes = 4000
    successes = 0
    for episode in range(episodes):
        env.reset(as_task(episode % config.num_tasks))
        done = False
        while not done:
            _, _, done = step(env, symbol(rng.randrange(config.choices)))
        successes += env.judge().score
    expected = sum(expected_random_success(config, make_task(config, t)) for t in range(config.num_tasks)) / 4
    if retries == 0:
        assert math.isclose(expected, (1 / 3) ** 3)  # without retries, chance is (1/choices)^stages
    sigma = math.sqrt(expected * (1 - expected) / episodes)
    assert abs(successes / episodes - expected) < 4 * sigma


def test_step_and_outcome_simulate_latency():
    env = TrapEnv(TrapSettings(step_latency_s=0.05, outcome_delay_s=0.1, retries=0))
    env.reset(as_task(0))
    start = time.monotonic()
    env.step("not a symbol")
    assert time.monotonic() - start >= 0.05
    start = time.monotonic()
    env.judge()
    assert time.monotonic() - start >= 0.1


def test_step_latency_sigma_draws_a_long_tailed_factor_per_trajectory_with_mean_one():
    env = TrapEnv(TrapSettings(step_latency_s=0.0, step_latency_sigma=1.0))
    random.seed(0)  # the latency factor is drawn from the process's generator
    factors = []
    for _ in range(4000):
        env.reset(as_task(0))
        factors.append(env.latency_factor)
    factors.sort()
    assert abs(sum(factors) / len(factors) - 1.0) < 0.1  # the mean step latency is step_latency_s
    assert factors[len(factors) // 2] < 0.7 and factors[int(0.99 * len(factors))] > 5.0  # a long right tail
    assert TrapEnv(TrapSettings()).latency_factor == 1.0


def test_bad_usage_raises_a_clear_error():
    env = TrapEnv(TrapSettings(num_tasks=4, retries=0))
    with pytest.raises(ValueError, match="task_id"):
        env.reset(as_task(4))
    with pytest.raises(RuntimeError, match="before reset"):
        TrapEnv(TrapSettings()).step("A")
    env.reset(as_task(0))
    assert env.judge().success is False  # cut short (the context limit): judged as it stands, not solved
    env.step("not a symbol")
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("A")


def test_the_judgement_reports_success_and_the_trap():
    config = TrapSettings(seed=2)
    code = make_task(config, 0)
    trap_stage, trap_choice = next(iter(code.traps.items()))
    env = TrapEnv(config)
    play(env, 0, [symbol(c) for c in code.code])
    assert env.judge() == Judgement(score=1.0, success=True, info={"trap_rate": 0.0})
    play(env, 0, [symbol(trap_choice if s == trap_stage else c) for s, c in enumerate(code.code)])
    assert env.judge() == Judgement(score=0.0, success=False, info={"trap_rate": 1.0})


def test_the_factory_declares_its_tasks_and_vocabulary():
    factory = trap_factory(num_tasks=3, stages=2, choices=3)
    assert [t.id for t in factory.tasks("train")] == ["0", "1", "2"] == [t.id for t in factory.tasks("eval")]
    assert factory.vocabulary() == ["ok", "miss", "task0", "task1", "task2", "stage1", "stage2", "A", "B", "C"]
    assert factory.max_action_tokens == 1
