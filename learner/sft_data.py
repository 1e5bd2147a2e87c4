"""Demonstrations for the warm start (`async-rl sft`): a JSONL file of OpenAI chat conversations, checked line by
line, rendered with the model's own chat template into token ids and an assistant-only loss mask.

A line is `{"messages": [...], "tools": [...]}` (`tools` optional): roles `system`, `user`, `assistant`, `tool`;
an assistant message has `content` and/or `tool_calls: [{"type": "function", "function": {"name", "arguments"}}]`
(TRL's SFTTrainer format for tool-calling data). Rendering goes message by message, each message's text the
template's rendering of the conversation up to it minus the rendering before it, and each piece is tokenized on
its own: the context a rollout worker builds (rollout/prompting.py). An assistant piece is trained up to and
including the end-of-turn token (what the model emits before it stops); every system, user and tool token is
context only, and the template's text after an end-of-turn token is left out, as a rollout leaves it out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from async_rl.errors import AsyncRLError

ROLES = ("system", "user", "assistant", "tool")


class DemonstrationError(AsyncRLError):
    """A demonstrations file the warm start cannot take; the message names the file, the line and the field."""


@dataclass
class Demonstration:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    line: int


@dataclass
class Rendered:
    tokens: np.ndarray  # int32, the whole conversation
    mask: np.ndarray  # uint8, 1 on the assistant tokens trained
    line: int


def _check_tool_call(call: Any, where: str) -> None:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise DemonstrationError(f'{where}: expected {{"type": "function", "function": {{"name": ..., '
                                 '"arguments": ...}}')
    function = call["function"]
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise DemonstrationError(f"{where}.function.name: expected a non-empty string")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise DemonstrationError(f"{where}.function.arguments: not valid JSON: {arguments[:60]!r}") from None
    if not isinstance(arguments, dict):
        raise DemonstrationError(f"{where}.function.arguments: expected a JSON object (or a string holding one)")


def _check_message(message: Any, where: str) -> None:
    if not isinstance(message, dict):
        raise DemonstrationError(f"{where}: expected an object with role and content")
    role = message.get("role")
    if role not in ROLES:
        raise DemonstrationError(f"{where}.role: expected one of {', '.join(ROLES)}, got {role!r}")
    content, calls = message.get("content"), message.get("tool_calls")
    if content is not None and not isinstance(content, str):
        raise DemonstrationError(f"{where}.content: expected a string, got {type(content).__name__}")
    if calls is not None and role != "assistant":
        raise DemonstrationError(f"{where}.tool_calls: only an assistant message calls tools")
    if calls is not None and not isinstance(calls, list):
        raise DemonstrationError(f"{where}.tool_calls: expected a list")
    for number, call in enumerate(calls or []):
        _check_tool_call(call, f"{where}.tool_calls[{number}]")
    if not content and not calls and role != "assistant":
        raise DemonstrationError(f"{where}.content: expected a string (a {role} message says something)")


def parse_line(text: str, line: int, path: Path | str) -> Demonstration:
    """One line of a demonstrations file, or DemonstrationError naming the file, line and field."""
    where = f"{path} line {line}"
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise DemonstrationError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list) or not record["messages"]:
        raise DemonstrationError(f'{where}: expected {{"messages": [...], "tools": [...]}} with at least one message')
    for number, message in enumerate(record["messages"]):
        _check_message(message, f"{where}: messages[{number}]")
    if not any(m["role"] == "assistant" for m in record["messages"]):
        raise DemonstrationError(f"{where}: messages: no assistant message (nothing to train)")
    tools = record.get("tools") or []
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
        for t in tools
    ):
        raise DemonstrationError(f'{where}: tools: expected a list of {{"type": "function", "function": '
                                 '{"name": ...}} specs')
    return Demonstration(record["messages"], tools, line)


def read_demonstrations(path: Path | str) -> list[Demonstration]:
    """Every conversation of `path` (blank lines skipped); the first bad line stops it with its error."""
    path = Path(path)
    if not path.is_file():
        raise DemonstrationError(f"--data: no such file: {path}")
    with open(path, encoding="utf-8") as f:
        found = [parse_line(text, number, path) for number, text in enumerate(f, 1) if text.strip()]
    if not found:
        raise DemonstrationError(f"--data: {path} holds no conversation")
    return found


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict], generation: bool) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=generation)


def _normalised(message: dict[str, Any]) -> dict[str, Any]:
    """The message as templates expect it: content a string, tool-call arguments a JSON string."""
    message = {**message, "content": message.get("content") or ""}
    if message.get("tool_calls"):
        message["tool_calls"] = [
            {**call, "type": "function", "function": {
                **call["function"],
                "arguments": call["function"].get("arguments") if isinstance(call["function"].get("arguments"), str)
                else json.dumps(call["function"].get("arguments", {}))}}
            for call in message["tool_calls"]
        ]
    return message


def render(tokenizer: Any, demonstration: Demonstration) -> Rendered:
    """The conversation's tokens and loss mask (the module's docstring). Raises DemonstrationError when the
    template rewrites earlier turns as later ones are added (pieces would not add up to the conversation)."""
    messages = [_normalised(m) for m in demonstration.messages]
    eos = tokenizer.eos_token or ""
    tokens: list[int] = []
    mask: list[int] = []
    rendered = ""
    for index, message in enumerate(messages):
        is_assistant = message["role"] == "assistant"
        before = _render(tokenizer, messages[:index], demonstration.tools, generation=is_assistant)
        if is_assistant and not before.startswith(rendered):
            raise DemonstrationError(f"line {demonstration.line}: the chat template renders messages[{index}]'s "
                                     "generation prompt by rewriting the turns before it")
        if is_assistant:  # the generation prompt is context
            tokens += _ids(tokenizer, before[len(rendered):])
            mask += [0] * (len(tokens) - len(mask))
            rendered = before
        after = _render(tokenizer, messages[: index + 1], demonstration.tools, generation=False)
        if not after.startswith(rendered):
            raise DemonstrationError(f"line {demonstration.line}: the chat template renders messages[{index}] by "
                                     "rewriting the turns before it")
        piece = after[len(rendered):]
        if is_assistant:
            end = piece.rfind(eos) + len(eos) if eos and eos in piece else len(piece)
            emitted = _ids(tokenizer, piece[:end])
            tokens += emitted
            mask += [1] * len(emitted)
            # The template's text after the end of turn is in no rollout's context either: the model stops at its
            # end-of-turn token and the next observation's text follows it (rollout/prompting.py).
            rendered = after
            continue
        tokens += _ids(tokenizer, piece)  # context only: a system, user or tool turn
        mask += [0] * (len(tokens) - len(mask))
        rendered = after
    return Rendered(np.asarray(tokens, dtype=np.int32), np.asarray(mask, dtype=np.uint8), demonstration.line)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
