"""The `tasks` environment: questions from reasoning-gym or a JSONL file, seeded disjoint splits, the tools (a safe
calculator, sandboxed Python), the stage reward for using a tool's result, the verifier's outcome, bad kwargs."""

from __future__ import annotations

import json
import re

import pytest

from async_rl import Action, ToolCall, ToolResult
from rollout.envs.base import EnvError, checked_step, load_factory, tools_of
from rollout.envs.calculator import CalcError, calculate, format_number
from rollout.envs.tasks import normalise, same_answer, uses


def calc(expression: str, call_id: str = "call_0") -> Action:
    return Action(f"<tool_call>{expression}</tool_call>", [ToolCall("calculator", {"expression": expression}, call_id)])


@pytest.fixture(scope="module")
def arithmetic():
    return load_factory("tasks", {"dataset": "basic_arithmetic", "size": 30, "seed": 3,
                                  "dataset_config": {"min_terms": 2, "max_terms": 2, "max_digits": 2}})


def test_reasoning_gym_tasks_split_disjoint_and_seeded(arithmetic):
    train, evaluation = arithmetic.tasks("train"), arithmetic.tasks("eval")
    questions = [t.data["question"] for t in train + evaluation]
    assert len(questions) == len(set(questions)) <= 30  # one task per distinct question: no question in both
    assert len(evaluation) == round(len(questions) * 0.2) and len(train) >= 20
    assert all(t.id.startswith("basic_arithmetic/") for t in train)
    again = load_factory("tasks", {"dataset": "basic_arithmetic", "size": 30, "seed": 3,
                                   "dataset_config": {"min_terms": 2, "max_terms": 2, "max_digits": 2}})
    assert [t.id for t in again.tasks("eval")] == [t.id for t in evaluation]
    other = load_factory("tasks", {"dataset": "basic_arithmetic", "size": 30, "seed": 4})
    assert [t.data for t in other.tasks("eval")] != [t.data for t in evaluation]
    json.dumps([t.data for t in train])  # task data is JSON


def test_a_right_answer_succeeds_and_a_wrong_one_does_not(arithmetic):
    task = arithmetic.tasks("eval")[0]
    right, env = task.data["answer"], arithmetic.make()
    assert "<answer>" in env.reset(task) and task.data["question"] in env.reset(task)
    result = checked_step("tasks", env, Action(f"I think <answer>{right}</answer>", []))
    assert result.done and result.reward == 0.0 and result.observation is None  # no tool: no stage reward
    judged = env.judge()
    assert judged.score == 1.0 and judged.success and judged.info["answer_tagged"] == 1.0
    wrong = arithmetic.make()
    wrong.reset(task)
    wrong.step(Action(f"<answer>{int(right) + 1}</answer>", []))
    assert not wrong.judge().success
    untagged = arithmetic.make()  # a turn without a call and without the tag: its whole text is the answer
    untagged.reset(task)
    assert untagged.step(Action(right, [])).done and untagged.judge().success


def test_a_calculator_call_then_an_answer_that_uses_it_earns_the_stage_reward(arithmetic):
    task = arithmetic.tasks("train")[0]
    expression = task.data["question"].removeprefix("Calculate ").rstrip(".")
    env = arithmetic.make()
    env.reset(task)
    assert [s["function"]["name"] for s in tools_of("tasks", env)] == ["calculator"]
    first = env.step(calc(expression))
    assert not first.done and first.reward == 0.0
    assert first.observation == [ToolResult(task.data["answer"], "calculator", "call_0")]
    last = env.step(Action(f"<answer>{first.observation[0].content}</answer>", []))
    assert last.done and last.reward == pytest.approx(0.1)
    judged = env.judge()
    assert judged.success and judged.info == {"tool_calls": 1.0, "tool_errors": 0.0, "answer_tagged": 1.0,
                                              "called_tool": 1.0, "used_tool_result": 1.0}
    ignored = arithmetic.make()  # a right answer that does not use the (wrong) call's result: no stage reward
    ignored.reset(task)
    ignored.step(calc("1 + 1000"))
    assert ignored.step(Action(f"<answer>{task.data['answer']}</answer>", [])).reward == 0.0


def test_parse_errors_and_tool_errors_are_answered_and_turns_are_bounded(arithmetic):
    task = arithmetic.tasks("train")[1]
    env = load_factory("tasks", {"size": 10, "max_turns": 3}).make()
    env.reset(task)
    bad = env.step(Action("<tool_call>{oops</tool_call>", [], parse_error="tool call 1: malformed JSON"))
    assert bad.observation == [ToolResult("error: tool call 1: malformed JSON")] and not bad.done
    refused = env.step(calc("__import__('os').system('true')"))
    assert refused.observation[0].content.startswith('error: unknown function "__import__(') and not refused.done
    assert env.step(calc("2 + 2")).done  # the third turn is the last, whatever it does
    judged = env.judge()
    assert not judged.success and judged.info["tool_calls"] == 1 and judged.info["tool_errors"] == 2


def test_jsonl_tasks_judged_by_exact_match_after_normalising(tmp_path):
    path = tmp_path / "tasks.jsonl"
    records = [{"question": f"What is {n} + {n}?", "answer": 2 * n} for n in range(9)]
    records += [{"id": "capital", "question": "Capital of France?", "answer": "Paris"},
                {"question": "What is 0 + 0?", "answer": 0}]  # a repeated question: kept once
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    factory = load_factory("tasks", {"tasks_file": str(path), "eval_fraction": 0.3, "seed": 1, "tools": []})
    train, evaluation = factory.tasks("train"), factory.tasks("eval")
    assert len(train) + len(evaluation) == 10 and len(evaluation) == 3
    assert not {t.data["question"] for t in train} & {t.data["question"] for t in evaluation}
    assert [t.id for t in load_factory("tasks", {"tasks_file": str(path), "eval_fraction": 0.3, "seed": 2})
            .tasks("eval")] != [t.id for t in evaluation]
    capital = next(t for t in train + evaluation if t.id == "capital")
    env = factory.make()
    assert "tool" not in env.reset(capital) and tools_of("tasks", env) == []
    env.step(Action("<answer> paris. </answer>", []))
    assert env.judge().success
    env = factory.make()
    env.reset(capital)
    env.step(Action("<answer>Lyon</answer>", []))
    assert env.judge().score == 0.0


def test_normalising_and_using_a_result():
    assert normalise("  The  Answer. ") == "the answer" and normalise("1,234") == "1234"
    assert same_answer("4.0", "4") and same_answer("$12$", "12") and not same_answer("12", "13")
    assert uses("so it is 13.", "13") and uses("x = -204", "-204")
    assert not uses("135", "13") and not uses("13.5", "13") and not uses("13", "error: division by zero")


@pytest.mark.parametrize(("expression", "value"), [
    ("415 * 336 * -940 - 590 + 330 + 846", "-131073014"), ("478 / 1 + -682", "-204"), ("7 // 2", "3"),
    ("2 ** 10", "1024"), ("sqrt(16) + abs(-1)", "5"), ("0.1 + 0.2", "0.3"), ("max(1, 2, 3) % 2", "1"),
])
def test_the_calculator_computes(expression, value):
    assert format_number(calculate(expression)) == value


@pytest.mark.parametrize(("expression", "why"), [
    ("__import__('os')", "unknown function '__import__'"), ("abs.__class__(2)", "unknown function 'abs.__class__'"),
    ("().__class__", "Attribute is not allowed"), ("x + 1", "unknown name 'x'"), ("'a' * 3", "only numbers"),
    ("10 ** 10 ** 10", "exponent 10000000000 is too large"), ("9 ** 64", "result too large"),
    ("10 ** 20 * 10 ** 20", "result too large"), ("1 / 0", "division by zero"), ("(-8) ** 0.5", "not a real number"),
    ("1 +", "not an arithmetic expression"), ("1" * 300, "longer than 200 characters"),
    ("[x for x in ()]", "ListComp is not allowed"),
])
def test_the_calculator_refuses(expression, why):
    with pytest.raises(CalcError, match=re.escape(why)):
        calculate(expression)


def test_the_python_tool_runs_in_the_sandbox(arithmetic):
    factory = load_factory("tasks", {"size": 10, "tools": ["calculator", "python"], "python_timeout_s": 10})
    env = factory.make()
    env.reset(factory.tasks("train")[0])
    assert [s["function"]["name"] for s in env.tools()] == ["calculator", "python"]
    done = env.step(Action("", [ToolCall("python", {"code": "print(6 * 7)"}, "call_0"),
                                ToolCall("python", {"code": "raise ValueError('no')"}, "call_1"),
                                ToolCall("python", {"source": "1"}, "call_2")]))
    contents = [r.content for r in done.observation]
    assert contents[0] == "42" and "ValueError: no" in contents[1]
    assert contents[2] == "error: python needs the argument 'code' as a string"


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({"dataset": "no_such_dataset"}, "env.kwargs.dataset: reasoning-gym has no dataset 'no_such_dataset'"),
    ({"dataset_config": {"bogus": 1}}, "env.kwargs.dataset_config: reasoning-gym's 'basic_arithmetic' refused it"),
    ({"dataset": "basic_arithmetic", "tasks_file": "x.jsonl"}, "env.kwargs.dataset: give a reasoning-gym dataset or"),
    ({"tasks_file": "/no/such/file.jsonl"}, "env.kwargs.tasks_file: no such file: /no/such/file.jsonl"),
    ({"tools": ["shell"]}, "env.kwargs.tools: unknown tool 'shell' (allowed: calculator, python)"),
    ({"eval_fraction": 1.0}, "env.kwargs.eval_fraction: expected 0 < f < 1, got 1.0"),
    ({"max_turns": "many"}, "env.kwargs.max_turns: expected `int`, got `str`"),
    ({"colour": "red"}, "env.kwargs.colour: env 'tasks' takes no such setting"),
])
def test_bad_kwargs_are_named(kwargs, expected):
    with pytest.raises(EnvError) as info:
        load_factory("tasks", kwargs)
    assert expected in str(info.value)


@pytest.mark.parametrize(("lines", "expected"), [
    (['{"question": "a", "answer": "1"}', "not json"], "line 2: not JSON"),
    (['{"question": "a"}', '{"question": "b", "answer": 2}'], "line 1: answer must be a string or a number"),
    (['{"q": "a", "answer": 1}'], 'line 1: expected {"question": str'),
    (['{"question": "a", "answer": 1}'], "holds 1 task(s)"),
])
def test_a_bad_tasks_file_is_named_with_its_line(tmp_path, lines, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines))
    with pytest.raises(EnvError) as info:
        load_factory("tasks", {"tasks_file": str(path)}).tasks("train")
    assert expected in str(info.value)
