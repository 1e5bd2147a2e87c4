"""Text to tokens for the context: what the environment adds (observations, tool specs, tool results), never the
model's own tokens.

A plain tokenizer gets the text as it is. A tokenizer with a chat template gets the first observation as a user
turn (and the assistant's opening), each later observation as the template's text for one more turn after the
assistant's: a user turn for a str, `tool` messages for a list of `ToolResult`. An env with tools has its specs
rendered in the first turn through the template (`apply_chat_template(..., tools=...)`); where the tokenizer has no
chat template, or its template ignores `tools`, the specs go into the first observation as plain text instead
(`tools_text`), and tool results are `<tool_response>` blocks (`results_text`).
"""

from __future__ import annotations

import json
from typing import Any

from transformers import PreTrainedTokenizerBase

from async_rl.env_types import ToolResult

# The plain-text form of tool specs, for a tokenizer whose template cannot show them (Hermes-style, like the
# ChatML tools template async-rl ships): put before the first observation.
TOOLS_HEADER = (
    "You may call one or more functions to assist with the user query. The function signatures are within "
    "<tools></tools> XML tags:\n<tools>\n"
)
TOOLS_FOOTER = (
    "</tools>\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>\n\n"
)


def tools_text(tools: list[dict]) -> str:
    return TOOLS_HEADER + "".join(json.dumps(spec) + "\n" for spec in tools) + TOOLS_FOOTER


def results_text(results: list[ToolResult]) -> str:
    return "".join(f"<tool_response>\n{r.content}\n</tool_response>\n" for r in results)


def tool_messages(results: list[ToolResult]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for r in results:
        message: dict[str, Any] = {"role": "tool", "content": r.content}
        if r.name:
            message["name"] = r.name
        if r.call_id:
            message["tool_call_id"] = r.call_id
        messages.append(message)
    return messages

CACHED_TEXTS = 4096  # distinct texts kept
CACHED_TEXT_CHARS = 4096  # longer texts (files, test logs) are rarely repeated: not kept


class Prompter:
    """Text to tokens for the context: plain for a plain tokenizer, the chat template's turns when it has one."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self._encoded: dict[tuple[str, bool], tuple[int, ...]] = {}  # text -> tokens, the oldest dropped first

    def first(self, text: str, tools: list[dict] | None = None) -> list[int]:
        """The first observation; with `tools` (non-empty), their specs through the template or as plain text."""
        if self.chat:
            messages = [{"role": "user", "content": text}]
            if tools:
                rendered = self._render(messages, tools=tools)
                if rendered is not None and all(spec["function"]["name"] in rendered for spec in tools):
                    return self._tokens(rendered)
                messages = [{"role": "user", "content": tools_text(tools) + text}]  # the template ignores tools
            return self._template(messages)
        if tools:
            text = tools_text(tools) + text
        return self._encode(text, special=True)  # special tokens (BOS) only here

    def next(self, observation: str | list[ToolResult]) -> list[int]:
        """The observation after an action: a user turn (str) or tool messages (a list of ToolResult), with the
        assistant's opening, under a chat template; the text as it is without one."""
        if not observation:
            return []
        if not self.chat:
            text = observation if isinstance(observation, str) else results_text(observation)
            return self._encode(text)
        if isinstance(observation, str):
            turn = [{"role": "user", "content": observation}]
        else:
            turn = tool_messages(observation)
        delta = self._delta(turn)
        if delta is None and not isinstance(observation, str):  # a template that cannot show tool messages
            delta = self._delta([{"role": "user", "content": results_text(observation)}])
            turn = [{"role": "user", "content": results_text(observation)}]
        if delta is None:  # a template that rewrites earlier turns: render the turn alone
            return self._template(turn)
        return self._tokens(delta)

    def _delta(self, turn: list[dict[str, Any]]) -> str | None:
        """The template's text for `turn` after an assistant's turn: render a short conversation with and without
        it (None when the template raises or rewrites what came before)."""
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        before = self._render(base, add_generation_prompt=False)
        after = self._render([*base, *turn])
        if before is None or after is None or not after.startswith(before):
            return None
        return after[len(before) :]

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str | None:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception:
            return None

    def _template(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self._tokens(text)

    def _tokens(self, text: str) -> list[int]:
        return self._encode(text)

    def _encode(self, text: str, special: bool = False) -> list[int]:
        """The tokenizer's ids for `text`, from a bounded cache (environments repeat their observations: the
        tokenizer call was a fifth of the worker loop's time on the trap task)."""
        key = (text, special)
        ids = self._encoded.get(key)
        if ids is None:
            ids = tuple(self.tokenizer(text, add_special_tokens=special)["input_ids"])
            if len(text) <= CACHED_TEXT_CHARS:
                if len(self._encoded) >= CACHED_TEXTS:
                    del self._encoded[next(iter(self._encoded))]
                self._encoded[key] = ids
        return list(ids)


def blinded(observation: str | list[ToolResult] | None, blind: str) -> str | list[ToolResult]:
    """What `blind` evaluation shows instead of a tool's answer: `blind` for a text, each result's content
    replaced by it for a list of ToolResult."""
    if isinstance(observation, list):
        return [ToolResult(blind, r.name, r.call_id) for r in observation]
    return blind
