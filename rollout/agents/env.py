"""`env.name=agent`, its factory: train an agent you already have, written against the OpenAI client, as it is
(docs/environments.md, "Your agent as it is").

    env.name=agent env.kwargs.entry=MODULE:FUNCTION env.kwargs.tasks=FILE.jsonl [env.kwargs.judge=MODULE:FUNCTION]

    async def FUNCTION(task: dict, client: openai.AsyncOpenAI, model: str) -> float | dict

Each trajectory runs FUNCTION once, on a thread of its own, with one line of the tasks file (a JSON object, given as
it is) and a client whose base URL is the trajectory's own on the worker's OpenAI-compatible endpoint
(rollout/agents/endpoint.py). Every chat completion the agent asks for is one stage: the episode runner generates it
with the worker's engine like any env's action (rollout/runner.py, a token-level env: rollout/envs/base.py), the
endpoint returns it with its tool calls parsed (rollout/agents/chat_api.py), and its tokens, log-probs and policy
versions go to the replay when the agent's next request (or its return) ends the stage. `await
async_rl.reward(client, x)` adds x to the stage reward of the latest completion. What FUNCTION returns is the
outcome: a number (success when >= 1) or {"reward": r, "success": bool, <other numbers>: averaged by evaluation};
with `env.kwargs.judge` the slow judge `JUDGE(task, returned)` (sync or async) makes the outcome of whatever the
agent returned.

A synchronous FUNCTION (smolagents, a plain loop) gets an `openai.OpenAI` client instead and runs as it is.

Failures cost the trajectory only, each counted on the rollout metrics line: an agent that raises (agent_errors),
returns without calling the model (agent_no_model_call), or works longer than `env.kwargs.timeout_s` between two
model calls (agent_timeouts: the runner's step time limit, rollout.step_timeout_s when set); a request that is
malformed (agent_bad_requests) or does not extend the trajectory's history (agent_history_edits) is answered 400
and the agent may go on. A trajectory whose context reaches model.max_seq_len has its pending request answered
400 `context_length_exceeded` and is judged on what the agent returns.

This file is the factory side: the settings, the tasks file and its train/eval split, the user's agent and judge
loaded, and what the trajectories share (the endpoint, the runner's tokenizer and limits, the counts). Each
trajectory, the bridge between its agent's thread and the runner, is an AgentEnv (rollout/agents/trajectory.py).
"""

from __future__ import annotations

import importlib.util
import inspect
import random
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from async_rl.env_types import Task
from rollout.agents.chat_api import ChatTemplate
from rollout.agents.endpoint import ChatEndpoint
from rollout.agents.trajectory import ENV, AgentEnv
from rollout.envs.base import EnvError, load_callable, settings_from_kwargs
from rollout.envs.task_file import read_task_file

DEFAULT_TIMEOUT_S = 300.0


class AgentSettings(msgspec.Struct, forbid_unknown_fields=True):
    entry: str  # MODULE:FUNCTION, the agent: async def FUNCTION(task: dict, client, model: str) -> float | dict
    tasks: str  # a JSONL file, one JSON object per task (optional "id"; optional "split": "train" or "eval")
    judge: str | None = None  # MODULE:FUNCTION, the slow judge: JUDGE(task: dict, returned) -> float | dict
    eval_fraction: float = 0.2  # the share of the tasks without a "split" held out for evaluation
    seed: int = 0  # the split's shuffle
    timeout_s: float = DEFAULT_TIMEOUT_S  # the longest an agent may work before its first model call, between two,
    #                                       and after its last until it returns (rollout.step_timeout_s when set)
    model: str = "policy"  # the model name the agent is given and /v1/models lists (requests may name any)

    def __post_init__(self) -> None:
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"eval_fraction: expected 0 < f < 1, got {self.eval_fraction}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: expected > 0, got {self.timeout_s}")


def _record_task(record: dict, number: int) -> Task:
    split = record.get("split")
    if split not in (None, "train", "eval"):
        raise ValueError(f'split: expected "train" or "eval", got {split!r}')
    return Task(id=str(record.get("id", f"line{number}")), data=record)


class AgentFactory:
    """The tasks file's split, the user's agent and judge, the worker's endpoint and the counts of what agents did."""

    name = ENV  # the env.name its errors give

    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        if importlib.util.find_spec("openai") is None:
            raise EnvError("env.name=agent: the agents' client is openai's, which is not installed "
                           "(pip install 'async-rl[agent]')")
        self.entry = load_callable(settings.entry, "env.kwargs.entry")
        self.judge_fn = load_callable(settings.judge, "env.kwargs.judge") if settings.judge else None
        self.step_timeout_s = settings.timeout_s  # the runner's step limit (rollout.step_timeout_s overrides it)
        words = getattr(inspect.getmodule(self.entry), "VOCABULARY", None)
        if words is not None:  # the tiny built-in model's words (ignored with model.path): one token each
            self.vocabulary = lambda: list(words)
        if not Path(settings.tasks).is_file():
            raise EnvError(f"env.kwargs.tasks: no such file: {settings.tasks}")
        self.serve(read_task_file(settings.tasks, _record_task, setting="env.kwargs.tasks"),
                   f"env.kwargs.tasks: {settings.tasks}")

    def serve(self, tasks: list[Task], source: str) -> None:
        """The tasks' train/eval split (`source` names them in an error) and the state the trajectories share: the
        end of __init__, and of a subclass's that has its tasks and agent from elsewhere (agents/verifiers_env.py)."""
        self.splits = self._split(tasks, source)
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.endpoint: ChatEndpoint | None = None
        self.template: ChatTemplate | None = None
        self.tokenizer: Any = None
        self.parse: Any = None
        self.stop: list[str] = []

    def _split(self, tasks: list[Task], source: str) -> dict[str, list[Task]]:
        fixed = {s: [t for t in tasks if t.data.get("split") == s] for s in ("train", "eval")}
        free = [t for t in tasks if t.data.get("split") is None]
        random.Random(self.settings.seed).shuffle(free)
        n_eval = round(len(free) * self.settings.eval_fraction)
        if not fixed["eval"] and free:
            n_eval = max(1, n_eval)
        if len(free) - n_eval < 1 and not fixed["train"] and free:
            n_eval = len(free) - 1
        splits = {"eval": fixed["eval"] + free[:n_eval], "train": fixed["train"] + free[n_eval:]}
        for name, split in splits.items():
            if not split:
                raise EnvError(f"{source} leaves the {name} split empty "
                               f"({len(tasks)} task(s); a train and an eval split need one each)")
        return splits

    def tasks(self, split: str) -> list[Task]:
        if split not in self.splits:
            raise EnvError(f"env {ENV!r}: no split {split!r} (train, eval)")
        return list(self.splits[split])

    def make(self) -> AgentEnv:
        return AgentEnv(self)

    def bind(self, tokenizer: Any, parse_tools: Any, stop: list[str], step_timeout_s: float) -> None:
        """The episode runner's tokenizer, tool parser, stop strings and step limit (rollout/runner.py)."""
        with self.lock:
            if self.template is None or self.tokenizer is not tokenizer:
                self.tokenizer, self.template = tokenizer, ChatTemplate(tokenizer)
            self.parse, self.stop, self.step_timeout_s = parse_tools, list(stop), step_timeout_s

    def endpoint_for_trajectories(self) -> ChatEndpoint:
        with self.lock:
            if self.endpoint is None:  # started with the first trajectory, so a config check starts no server
                self.endpoint = ChatEndpoint(self.settings.model)
            return self.endpoint

    def decode(self, token_ids: list[int]) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        for stop in self.stop:  # the tokens may run past the stop string inside their last token
            at = text.find(stop)
            if at >= 0:
                text = text[: at + len(stop)]
        return text

    def count(self, what: str, n: int = 1) -> None:
        if n:
            with self.lock:
                self.counts[what] += n

    def metrics(self) -> dict[str, float]:
        """Counts since the worker started, for its metrics line (docs/metrics.md)."""
        keys = ("started", "returned", "completions", "tool_calls", "tool_call_errors", "rewards", "errors",
                "timeouts", "cancelled", "no_model_call", "history_edits", "bad_requests")
        with self.lock:
            return {f"agent_{key}": float(self.counts[key]) for key in keys}

    def close(self) -> None:
        with self.lock:
            endpoint, self.endpoint = self.endpoint, None
        if endpoint is not None:
            endpoint.close()


def factory(**kwargs: Any) -> AgentFactory:
    """`env.name=agent` with `env.kwargs` (AgentSettings)."""
    return AgentFactory(settings_from_kwargs(ENV, AgentSettings, kwargs))
