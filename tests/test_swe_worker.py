"""env.name=swe through the rollout worker's episode runner (rollout/runner.py) with a scripted policy standing in for
the model (named as such: it writes the tool calls a model would), the byte tokenizer and the ChatML tools template:
stage rewards come from run_tests, the outcome from the judge. And `async-rl demos` on swe: the gold fix played
through the env's own tools."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from test_swe_env import task_file  # noqa: F401 - the hand-written SWE-bench task file, a fixture

from async_rl.hf_io import TOOLS_TEMPLATE
from async_rl.model import byte_tokenizer
from rollout.envs.base import Task, load_factory

SCRIPT = [
    {"name": "run_tests", "arguments": {}},
    {"name": "str_replace", "arguments": {"path": "stats/core.py", "old_str": "(len(values) + 1)",
                                          "new_str": "len(values)"}},
    {"name": "run_tests", "arguments": {}},
    {"name": "submit", "arguments": {}},
]


class ScriptedPolicy:
    """A stand-in for the model (named as such): turn k (k tool results in its context so far) calls SCRIPT[k]."""

    version, weights_refused = 0, 0

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def generate(self, prompts, params):
        from rollout.engines import Generation

        out = []
        for prompt in prompts:
            turn = self.tokenizer.decode(prompt).count("<tool_response>")
            text = f"<tool_call>{json.dumps(SCRIPT[min(turn, len(SCRIPT) - 1)])}</tool_call>"
            tokens = self.tokenizer.encode(text, add_special_tokens=False)
            out.append(Generation(tokens, [-1.0] * len(tokens), [0] * len(tokens), "stop"))
        return out

    def update_weights(self, version, path):
        pass

    def close(self):
        pass


class Sink:
    def __init__(self):
        self.stages, self.outcomes = [], []

    def stage(self, episode, generation, reward, terminal):
        self.stages.append((episode.trajectory_id, reward, terminal))

    def outcome(self, episode, judgement, reason):
        self.outcomes.append((episode.trajectory_id, judgement, reason))


def run_scripted_group(tasks: Path, members: int, seconds: float) -> Sink:
    """The scripted policy's group of `members` episodes on the file's one train task, through the episode runner
    on the byte tokenizer with the shipped tools template; returns what reached the sink."""
    from rollout.engines import SamplingParams
    from rollout.runner import EpisodeRunner

    factory = load_factory("swe", {"tasks": str(tasks), "eval_fraction": 0.0, "max_turns": 6})
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = '{%- set default_system = "" %}\n' + TOOLS_TEMPLATE.read_text()
    params = SamplingParams(max_new_tokens=512, stop_token_ids=[tokenizer.eos_token_id])
    sink = Sink()
    runner = EpisodeRunner("swe", factory, ScriptedPolicy(tokenizer), tokenizer, params, 32768, sink, 4)
    try:
        (task,) = factory.tasks("train")
        runner.start_group("g0", Task(task.id, task.data), members)
        deadline = time.monotonic() + seconds
        while not runner.idle():
            assert time.monotonic() < deadline, "the episodes did not finish"
            runner.pump(0.05)
        assert runner.env_errors == 0
    finally:
        runner.close()
        factory.close()
    return sink


def test_a_scripted_episode_through_the_runner_pays_stage_rewards_and_the_judges_outcome(task_file):  # noqa: F811
    sink = run_scripted_group(task_file, 2, 240)
    assert len(sink.outcomes) == 2
    for trajectory, judgement, reason in sink.outcomes:
        rewards = [reward for t, reward, _ in sink.stages if t == trajectory]
        assert rewards == [pytest.approx(0.5), 0.0, 1.0, 0.0], rewards  # run_tests: 1 of 2, the fix, 2 of 2, submit
        assert [terminal for t, _, terminal in sink.stages if t == trajectory] == [False, False, False, True]
        assert reason == "" and judgement.success and judgement.score == 1.0
        assert judgement.info["tests_run"] == 2 and judgement.info["tool_errors"] == 0


def test_demos_write_the_gold_fix_through_the_envs_tools(task_file, tmp_path):  # noqa: F811
    from async_rl.config import Config, EnvConfig
    from rollout.demos import write_demonstrations

    out = tmp_path / "demos.jsonl"
    config = Config(env=EnvConfig(name="swe", kwargs={"tasks": str(task_file), "eval_fraction": 0.0}))
    assert write_demonstrations(config, out, 1) == {"written": 1, "skipped": 0}
    (demo,) = [json.loads(line) for line in out.read_text().splitlines()]
    calls = [m["tool_calls"][0]["function"]["name"] for m in demo["messages"] if m["role"] == "assistant"]
    assert calls == ["read_file", "str_replace", "run_tests", "submit"]
    results = [m["content"] for m in demo["messages"] if m["role"] == "tool"]
    assert "Replaced 1 occurrence" in results[1] and results[2].startswith("2/2 passed")
    assert [t["function"]["name"] for t in demo["tools"]][-1] == "submit"
