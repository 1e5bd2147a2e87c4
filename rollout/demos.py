"""Demonstrations from an environment (`async-rl demos`): solved episodes of the train split, as OpenAI chat
conversations for `async-rl sft` (docs/models.md, "Warm start").

An env factory that can solve its own tasks has the optional member `demonstration(task) -> list[dict] | None`:
the assistant turns (OpenAI chat messages, `tool_calls` included) that solve `task`, or None to skip it. Each
episode is then played through the env itself: `reset` gives the user turn, every assistant turn goes to `step`
(an `Action` with its calls for an env with tools), the env's answers become `tool` (or `user`) messages, and
`judge` must call it a success; only then is the conversation written, one JSON object a line:
`{"messages": [...], "tools": [...]}`. Only the train split is ever read: no held-out task leaks into a warm start.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

from async_rl.config import Config
from async_rl.env_types import Action, Task, ToolCall, ToolResult
from rollout.envs.base import (
    EnvError,
    EnvFactory,
    checked_judge,
    checked_make,
    checked_reset,
    checked_step,
    checked_tasks,
    close_factory,
    env_call,
    has_own,
    load_factory,
    optional,
    tools_of,
)

log = logging.getLogger("async_rl.rollout")


def _action(turn: dict[str, Any], tools: list[dict] | None) -> str | Action:
    """The assistant turn as the env's `step` takes it: its text, and its calls for an env with tools."""
    text = turn.get("content") or ""
    if tools is None:
        return text
    calls = []
    for number, call in enumerate(turn.get("tool_calls") or []):
        function = call["function"]
        arguments = function.get("arguments") or "{}"
        calls.append(ToolCall(function["name"], json.loads(arguments) if isinstance(arguments, str) else arguments,
                              call.get("id") or f"call_{number}"))
        call["id"] = calls[-1].id
    return Action(text, calls)


def _observation_messages(observation: str | list[ToolResult] | None) -> list[dict[str, Any]]:
    if not observation:
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    return [{"role": "tool", "content": r.content, "name": r.name, "tool_call_id": r.call_id} for r in observation]


def play(env_name: str, factory: EnvFactory, task: Task) -> dict[str, Any] | None:
    """`task`'s demonstration played through a fresh env: the conversation, or None when the env gives none for
    it or the episode does not end judged a success."""
    turns = env_call(env_name, "demonstration", optional(factory, "demonstration"), task)
    if turns is None:
        return None
    env = checked_make(env_name, factory)
    try:
        messages: list[dict[str, Any]] = [{"role": "user", "content": checked_reset(env_name, env, task)}]
        tools = tools_of(env_name, env)
        done = False
        for turn in turns:
            turn = {**turn, "tool_calls": [dict(c) for c in turn.get("tool_calls") or []]}
            result = checked_step(env_name, env, _action(turn, tools))
            messages.append({k: v for k, v in turn.items() if v or k == "content"})
            messages.extend(_observation_messages(result.observation))
            if result.done:
                done = True
                break
        if not done or not checked_judge(env_name, env).success:
            return None
        return {"messages": messages, "tools": tools or []}
    finally:
        close = optional(env, "close")
        if callable(close):
            close()


def write_demonstrations(config: Config, out: Path, n: int) -> dict[str, int]:
    """Up to `n` solved train episodes into `out` (JSONL), the tasks in a seeded order (each once before any
    twice); returns the counts written and skipped. Refuses an env without `demonstration`."""
    factory = load_factory(config.env.name, config.env.kwargs)
    if not has_own(factory, "demonstration"):
        raise EnvError(f"env {config.env.name!r} has no demonstration(task) member: it cannot write its own "
                       "demonstrations (write them as OpenAI chat JSONL yourself: docs/models.md, 'Warm start')")
    try:
        return _write(config.env.name, config.run.seed, factory, out, n)
    finally:
        close_factory(config.env.name, factory)  # a factory's temporary files or servers (the swe env's copies)


def _write(env_name: str, seed: int, factory: EnvFactory, out: Path, n: int) -> dict[str, int]:
    tasks = checked_tasks(env_name, factory, "train")
    random.Random(seed).shuffle(tasks)
    written = skipped = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for index in range(len(tasks) * max(1, -(-n // len(tasks)))):
            if written >= n:
                break
            conversation = play(env_name, factory, tasks[index % len(tasks)])
            if conversation is None:
                skipped += 1
                continue
            f.write(json.dumps(conversation) + "\n")
            written += 1
    log.info("wrote %d demonstration(s) to %s (%d task(s) skipped)", written, out, skipped)
    return {"written": written, "skipped": skipped}
