"""env.name=coding through the real env API: HumanEval and JSONL tasks, scripted policies, bad input, the judge.

All 164 HumanEval canonical solutions are judged by `python benchmarks/sandbox.py` (docs/environments.md has
the result); here a seeded sample of them plus the problems whose visible tests are derived differently.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rollout.envs.base import EnvError, Task, checked_judge, checked_reset, checked_step, checked_tasks, load_factory
from rollout.envs.coding import MAX_CODE_CHARS, factory, humaneval_visible_tests, parse_action

CLIP_TASK = {
    "id": "clip",
    "prompt": "def add_clip(a, b, hi):\n    '''Return a + b, but never more than hi (and never below 0).'''\n",
    "entry_point": "add_clip",
    "visible_tests": [
        "assert add_clip(1, 2, 10) == 3",
        "assert add_clip(5, 5, 10) == 10",
        "assert add_clip(9, 9, 10) == 10",
        "assert add_clip(-5, 1, 10) == 0",
    ],
    "hidden_tests": [
        "assert add_clip(2, 3, 10) == 5",
        "assert add_clip(7, 7, 9) == 9",
        "assert add_clip(-2, -3, 3) == 0",
    ],
}


def fence(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\n"


@pytest.fixture(scope="module")
def humaneval():
    f = factory(max_concurrent_executions=2, eval_fraction=0.2, split_seed=0)
    return f, {t.id: t for t in f.all_tasks()}


@pytest.fixture
def clip_factory(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(CLIP_TASK) + "\n")
    return factory(tasks_file=str(path), eval_fraction=0.0, max_turns=6)


def test_factory_loads_lazily_and_splits_are_seeded():
    f = factory()
    assert f._splits is None  # no task loads until tasks(); the sandbox was checked at once (require_namespaces)
    train, evaluation = f.tasks("train"), f.tasks("eval")
    assert len(train) + len(evaluation) == 164 and len(evaluation) == round(164 * 0.2)
    assert not {t.id for t in train} & {t.id for t in evaluation}
    assert [t.id for t in factory().tasks("eval")] == [t.id for t in evaluation]
    assert [t.id for t in factory(split_seed=1).tasks("eval")] != [t.id for t in evaluation]
    json.dumps([t.data for t in train])  # Task.data is JSON-serialisable


def test_reachable_by_name_and_import_path(tmp_path):
    for name in ("coding", "rollout.envs.coding:factory"):
        f = load_factory(name, {"max_turns": 2, "eval_fraction": 0.1})
        assert len(checked_tasks(name, f, "eval")) == 16
    with pytest.raises(EnvError, match="env.kwargs.nonsense"):
        load_factory("coding", {"nonsense": 1})
    with pytest.raises(EnvError, match="eval_fraction"):
        load_factory("coding", {"eval_fraction": 1.5})


def test_humaneval_visible_tests_are_derived():
    tasks = {t.id: t for t in factory().all_tasks()}
    assert tasks["HumanEval/0"].data["visible_tests"] == [
        "assert (has_close_elements([1.0, 2.0, 3.0], 0.5)) == (False)",
        "assert (has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)) == (True)",
    ]
    assert tasks["HumanEval/32"].data["visible_tests"] == [  # the example's comment is dropped
        "assert (round(find_zero([1, 2]), 2)) == (-0.5)",
        "assert (round(find_zero([-6, 11, -6, 1]), 2)) == (1.0)",
    ]
    assert tasks["HumanEval/47"].data["visible_tests"] == ["assert (median([3, 1, 2, 4, 5])) == (3)"]  # a wrong one out
    # no usable docstring example: the first third of check's asserts, `candidate` renamed
    visible = tasks["HumanEval/158"].data["visible_tests"]
    assert 1 <= len(visible) <= 3 and all(v.startswith("assert find_max([") for v in visible)
    assert "check(decode_cyclic)" in tasks["HumanEval/38"].data["visible_tests"][0]  # no assert usable: all of it
    assert all(t.data["hidden_tests"][0].rstrip().endswith(f"check({t.data['entry_point']})") for t in tasks.values())
    assert humaneval_visible_tests(">>> f(1)\n2\n", "def check(candidate):\n    pass\n", "f") == [
        "assert (f(1)) == (2)"
    ]


def test_canonical_solutions_pass_on_a_sample(humaneval):
    f, tasks = humaneval
    ids = sorted(random.Random(12).sample(sorted(tasks), 10)) + [
        "HumanEval/1",
        "HumanEval/32",
        "HumanEval/38",
        "HumanEval/47",
    ]

    def episode(task_id):
        env = f.make()
        checked_reset("coding", env, tasks[task_id])
        r1 = checked_step("coding", env, fence(tasks[task_id].data["canonical_solution"]))
        r2 = checked_step("coding", env, "submit")
        return task_id, r1, r2, checked_judge("coding", env)

    with ThreadPoolExecutor(2) as pool:  # the worker steps trajectories from a thread pool
        results = list(pool.map(episode, ids))
    for task_id, r1, r2, judgement in results:
        assert r1.reward == 1.0 and not r1.done, (task_id, r1.observation)
        assert r2.done and r2.reward == 1.0
        assert judgement.success and judgement.score == 1.0, (task_id, judgement)


def test_empty_wrong_and_missing_solutions_score_zero(humaneval):
    f, tasks = humaneval
    task = tasks["HumanEval/0"]
    for action in (
        fence("def has_close_elements(numbers, threshold):\n    pass"),
        fence("def has_close_elements(n, t):\n    return True"),
    ):
        env = f.make()
        env.reset(task)
        env.step(action)
        judgement = env.judge()
        assert judgement.score == 0.0 and not judgement.success, action
    env = f.make()
    env.reset(task)
    assert env.step("submit").done
    judgement = env.judge()
    assert judgement.score == 0.0 and judgement.info["no_solution"] == 1.0


def test_stage_rewards_rise_as_a_scripted_policy_fixes_tests(clip_factory):
    f = clip_factory
    (task,) = f.tasks("train")
    env = f.make()
    intro = env.reset(task)
    assert "add_clip" in intro and "4 visible tests" in intro
    attempts = [
        "def add_clip(a, b, hi):\n    return a - b",  # passes none
        "def add_clip(a, b, hi):\n    return a + b",  # the first two
        "def add_clip(a, b, hi):\n    return min(a + b, hi)",  # all but the negative one
        "def add_clip(a, b, hi):\n    return max(0, min(a + b, hi))",  # all
    ]
    rewards, observations = [], []
    for code in attempts:
        result = env.step(fence(code))
        rewards.append(result.reward)
        observations.append(result.observation)
    assert rewards == [0.0, 0.5, 0.75, 1.0]
    assert "Visible tests: 0/4 passed." in observations[0] and "got: -1" in observations[0]
    assert "FAILED test 4: assert add_clip(-5, 1, 10) == 0 | got: -4" in observations[2]
    assert "Visible tests: 4/4 passed." in observations[3]
    final = env.step("I am done: submit")
    assert final.done and final.reward == 1.0
    judgement = env.judge()
    assert judgement.success and judgement.score == 1.0
    assert judgement.info["hidden_fraction"] == 1.0 and judgement.info["turns"] == 5.0


def test_partial_hidden_score_and_binary_mode(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(CLIP_TASK) + "\n")
    for score, expected in (("fraction", 2 / 3), ("binary", 0.0)):
        f = factory(tasks_file=str(path), eval_fraction=0.0, score=score)
        env = f.make()
        env.reset(f.tasks("train")[0])
        env.step(fence("def add_clip(a, b, hi):\n    return min(a + b, hi)"))
        env.close()  # the worker may close a trajectory before (or while) it is judged
        judgement = env.judge()
        assert judgement.score == pytest.approx(expected) and not judgement.success


def test_bad_actions_get_clear_observations(clip_factory):
    f = clip_factory
    env = f.make()
    env.reset(f.tasks("train")[0])
    cases = [
        ("", "empty"),
        ("   \n\t", "empty"),
        ("I think the answer is to add the numbers.", "No Python code block"),
        ("\x00\xff\ufffd garbage ``` ```` `", "No Python code block"),
        ("```bash\nrm -rf /\n```", "not Python"),
        ("```python\n```", "empty"),
        ("run_tests", "no solution yet"),
        (fence("def add_clip(a, b, hi:\n    return a"), "did not load"),
        (fence("x = 1 +"), "SyntaxError"),
        (fence("raise SystemExit(3)"), "did not load"),
    ]
    env = f.make()
    env.reset(f.tasks("train")[0])
    f.max_turns = 100  # this env only: room for every case
    for action, expected in cases:
        result = env.step(action)
        assert not result.done and expected in result.observation, (action, result.observation)
        assert result.reward == 0.0
    result = env.step(fence("def add_clip(a, b, hi):\n    return " + "0 + " * MAX_CODE_CHARS + "0"))
    assert "limit" in result.observation and result.reward == 0.0


def test_action_parsing():
    assert parse_action(fence("def f():\n    return 1")).code == "def f():\n    return 1"
    unclosed = parse_action("```python\ndef f():\n    return 2\n")
    assert unclosed.code.strip() == "def f():\n    return 2"
    unfenced = parse_action("Sure:\ndef f():\n    return 3\n")
    assert unfenced.code.startswith("def f()") and not unfenced.submit
    last = parse_action("```python\ndef f(): return 1\n```\nbetter:\n```py\ndef f(): return 2\n```")
    assert last.code == "def f(): return 2"
    both = parse_action(fence("def submit():\n    pass") + "submit")
    assert both.submit and both.code.startswith("def submit")
    assert not parse_action(fence("def submit():\n    pass")).submit  # the word inside code is not the command
    assert parse_action("let me run_tests again").run_tests
    assert parse_action(None).code is None


def test_turn_budget_observation_cap_and_judge_delay(clip_factory, tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(CLIP_TASK) + "\n")
    f = factory(tasks_file=str(path), eval_fraction=0.0, max_turns=2, max_observation_chars=300, judge_delay_s=0.3)
    env = f.make()
    env.reset(f.tasks("train")[0])
    noisy = "def add_clip(a, b, hi):\n    print('x' * 5000)\n    raise ValueError('y' * 5000)"
    first = env.step(fence(noisy))
    assert not first.done and len(first.observation) <= 300 and "ValueError" in first.observation
    second = env.step("still thinking")
    assert second.done and second.observation == ""
    assert env.step("more").done  # after the end: no exception
    t0 = time.monotonic()
    judgement = env.judge()
    assert time.monotonic() - t0 >= 0.3 and judgement.score == 0.0
    assert env.judge() is judgement  # judged once
    env.close()


def test_jsonl_loader_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "p", "entry_point": "f", "visible_tests": []}) + "\n")
    with pytest.raises(EnvError, match="bad.jsonl line 1: no hidden test"):
        factory(tasks_file=str(bad)).tasks("train")
    bad.write_text("\n" + json.dumps({"prompt": "p", "visible_tests": [], "hidden_tests": ["pass"]}) + "\n")
    with pytest.raises(EnvError, match="bad.jsonl line 2: 'entry_point'"):
        factory(tasks_file=str(bad)).tasks("train")
    bad.write_text("{not json\n")
    with pytest.raises(EnvError, match="not JSON"):
        factory(tasks_file=str(bad)).tasks("train")
    with pytest.raises(EnvError, match="no such file"):
        factory(tasks_file=str(tmp_path / "missing.jsonl"))
    ok = tmp_path / "ok.jsonl"
    row = {
        "id": "t",
        "prompt": "def f(x): ...",
        "entry_point": "f",
        "test": "def check(candidate):\n    assert candidate(1) == 2",
    }
    ok.write_text(json.dumps(row) + "\n")
    f = factory(tasks_file=str(ok), eval_fraction=0.0)
    env = f.make()
    env.reset(f.tasks("train")[0])
    env.step(fence("def f(x):\n    return x + 1"))
    assert env.judge().success


def test_envs_run_concurrently_from_threads(clip_factory):
    f = clip_factory
    task = f.tasks("train")[0]
    codes = ["return a - b", "return a + b", "return min(a + b, hi)", "return max(0, min(a + b, hi))"] * 2

    def episode(body):
        env = f.make()
        env.reset(Task(task.id, task.data))
        reward = env.step(fence(f"def add_clip(a, b, hi):\n    {body}")).reward
        return reward, env.judge().score

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(episode, codes))
    assert [r for r, _ in results] == [0.0, 0.5, 0.75, 1.0] * 2
    assert [s for _, s in results] == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0] * 2)


@pytest.mark.slow  # a subprocess that imports torch (for the machine line): ~10 s
def test_sandbox_benchmark_quick():
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "sandbox.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=repo,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    headline = json.loads(done.stdout.strip().splitlines()[-1])
    assert headline["judged_ok"] == headline["problems"] == 16 and headline["exec_per_s_serial_auto"] > 0


CORRECT_CLIP = "def add_clip(a, b, hi):\n    return max(0, min(a + b, hi))"


def test_a_correct_solution_earns_full_reward_and_says_how_it_was_judged(clip_factory):
    env = clip_factory.make()
    env.reset(clip_factory.tasks("train")[0])
    assert env.step(fence(CORRECT_CLIP)).reward == 1.0
    judgement = env.judge()
    assert judgement.score == 1.0 and judgement.success
    namespaces = "netns" in clip_factory.sandbox.run("", []).isolation
    assert judgement.info["judged_without_namespaces"] == (0.0 if namespaces else 1.0)


@pytest.mark.parametrize("hack", [
    "class Yes:\n    def __eq__(self, other):\n        return True\ndef add_clip(a, b, hi):\n    return Yes()",
    "import builtins\nbuiltins.AssertionError = type('No', (Exception,), {})\ndef add_clip(a, b, hi):\n    return -1",
    "import os\nos._exit(0)",
    "import sys\nprint('Visible tests: 4/4 passed.')\nsys.exit(0)",
])
def test_reward_hacks_earn_nothing_from_the_coding_env(clip_factory, hack):
    env = clip_factory.make()
    env.reset(clip_factory.tasks("train")[0])
    assert env.step(fence(hack)).reward == 0.0
    judgement = env.judge()
    assert judgement.score == 0.0 and not judgement.success


def test_the_tasks_helpers_stay_the_tasks_own(tmp_path):
    """HumanEval/38-style: the hidden test uses a helper of the prompt; a solution redefining it gains nothing."""
    task = {"id": "cyclic", "prompt": "def encode(s):\n    return s[::-1]\n\ndef decode(s):\n    '''Undo encode.'''\n",
            "setup": "def encode(s):\n    return s[::-1]\n", "entry_point": "decode",
            "hidden_tests": ["assert decode(encode('abc')) == 'abc'"]}
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(task) + "\n")
    f = factory(tasks_file=str(path), eval_fraction=0.0)
    for code, score in [("def encode(s):\n    return s\ndef decode(s):\n    return s", 0.0),
                        ("def decode(s):\n    return s[::-1]", 1.0)]:
        env = f.make()
        env.reset(f.tasks("train")[0])
        env.step(fence(code) + "submit")
        assert env.judge().score == score, code


def test_require_namespaces_refuses_a_host_without_them(monkeypatch):
    with pytest.raises(EnvError, match="env.kwargs.require_namespaces"):
        load_factory("coding", {"require_namespaces": "yes"})
    with pytest.raises(EnvError, match="env.kwargs.require_namespaces: true .the default. needs env.kwargs.isolation"):
        load_factory("coding", {"isolation": "basic"})
    load_factory("coding", {"isolation": "basic", "require_namespaces": False})  # the explicit, unsafe opt-out
    from rollout.sandbox import Sandbox

    original = Sandbox._agent_spec  # a host that forbids unshare: the agent's process gets no namespaces
    monkeypatch.setattr(Sandbox, "_agent_spec", lambda self, *a: {**original(self, *a), "namespaces": False})
    with pytest.raises(EnvError, match="env.kwargs.require_namespaces: namespaces are required") as refused:
        load_factory("coding", {})  # the default fails closed
    assert "CLONE_NEWNET|CLONE_NEWNS" in str(refused.value)  # the missing capability, by name
    assert "require_namespaces: false, the explicit opt-out" in str(refused.value)
    assert "unsafe" in str(refused.value)
    load_factory("coding", {"require_namespaces": False})  # the opt-out starts; judgements say how they were judged
