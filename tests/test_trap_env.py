"""The trap environment (ALGORITHM.md §5): deterministic tasks, traps that pay now and fail later, retries."""

import math
import random
import time

import pytest

from async_rl.config import EnvConfig
from async_rl.vocab import symbol
from rollout.envs.trap import TrapEnv, make_task


def play(env: TrapEnv, task_id: int, actions: list[str]) -> list[tuple[str, float, bool]]:
    env.reset(task_id)
    return [env.step(a) for a in actions]


def wrong_choice(task, stage: int, choices: int) -> int:
    """A choice that is neither the code nor the trap at `stage`."""
    return next(c for c in range(choices) if c != task.code[stage] and task.traps.get(stage) != c)


def test_tasks_are_deterministic_per_seed_and_differ_across_seeds():
    env = EnvConfig(seed=3)
    assert [make_task(env, t) for t in range(env.num_tasks)] == [make_task(env, t) for t in range(env.num_tasks)]
    other = EnvConfig(seed=4)
    assert [make_task(env, t) for t in range(16)] != [make_task(other, t) for t in range(16)]


def test_task_has_distinct_trap_stages_whose_trap_symbol_is_not_the_code():
    env = EnvConfig(seed=1, stages=5, choices=4, traps=3)
    for t in range(env.num_tasks):
        task = make_task(env, t)
        assert len(task.code) == 5 and all(0 <= c < 4 for c in task.code)
        assert len(task.traps) == 3
        assert all(task.traps[s] != task.code[s] for s in task.traps)


def test_reset_returns_the_task_and_first_stage():
    assert TrapEnv(EnvConfig()).reset(7) == "task7 stage1"


def test_the_exact_code_earns_every_stage_reward_and_outcome_one():
    config = EnvConfig(seed=2)
    task = make_task(config, 5)
    env = TrapEnv(config)
    steps = play(env, 5, [symbol(c) for c in task.code])
    assert [r for _, r, _ in steps] == [1.0] * config.stages
    assert [o for o, _, _ in steps] == ["ok stage2", "ok stage3", "ok stage4", ""]
    assert [d for _, _, d in steps] == [False, False, False, True]
    assert env.outcome() == 1.0


def test_a_trap_pays_the_stage_reward_but_the_outcome_is_zero():
    config = EnvConfig(seed=2)
    task = make_task(config, 0)
    trap_stage, trap_choice = next(iter(task.traps.items()))
    actions = [symbol(trap_choice if s == trap_stage else c) for s, c in enumerate(task.code)]
    env = TrapEnv(config)
    steps = play(env, 0, actions)
    assert [r for _, r, _ in steps] == [1.0] * config.stages
    assert steps[-1][2] is True
    assert env.outcome() == 0.0


def test_a_miss_retries_the_stage_then_ends_the_episode():
    config = EnvConfig(seed=0, retries=1)
    task = make_task(config, 1)
    wrong = symbol(wrong_choice(task, 0, config.choices))
    env = TrapEnv(config)
    assert play(env, 1, [wrong, wrong]) == [("miss stage1", 0.0, False), ("", 0.0, True)]
    assert env.outcome() == 0.0


def test_a_retry_that_finds_the_code_still_succeeds():
    config = EnvConfig(seed=0, retries=1)
    task = make_task(config, 1)
    actions = [symbol(wrong_choice(task, 0, config.choices))] + [symbol(c) for c in task.code]
    env = TrapEnv(config)
    steps = play(env, 1, actions)
    assert len(steps) == config.stages + 1 and steps[-1][2]
    assert env.outcome() == 1.0


@pytest.mark.parametrize("action", ["", "  ", "AB", "A B", "z", "<eos>", symbol(25)])
def test_anything_but_one_known_symbol_is_a_miss(action):
    config = EnvConfig(choices=6, retries=0)
    env = TrapEnv(config)
    env.reset(0)
    assert env.step(action) == ("", 0.0, True)


def test_the_action_is_stripped_before_parsing():
    config = EnvConfig(seed=0)
    task = make_task(config, 0)
    env = TrapEnv(config)
    env.reset(0)
    assert env.step(f"  {symbol(task.code[0])}\n") == ("ok stage2", 1.0, False)


def test_retries_make_trajectory_lengths_vary():
    config = EnvConfig(seed=0, retries=2)
    rng = random.Random(0)
    env = TrapEnv(config)
    lengths = set()
    for episode in range(200):
        env.reset(episode % config.num_tasks)
        done, n = False, 0
        while not done:
            _, _, done = env.step(symbol(rng.randrange(config.choices)))
            n += 1
        lengths.add(n)
    assert len(lengths) >= 4


def expected_random_success(config: EnvConfig, task) -> float:
    """P(outcome = 1) of a uniform random policy: per stage, the code before a trap or the last retry."""
    c, attempts = config.choices, config.retries + 1
    p = 1.0
    for s in range(config.stages):
        if s in task.traps:  # each attempt: code 1/c, trap 1/c (ends hope), miss (c-2)/c
            p *= sum(((c - 2) / c) ** a / c for a in range(attempts))
        else:
            p *= 1 - ((c - 1) / c) ** attempts
    return p


@pytest.mark.parametrize("retries", [0, 1])
def test_a_random_policy_succeeds_at_the_rate_of_chance(retries):
    config = EnvConfig(seed=5, num_tasks=4, stages=3, choices=3, traps=1, retries=retries)
    rng = random.Random(11)
    env = TrapEnv(config)
    episodes = 4000
    successes = 0
    for episode in range(episodes):
        env.reset(episode % config.num_tasks)
        done = False
        while not done:
            _, _, done = env.step(symbol(rng.randrange(config.choices)))
        successes += env.outcome()
    expected = sum(expected_random_success(config, make_task(config, t)) for t in range(config.num_tasks)) / 4
    if retries == 0:
        assert math.isclose(expected, (1 / 3) ** 3)  # without retries, chance is (1/choices)^stages
    sigma = math.sqrt(expected * (1 - expected) / episodes)
    assert abs(successes / episodes - expected) < 4 * sigma


def test_step_and_outcome_simulate_latency():
    env = TrapEnv(EnvConfig(step_latency_s=0.05, outcome_delay_s=0.1, retries=0))
    env.reset(0)
    start = time.monotonic()
    env.step("not a symbol")
    assert time.monotonic() - start >= 0.05
    start = time.monotonic()
    env.outcome()
    assert time.monotonic() - start >= 0.1


def test_bad_usage_raises_a_clear_error():
    env = TrapEnv(EnvConfig(num_tasks=4, retries=0))
    with pytest.raises(ValueError, match="task_id"):
        env.reset(4)
    with pytest.raises(RuntimeError, match="before reset"):
        TrapEnv(EnvConfig()).step("A")
    env.reset(0)
    with pytest.raises(RuntimeError, match="before the episode ended"):
        env.outcome()
    env.step("not a symbol")
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("A")
