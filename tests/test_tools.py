"""Tool calls in the environment seam: the hermes parser, the checks on what an env with tools returns, and the
episode runner with a real torch engine on a tiny model (tool specs through the chat template, parse errors
reaching the env and counted, tool results as `tool` messages, records that concatenate to the context)."""

from __future__ import annotations

import time

import pytest

from async_rl import Action, Judgement, StepResult, Task, ToolCall, ToolResult
from async_rl.config_load import load_config
from async_rl.hf_io import TOOLS_TEMPLATE
from async_rl.model import byte_tokenizer, ensure_model_dir, load_tokenizer
from rollout.engines import SamplingParams
from rollout.engines.torch_engine import TorchEngine
from rollout.envs.base import EnvError, checked_step, tools_of
from rollout.prompting import blinded, tools_text
from rollout.runner import EpisodeRunner, Prompter
from rollout.tool_parser import get_parser, parse_hermes, parse_none

ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
NAMES = ["add", "mul"]


def chatml_tools_tokenizer():
    """The byte-level tokenizer with the ChatML template async-rl ships for models whose own renders no tools."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = '{%- set default_system = "" %}\n' + TOOLS_TEMPLATE.read_text()
    return tokenizer


# --- the hermes parser ---------------------------------------------------------------------------------------


def test_a_well_formed_call_parses():
    action, errors = parse_hermes('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', NAMES)
    assert errors == 0 and action.parse_error is None
    assert action.tool_calls == [ToolCall("add", {"a": 1, "b": 2}, "call_0")]


def test_several_calls_with_text_around_them_parse_in_order():
    text = ('First I add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> then '
            '<tool_call>{"name": "mul", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call> done.')
    action, errors = parse_hermes(text, NAMES)
    assert errors == 0 and action.text == text
    assert action.tool_calls == [ToolCall("add", {"a": 1, "b": 2}, "call_0"),
                                 ToolCall("mul", {"a": 3, "b": 4}, "call_1")]


def test_no_call_is_an_action_without_calls():
    assert parse_hermes("The answer is 4.", NAMES) == (Action("The answer is 4.", [], None), 0)
    assert parse_none('<tool_call>{"name": "add", "arguments": {}}</tool_call>', NAMES)[0].tool_calls == []
    with pytest.raises(ValueError, match="rollout.tool_parser: expected one of hermes, none"):
        get_parser("json")


@pytest.mark.parametrize(("text", "why"), [
    ('<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>', "malformed JSON"),
    ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', "unknown tool 'rm' (tools: add, mul)"),
    ('<tool_call>{"arguments": {"a": 1}}</tool_call>', "no tool name"),
    ('<tool_call>["add"]</tool_call>', "expected a JSON object"),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1', "<tool_call> without </tool_call>"),
])
def test_a_call_that_does_not_parse_is_a_parse_error_not_an_exception(text, why):
    action, errors = parse_hermes(text, NAMES)
    assert errors == 1 and action.tool_calls == [] and why in action.parse_error


def test_good_calls_survive_a_bad_one_beside_them():
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
            '<tool_call>{nope}</tool_call><tool_call>{"name": "mul"}</tool_call>')
    action, errors = parse_hermes(text, NAMES)
    assert errors == 1 and action.parse_error.startswith("tool call 2: malformed JSON")
    assert [c.name for c in action.tool_calls] == ["add", "mul"] and action.tool_calls[1].arguments == {}


# --- what an env with tools may return --------------------------------------------------------------------------


class Returns:
    def __init__(self, observation=None, tools=None):
        self.observation, self.specs = observation, tools

    def step(self, action):
        return StepResult(self.observation, 0.5, False)

    def tools(self):
        return self.specs


def test_a_list_of_tool_results_is_a_valid_observation_and_nothing_else_is():
    results = [ToolResult("3", "add", "call_0")]
    assert checked_step("e", Returns(results), Action("x", [])).observation == results
    for bad, why in [([ToolResult("3"), "4"], "holding a str, expected ToolResult"),
                     ([ToolResult(3)], "whose content is a int, expected str"),
                     ({"content": "3"}, "observation of type dict (expected str, None, or a list of ToolResult)")]:
        with pytest.raises(EnvError, match=f"env 'e': step returned .*{why[:20]}"):
            checked_step("e", Returns(bad), Action("x", []))


def test_tool_specs_are_checked():
    assert tools_of("e", object()) is None  # no tools(): the env gets text, as always
    assert tools_of("e", Returns(tools=[ADD])) == [ADD]
    for bad, why in [({"add": 1}, "expected a list"), ([{"name": "add"}], 'expected {"type": "function"'),
                     ([ADD, ADD], "names 'add' twice"),
                     ([{"type": "function", "function": {"name": "f", "x": {1}}}], "not JSON-serialisable")]:
        with pytest.raises(EnvError, match=why.replace("(", r"\(").replace("{", r"\{")):
            tools_of("e", Returns(tools=bad))


def test_blind_evaluation_hides_each_tool_result():
    assert blinded([ToolResult("3", "add", "call_0")], "?") == [ToolResult("?", "add", "call_0")]
    assert blinded("higher", "?") == "?"


# --- rendering ------------------------------------------------------------------------------------------------


def test_without_a_chat_template_tool_specs_and_results_are_plain_text():
    tokenizer = byte_tokenizer()
    prompter = Prompter(tokenizer)
    assert tokenizer.decode(prompter.first("add 1 and 2", [ADD])) == tools_text([ADD]) + "add 1 and 2"
    assert '"name": "add"' in tools_text([ADD])
    assert tokenizer.decode(prompter.next([ToolResult("3", "add")])) == "<tool_response>\n3\n</tool_response>\n"


def test_a_template_that_ignores_tools_gets_them_as_text_in_the_user_turn():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    text = tokenizer.decode(Prompter(tokenizer).first("q", [ADD]))
    assert text == "<|user|>" + tools_text([ADD]) + "q<|end|><|assistant|>"


# --- the runner, with a real engine on a tiny model ------------------------------------------------------------


class ToolEnv:
    """Answers every turn with two tool results, ends after `turns` turns; keeps what it was given."""

    def __init__(self, turns=3):
        self.turns, self.seen = turns, []

    def tools(self):
        return [ADD]

    def reset(self, task):
        return "add numbers"

    def step(self, action):
        self.seen.append(action)
        if len(self.seen) >= self.turns:
            return StepResult(None, 1.0, True)
        return StepResult([ToolResult(f"seen {len(self.seen)}", "add", "call_0"), ToolResult("second")], 0.0, False)

    def judge(self):
        return Judgement(1.0, True)


class PlainEnv(ToolEnv):
    tools = None  # no tools(): the text seam exactly as before

    def step(self, action):
        self.seen.append(action)
        return StepResult("lower", 0.0, len(self.seen) >= self.turns)


class Factory:
    def __init__(self, env_type, vocabulary=None):
        self.env_type, self.envs, self.words = env_type, [], vocabulary

    def tasks(self, split):
        return [Task("t", {})]

    def make(self):
        self.envs.append(self.env_type())
        return self.envs[-1]


class Records:
    """A sink that checks the records' invariant as they come: the context the policy saw is exactly the
    concatenation of every earlier stage's observation and action tokens, then this stage's observation."""

    def __init__(self):
        self.stages, self.outcomes = {}, []

    def stage(self, episode, generation, reward, terminal):
        stages = self.stages.setdefault(episode.trajectory_id, [])
        before = [t for obs, act in stages for t in obs + act]
        assert episode.context == before + episode.observation_tokens
        stages.append((list(episode.observation_tokens), list(generation.token_ids)))

    def outcome(self, episode, judgement, reason):
        self.outcomes.append((judgement, reason))


def run(factory, tokenizer, model_dir, max_new_tokens, group_size=2, seed=0, task=None):
    sink = Records()
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=[tokenizer.eos_token_id])
    runner = EpisodeRunner("tools-test", factory, TorchEngine(model_dir, seed=seed), tokenizer, params, 2048, sink, 8)
    runner.start_group("g", task or Task("t", {}), group_size)
    deadline = time.monotonic() + 120
    try:
        while not runner.idle():
            assert time.monotonic() < deadline, "the episodes did not finish"
            runner.pump(0.05)
        return sink, runner.take_stats()
    finally:
        runner.close()


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    config = load_config(None, [f"run.dir={tmp_path_factory.mktemp('runs')}", "run.seed=1", "model.max_seq_len=2048"])
    return ensure_model_dir(config.model, config.run_dir, config.run.seed)


def test_the_runner_renders_tools_and_tool_results_through_the_template(byte_model):
    tokenizer = chatml_tools_tokenizer()
    factory = Factory(ToolEnv)
    sink, stats = run(factory, tokenizer, byte_model, max_new_tokens=6)
    assert [r for _, r in sink.outcomes] == ["", ""] and len(sink.stages) == 2
    first = tokenizer.apply_chat_template([{"role": "user", "content": "add numbers"}], tools=[ADD],
                                          tokenize=False, add_generation_prompt=True)
    assert "<tools>" in first and '"name": "add"' in first
    tool_turn = ("<|im_start|>user\n<tool_response>\nseen {}\n</tool_response>\n<tool_response>\nsecond\n"
                 "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    for stages in sink.stages.values():
        assert len(stages) == 3
        assert tokenizer.decode(stages[0][0]) == first
        assert [tokenizer.decode(obs) for obs, _ in stages[1:]] == [tool_turn.format(1), tool_turn.format(2)]
    # each env got Actions holding the decoded text of the model's own tokens (never re-tokenized); the envs are
    # made in one order and their trajectories reach the sink in another, so they are matched as a multiset
    assert all(isinstance(a, Action) for env in factory.envs for a in env.seen)
    assert sorted([a.text for a in env.seen] for env in factory.envs) == sorted(
        [tokenizer.decode(act, skip_special_tokens=True) for _, act in stages] for stages in sink.stages.values())
    assert stats["tool_calls"] == 0 and stats["tool_call_errors"] == 0  # random bytes call nothing


def test_an_env_without_tools_gets_text_and_user_turns_as_before(byte_model):
    tokenizer = chatml_tools_tokenizer()
    factory = Factory(PlainEnv)
    sink, stats = run(factory, tokenizer, byte_model, max_new_tokens=4)
    user_turn = "<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n"
    for env, stages in zip(factory.envs, sink.stages.values(), strict=True):
        assert tokenizer.decode(stages[0][0]) == "<|im_start|>user\nadd numbers<|im_end|>\n<|im_start|>assistant\n"
        assert [tokenizer.decode(obs) for obs, _ in stages[1:]] == [user_turn, user_turn]
        assert all(isinstance(a, str) for a in env.seen)
    assert stats["tool_calls"] == 0 and stats["tool_call_errors"] == 0


GOOD = '<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>'
BAD_JSON = '<tool_call>{"name":"add","arguments":{</tool_call>'
UNKNOWN = '<tool_call>{"name":"rm","arguments":{}}</tool_call>'


def test_parse_errors_reach_the_env_and_every_call_is_counted(tmp_path):
    """A tiny model over a word vocabulary whose words are whole tool calls, good and bad, one word a turn."""
    words = [GOOD, BAD_JSON, UNKNOWN, "answer"]
    config = load_config(None, [f"run.dir={tmp_path}", "run.seed=2", "model.max_seq_len=2048"])
    model_dir = ensure_model_dir(config.model, config.run_dir, config.run.seed, words)
    tokenizer = load_tokenizer(model_dir)
    assert not Prompter(tokenizer).chat  # also the plain-text path: specs in the first observation as text
    factory = Factory(lambda: ToolEnv(turns=4))
    sink, stats = run(factory, tokenizer, model_dir, max_new_tokens=1, group_size=8, seed=1)
    actions = [a for env in factory.envs for a in env.seen]
    assert len(actions) == 32 and all(isinstance(a, Action) for a in actions)
    by_word = {w: [a for a in actions if a.text == w] for w in words}
    assert all(by_word[w] for w in (GOOD, BAD_JSON, UNKNOWN)), {w: len(a) for w, a in by_word.items()}
    assert all(a.tool_calls == [ToolCall("add", {"a": 1, "b": 2}, "call_0")] and a.parse_error is None
               for a in by_word[GOOD])
    assert all(a.tool_calls == [] and "malformed JSON" in a.parse_error for a in by_word[BAD_JSON])
    assert all(a.tool_calls == [] and "unknown tool 'rm'" in a.parse_error for a in by_word[UNKNOWN])
    assert stats["tool_calls"] == len(by_word[GOOD])
    assert stats["tool_call_errors"] == len(by_word[BAD_JSON]) + len(by_word[UNKNOWN])
    assert len(sink.stages) == 8 and all(len(s) == 4 for s in sink.stages.values())


# --- the docs' tool-using example ------------------------------------------------------------------------------


def docs_tool_example() -> str:
    """The complete tool-using example environment of docs/environments.md, exactly as printed there."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "environments.md").read_text()
    start = text.index('```python\n"""Add two numbers with a tool') + len("```python\n")
    return text[start : text.index("```", start)]


def test_the_docs_tool_example_runs_as_printed(tmp_path, monkeypatch, byte_model):
    from rollout.envs.base import load_factory

    (tmp_path / "add_env.py").write_text(docs_tool_example())
    monkeypatch.syspath_prepend(str(tmp_path))
    factory = load_factory("add_env:factory", {"max_turns": 3})
    task = factory.tasks("eval")[0]
    a, b = task.data["a"], task.data["b"]
    env = factory.make()
    env.reset(task)
    call, errors = parse_hermes(f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>',
                                ["add"])
    result = checked_step("add_env", env, call)
    assert result.observation == [ToolResult(str(a + b), "add", "call_0")] and not result.done
    bad, _ = parse_hermes('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', ["add"])
    assert checked_step("add_env", env, bad).observation[0].content.startswith("error: tool call 1: malformed JSON")
    assert checked_step("add_env", env, Action(f"<answer>{a + b}</answer>", [])).done
    assert env.judge() == Judgement(1.0, True, {"calls": 1.0})
    # through the episode runner, with the template's tools section and a real engine
    tokenizer = chatml_tools_tokenizer()
    sink, stats = run(factory, tokenizer, byte_model, max_new_tokens=8, task=task)
    assert [r for _, r in sink.outcomes] == ["", ""]
    first = next(iter(sink.stages.values()))[0][0]
    assert '"name": "add"' in tokenizer.decode(first) and "<tools>" in tokenizer.decode(first)
