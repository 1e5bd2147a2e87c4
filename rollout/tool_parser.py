"""Tool calls parsed out of a turn's text (`rollout.tool_parser`): the model's text in, an `Action` out.

`hermes`: the calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the text, as
Qwen2.5 and Hermes models emit them (whitespace around the JSON allowed; `arguments` may be a JSON object or a
string holding one, and may be left out for a tool without parameters). `none`: no parsing, every turn is an
`Action` with no calls. Only envs with `tools()` get an `Action`; the others get the text as before.

A call that does not parse is never an exception: the block is left out of `tool_calls` and `parse_error` says
why (malformed JSON, no name, a name the env has no tool for, arguments that are not an object, a `<tool_call>`
never closed); with several blocks the ones that parsed are still there. Calls are numbered "call_0", "call_1",
... in the order they appear (hermes has no ids).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection

from async_rl.env_types import Action, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def parse_hermes(text: str, tool_names: Collection[str]) -> tuple[Action, int]:
    """The action of `text` and how many call blocks did not parse."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    end = 0
    for match in _BLOCK.finditer(text):
        end = match.end()
        call, error = _one_call(match.group(1), tool_names, len(calls))
        if call is not None:
            calls.append(call)
        else:
            errors.append(f"tool call {len(calls) + len(errors) + 1}: {error}")
    if OPEN in text[end:]:  # opened and never closed: the turn ended (a budget, a stop) inside it
        errors.append(f"tool call {len(calls) + len(errors) + 1}: {OPEN} without {CLOSE}")
    return Action(text=text, tool_calls=calls, parse_error="; ".join(errors) or None), len(errors)


def _one_call(body: str, tool_names: Collection[str], index: int) -> tuple[ToolCall | None, str]:
    try:
        parsed = json.loads(body)
    except ValueError as exc:
        return None, f"malformed JSON ({exc.args[0] if exc.args else exc}): {body.strip()[:80]!r}"
    if not isinstance(parsed, dict):
        return None, f"expected a JSON object with name and arguments, got {type(parsed).__name__}"
    name = parsed.get("name")
    if not isinstance(name, str) or not name:
        return None, "no tool name (expected {\"name\": ..., \"arguments\": {...}})"
    if name not in tool_names:
        known = ", ".join(sorted(tool_names)) or "none"
        return None, f"unknown tool {name!r} (tools: {known})"
    arguments = parsed.get("arguments", {})
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None, f"the arguments of {name!r} are a string that is not JSON: {arguments[:80]!r}"
    if not isinstance(arguments, dict):
        return None, f"the arguments of {name!r} must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(name=name, arguments=arguments, id=f"call_{index}"), ""


def parse_none(text: str, tool_names: Collection[str]) -> tuple[Action, int]:
    return Action(text=text, tool_calls=[]), 0


PARSERS: dict[str, Callable[[str, Collection[str]], tuple[Action, int]]] = {"hermes": parse_hermes, "none": parse_none}


def get_parser(name: str) -> Callable[[str, Collection[str]], tuple[Action, int]]:
    if name not in PARSERS:
        raise ValueError(f"rollout.tool_parser: expected one of {', '.join(PARSERS)}, got {name!r}")
    return PARSERS[name]


def tool_names(tools: list[dict]) -> list[str]:
    """The function names of OpenAI-style specs (checked by rollout/envs/base.py's `tools_of`)."""
    return [spec["function"]["name"] for spec in tools]
