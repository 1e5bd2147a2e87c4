"""An agent you already have, trained as it is (issue 54): the OpenAI-compatible endpoint of a rollout worker and the
`agent` env. The chat shapes alone (rollout/agents/chat_api.py); then agents written against the `openai` client only
(tests/outside_agents.py, examples/weather_agent.py) driving the real episode runner, the real torch engine on the
tiny model and the real HTTP endpoint over loopback sockets: token in and token out, stage rewards, history edits,
failures contained and counted, 64 agents at once; and README's command, run as printed through real processes."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import async_rl
from async_rl.config_load import load_config
from async_rl.model import ensure_model_dir, load_tokenizer
from rollout.agents.chat_api import (
    ChatError,
    ChatTemplate,
    assistant_message,
    first_difference,
    normalise_messages,
    parse_request,
    stream_events,
)
from rollout.engines import SamplingParams
from rollout.engines.torch_engine import TorchEngine
from rollout.envs.base import EnvError, load_factory, vocabulary_of
from rollout.runner import EpisodeRunner
from rollout.tool_parser import parse_hermes

REPO = Path(__file__).resolve().parent.parent
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


# --- the chat shapes --------------------------------------------------------------------------------------------


def test_a_request_is_checked_and_normalised():
    request = parse_request({"model": "m", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": "hi"}], "tools": [WEATHER], "max_tokens": 9, "temperature": 0.1})
    assert request.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert request.parse_names == ["weather"] and request.max_new_tokens == 9 and not request.stream
    assert parse_request({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                          "tool_choice": "none"}).parse_names == []
    for body, param in [({"messages": []}, "messages"), ({"messages": [{"role": "user", "content": "x"}], "n": 3}, "n"),
                        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
                        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"function": {"name": "no"}},
                          "tools": [WEATHER]}, "tool_choice"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0]")]:
        with pytest.raises(ChatError) as caught:
            parse_request(body)
        assert caught.value.param == param and caught.value.payload()["error"]["param"] == param


def test_the_models_text_becomes_an_openai_assistant_message():
    text = 'Let me look. <tool_call>{"name": "weather", "arguments": {"city": "oslo"}}</tool_call>'
    message, calls, errors = assistant_message(text, parse_hermes, ["weather"], turn=3)
    assert (calls, errors) == (1, 0)
    assert message == {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "call_3_0", "type": "function", "function": {"name": "weather", "arguments": '{"city": "oslo"}'}}]}
    only_call, _, _ = assistant_message('<tool_call>{"name": "weather", "arguments": {}}</tool_call>', parse_hermes,
                                        ["weather"], 0)
    assert only_call["content"] is None
    bad = '<tool_call>{"name": "nope"}</tool_call>'  # a call that does not parse stays in the content
    assert assistant_message(bad, parse_hermes, ["weather"], 0) == ({"role": "assistant", "content": bad}, 0, 1)
    assert assistant_message(text, parse_hermes, [], 0)[0] == {"role": "assistant", "content": text}  # tool_choice none
    events = stream_events({"id": "c", "created": 1, "model": "m", "choices": [
        {"index": 0, "message": message, "finish_reason": "tool_calls"}]}).decode()
    chunks = [json.loads(line[6:]) for line in events.split("\n\n") if line.startswith("data: {")]
    assert events.endswith("data: [DONE]\n\n") and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[1]["choices"][0]["delta"]["tool_calls"][0]["index"] == 0


def test_a_request_extends_the_trajectory_or_names_what_it_changed():
    sent = normalise_messages([{"role": "user", "content": "q"}])
    returned = normalise_messages([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0_0", "type": "function", "function": {"name": "weather", "arguments": '{"city": "oslo"}'}}]}])[0]

    def why(messages, tools=(WEATHER,)):
        return first_difference(sent, returned, [WEATHER], parse_request({"messages": messages, "tools": list(tools)}))

    resent = {"role": "assistant", "content": "", "tool_calls": [  # other ids and JSON spacing: the same answer
        {"id": "x", "type": "function", "function": {"name": "weather", "arguments": '{"city":"oslo"}'}}]}
    tool = {"role": "tool", "tool_call_id": "x", "content": "snowy"}
    assert why([{"role": "user", "content": "q"}, resent, tool]) is None
    assert "messages[0]" in why([{"role": "user", "content": "Q"}, resent, tool])
    assert "messages[1]" in why([{"role": "user", "content": "q"}, dict(resent, content="hm"), tool])
    assert "without the model's answer" in why([{"role": "user", "content": "q"}])
    assert "tools" in why([{"role": "user", "content": "q"}, resent, tool], tools=())


def test_only_the_new_messages_are_rendered_after_the_models_answer():
    tokenizer = load_tokenizer(_byte_model_dir())
    template = ChatTemplate(tokenizer)  # no template of its own: async-rl's ChatML tools template
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"}]
    request = parse_request({"messages": messages, "tools": [WEATHER]})
    assert "<tools>" in tokenizer.decode(template.first(parse_request({"messages": messages[:1], "tools": [WEATHER]})))
    assert tokenizer.decode(template.delta(request, 2)) == (
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_a_reward_is_a_finite_number_sent_through_the_agents_client():
    class Client:
        def __init__(self):
            self.sent = []

        def post(self, path, cast_to, body):
            self.sent.append((path, cast_to, body))
            return "{}"

    client = Client()
    async_rl.reward(client, 2)
    assert client.sent == [("/async-rl/reward", str, {"value": 2.0})]
    for value in (math.nan, math.inf, True, "1"):
        with pytest.raises(ValueError, match="finite number"):
            async_rl.reward(client, value)
    with pytest.raises(TypeError, match="openai"):
        async_rl.reward(object(), 1.0)


def test_the_agent_env_names_what_is_wrong_with_its_settings(tmp_path):
    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"question": "a"}\n{"question": "b"}\n')
    with pytest.raises(EnvError, match="env.kwargs.entry: cannot import module 'no_such_module'"):
        load_factory("agent", {"entry": "no_such_module:run", "tasks": str(tasks)})
    with pytest.raises(EnvError, match="env.kwargs.tasks: no such file"):
        load_factory("agent", {"entry": "outside_agents:two_turns", "tasks": str(tmp_path / "none.jsonl")})
    tasks.write_text('{"question": "a"}\n[1]\n')
    with pytest.raises(EnvError, match=r"env.kwargs.tasks: .* line 2: expected a JSON object"):
        load_factory("agent", {"entry": "outside_agents:two_turns", "tasks": str(tasks)})
    tasks.write_text('{"question": "a", "split": "eval"}\n{"question": "b"}\n{"question": "c"}\n')
    factory = load_factory("agent", {"entry": "outside_agents:two_turns", "tasks": str(tasks)})
    assert [t.data["question"] for t in factory.tasks("eval")] == ["a"] and len(factory.tasks("train")) == 2


# --- agents driving the real runner, engine and endpoint ----------------------------------------------------------


_MODELS: dict[str, Path] = {}


def _byte_model_dir() -> Path:
    if "byte" not in _MODELS:
        import tempfile

        config = load_config(None, [f"run.dir={tempfile.mkdtemp(prefix='agent-model-')}", "run.seed=1",
                                    "model.max_seq_len=2048"])
        _MODELS["byte"] = ensure_model_dir(config.model, config.run_dir, config.run.seed)
    return _MODELS["byte"]


class Records:
    """A sink that checks each stage as it comes: the context is every earlier stage's observation and action
    tokens, then this stage's observation (what the learner rebuilds from the records)."""

    def __init__(self):
        self.stages, self.rewards, self.outcomes, self.tasks = {}, {}, {}, {}

    def stage(self, episode, generation, reward, terminal):
        stages = self.stages.setdefault(episode.trajectory_id, [])
        before = [t for obs, act in stages for t in obs + act]
        assert episode.context == before + episode.observation_tokens
        stages.append((list(episode.observation_tokens), list(generation.token_ids)))
        self.rewards.setdefault(episode.trajectory_id, []).append(reward)
        self.tasks[episode.trajectory_id] = episode.task

    def outcome(self, episode, judgement, reason):
        self.outcomes[episode.trajectory_id] = (judgement, reason)
        self.tasks[episode.trajectory_id] = episode.task


@contextlib.contextmanager
def weather_example(tmp_path: Path) -> Iterator[tuple[Path, list[dict]]]:
    """examples/weather_agent.py importable (examples/ on sys.path while the block runs), the word-level tiny model
    its VOCABULARY builds, and its task file's records."""
    import sys

    sys.path.insert(0, str(REPO / "examples"))
    try:
        factory = load_factory("agent", {"entry": "weather_agent:run",
                                         "tasks": str(REPO / "examples" / "weather_tasks.jsonl")})
        config = load_config(None, [f"run.dir={tmp_path / 'runs'}", "run.seed=3"])
        model_dir = ensure_model_dir(config.model, config.run_dir, config.run.seed, vocabulary_of("agent", factory))
        records = [json.loads(line) for line in (REPO / "examples" / "weather_tasks.jsonl").read_text().splitlines()]
        yield model_dir, records
    finally:
        sys.path.remove(str(REPO / "examples"))


def run_agents(tmp_path, entry, records, *, group_size=1, max_inflight=16, max_new_tokens=8, seq_len=2048,
               timeout_s=None, model_dir=None, deadline_s=120.0, **kwargs):
    """Every task of the file once (train and eval splits both), `group_size` trajectories each; returns the sink,
    the runner's stats line and the env's counts."""
    import outside_agents

    outside_agents.SEEN.clear()
    outside_agents.WAITING.update(now=0, peak=0)
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    settings = {"entry": entry, "tasks": str(path), **kwargs}
    if timeout_s is not None:
        settings["timeout_s"] = timeout_s
    factory = load_factory("agent", settings)
    model_dir = model_dir or _byte_model_dir()
    tokenizer = load_tokenizer(model_dir)
    sink = Records()
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=[tokenizer.eos_token_id])
    runner = EpisodeRunner("agent", factory, TorchEngine(model_dir, seed=0), tokenizer, params, seq_len, sink,
                           max_inflight, step_timeout_s=timeout_s or 60.0, judge_timeout_s=60.0)
    tasks = factory.tasks("train") + factory.tasks("eval")
    pending = list(enumerate(tasks))
    deadline = time.monotonic() + deadline_s
    try:
        while pending or not runner.idle():
            assert time.monotonic() < deadline, "the trajectories did not end"
            while pending and runner.room_for(group_size):
                n, task = pending.pop(0)
                runner.start_group(f"g{n}", task, group_size)
            runner.pump(0.05)
        return sink, runner.take_stats(), factory.metrics(), tokenizer
    finally:
        runner.close()
        factory.close()


def test_completions_are_stages_token_for_token_and_rewards_attach_to_the_latest(tmp_path):
    import outside_agents

    records = [{"id": f"q{i}", "question": f"question number {i}"} for i in range(3)]
    sink, stats, counts, tokenizer = run_agents(tmp_path, "outside_agents:two_turns", records)
    template = ChatTemplate(tokenizer)
    assert len(sink.outcomes) == 3 and all(reason == "" for _, reason in sink.outcomes.values())
    for trajectory, stages in sink.stages.items():
        task = sink.tasks[trajectory].data
        seen = outside_agents.SEEN[task["id"]]
        assert len(stages) == 2 and sink.rewards[trajectory] == [0.25, 0.0]  # the reward went to completion 0
        first = template.render([{"role": "user", "content": task["question"]}], [], True)
        assert tokenizer.decode(stages[0][0]) == first  # the first request, rendered whole
        # after the model's answer only the new message is rendered: the answer is its sampled tokens, never
        # decoded and encoded again (the tokens a re-encoding would give differ: <eos> is dropped by the decode)
        assert tokenizer.decode(stages[1][0]) == "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
        assert seen["contents"] == [tokenizer.decode(act, skip_special_tokens=True) for _, act in stages]
        assert seen["prompt_tokens"] == [len(stages[0][0]), len(stages[0][0]) + len(stages[0][1]) + len(stages[1][0])]
        judgement, _ = sink.outcomes[trajectory]
        assert judgement.score == 1.0 and judgement.success and judgement.info == {"turns": 2.0}
    assert any(template.encode(tokenizer.decode(act, skip_special_tokens=True)) != act
               for stages in sink.stages.values() for _, act in stages)
    assert counts["agent_completions"] == 6 and counts["agent_rewards"] == 3 and counts["agent_errors"] == 0
    assert stats["trajectories_finished"] == 3


def test_a_history_the_agent_edited_is_refused_and_the_trajectory_goes_on(tmp_path):
    sink, _, counts, _ = run_agents(tmp_path, "outside_agents:edits_history",
                                    [{"id": "e0", "question": "one"}, {"id": "e1", "question": "two"}])
    assert [j.score for j, _ in sink.outcomes.values()] == [1.0, 1.0]
    assert all(len(stages) == 2 for stages in sink.stages.values())
    assert counts["agent_history_edits"] == 4 and counts["agent_completions"] == 4


def test_an_agent_that_raises_hangs_blocks_or_never_calls_loses_only_its_own_trajectory(tmp_path):
    modes = ["ok", "raise", "hang", "block", "silent", "ok"]
    records = [{"id": f"f{i}", "question": f"q{i}", "mode": mode} for i, mode in enumerate(modes)]
    started = time.monotonic()
    sink, stats, counts, _ = run_agents(tmp_path, "outside_agents:fails", records, timeout_s=2.0)
    assert time.monotonic() - started < 60
    reasons = {sink.tasks[t].data["mode"] + sink.tasks[t].id: reason for t, (_, reason) in sink.outcomes.items()}
    assert reasons["okf0"] == reasons["okf5"] == ""  # the others finish, a blocked thread beside them
    assert "the agent raised ValueError: the agent's own bug" in reasons["raisef1"]
    for hung in ("hangf2", "blockf3"):
        assert reasons[hung].startswith("timeout: env 'agent' step did not return within 2 s"), reasons
    assert "without calling the model" in reasons["silentf4"]
    assert counts["agent_errors"] == 1 and counts["agent_timeouts"] == 2 and counts["agent_no_model_call"] == 1
    assert stats["trajectories_abandoned"] == 4 and stats["trajectories_finished"] == 2


@pytest.mark.slow
def test_64_agents_at_once_each_get_only_their_own_completions(tmp_path):
    import outside_agents

    records = [{"id": f"c{i}", "question": f"task {i} of 64: {'x' * (i % 7)}"} for i in range(64)]
    sink, _, counts, tokenizer = run_agents(tmp_path, "outside_agents:two_turns", records, max_inflight=64,
                                            deadline_s=240.0)
    assert len(sink.outcomes) == 64 and all(reason == "" for _, reason in sink.outcomes.values())
    assert outside_agents.WAITING["peak"] >= 32  # most of them waiting on the endpoint together
    texts = set()
    for trajectory, stages in sink.stages.items():
        task = sink.tasks[trajectory].data
        assert task["question"] in tokenizer.decode(stages[0][0])  # its own task's prompt
        contents = [tokenizer.decode(act, skip_special_tokens=True) for _, act in stages]
        assert outside_agents.SEEN[task["id"]]["contents"] == contents  # what it got is what its trajectory sampled
        texts.update(contents)
    assert len(texts) > 100  # random bytes: a mix-up between two agents could not go unseen
    assert counts["agent_completions"] == 128 and counts["agent_errors"] == 0


def test_the_endpoint_speaks_openai_models_errors_streaming_and_bearer_keys(tmp_path):
    import outside_agents

    sink, _, counts, tokenizer = run_agents(tmp_path, "outside_agents:protocol",
                                            [{"id": "p0", "question": "hello"}, {"id": "p1", "question": "hi"}])
    assert [r for _, r in sink.outcomes.values()] == ["", ""], sink.outcomes
    for trajectory, stages in sink.stages.items():
        contents = [tokenizer.decode(act, skip_special_tokens=True) for _, act in stages]
        assert outside_agents.SEEN[sink.tasks[trajectory].id]["contents"] == contents
        assert sink.rewards[trajectory] == [0.0, 0.5]
    assert counts["agent_bad_requests"] == 2  # n=2, twice


def test_a_synchronous_agent_gets_a_synchronous_client(tmp_path):
    sink, _, counts, _ = run_agents(tmp_path, "outside_agents:sync_agent",
                                    [{"id": "s0", "question": "a"}, {"id": "s1", "question": "b"}])
    assert [(j.score, j.success) for j, _ in sink.outcomes.values()] == [(0.5, False)] * 2
    assert all(rewards == [0.75] for rewards in sink.rewards.values())


@pytest.mark.slow
def test_the_example_agents_tool_calls_and_rewards_reach_the_trajectory(tmp_path):
    """examples/weather_agent.py on the word-level tiny model its VOCABULARY builds: each completion's tool calls
    come back in the OpenAI shape, and the agent's `async_rl.reward` for each right look-up is that stage's reward."""
    with weather_example(tmp_path) as (model_dir, records):
        sink, stats, counts, tokenizer = run_agents(tmp_path, "weather_agent:run", records, group_size=2,
                                                    max_new_tokens=48, seq_len=256, model_dir=model_dir)
    assert counts["agent_tool_calls"] > 0 and counts["agent_rewards"] > 0
    for trajectory, stages in sink.stages.items():
        city = sink.tasks[trajectory].data["city"]
        right = '<tool_call>{"name":"weather","arguments":{"city":"' + city + '"}}</tool_call>'
        for (_, action), reward in zip(stages, sink.rewards[trajectory], strict=True):
            calls = tokenizer.decode(action).split().count(right)
            assert math.isclose(reward, 0.1 * calls), (tokenizer.decode(action), reward)
    assert counts["agent_completions"] == sum(len(s) for s in sink.stages.values()) + stats["trajectories_abandoned"]


# --- README's command, as printed, through real processes -----------------------------------------------------------


def readme_agent_command() -> str:
    """README's "Your agent as it is" command, as printed."""
    section = (REPO / "README.md").read_text().split("## Your agent as it is", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0].strip()
    assert "\n" not in block, block
    return block


@pytest.mark.slow
def test_the_readme_agent_trains_through_real_processes_as_printed(tmp_path):
    """The command as printed, in a user's directory holding a copy of examples/: replay, learner and a worker
    whose endpoint serves the agent; its completions arrive as stages, its rewards as stage rewards, the ledger
    holds, and the worker's metrics count completions, tool calls and agent errors."""
    from project_commands import project_command

    shutil.copytree(REPO / "examples", tmp_path / "examples")
    command = readme_agent_command()
    assert command.startswith("PYTHONPATH=examples async-rl train env.name=agent "), command
    env = dict(os.environ, PATH=f"{Path(project_command()).parent}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "local"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["run_dir"] == str(run_dir) and result["stop_reason"] == "max_versions"
    learner = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert learner and all(m["ledger_residual_max"] < 1e-6 for m in learner)
    assert max(m["stage_reward_mean"] for m in learner) > 0  # async_rl.reward calls, trained as stage rewards
    assert sum(m["items_immediate"] + m["items_correction"] for m in learner) > 0
    worker = [json.loads(line) for line in (run_dir / "metrics" / "rollout-0.jsonl").read_text().splitlines()]
    last = worker[-1]
    assert last["agent_completions"] > 0 and last["agent_tool_calls"] > 0 and last["agent_rewards"] > 0
    assert "agent_errors" in last and "agent_timeouts" in last and "agent_no_model_call" in last
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0 < summary["env_steps"] <= last["agent_completions"]  # each completion whose turn ended is a stage


@pytest.mark.slow
def test_an_openai_agents_sdk_agent_trains_as_it_is(tmp_path):
    """The OpenAI Agents SDK (`openai-agents`, in the test extra, so CI runs this) on the example's task, its
    model the SDK's chat-completions model on the trajectory's client: its requests extend the trajectory (no
    history edit, no bad request), its tool calls come back parsed, its rewards land on the stages."""
    with weather_example(tmp_path) as (model_dir, records):
        sink, stats, counts, _ = run_agents(tmp_path, "outside_agents:agents_sdk", records, group_size=2,
                                            max_new_tokens=48, seq_len=512, model_dir=model_dir)
    assert stats["trajectories_abandoned"] == 0, sink.outcomes
    assert counts["agent_history_edits"] == 0 and counts["agent_bad_requests"] == 0 and counts["agent_errors"] == 0
    assert counts["agent_tool_calls"] > 0 and counts["agent_rewards"] > 0
    assert counts["agent_completions"] == sum(len(s) for s in sink.stages.values())
    assert math.isclose(sum(sum(r) for r in sink.rewards.values()), 0.1 * counts["agent_rewards"])
