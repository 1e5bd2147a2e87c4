"""The OpenAI chat-completions shapes, token in and token out (`rollout.agents.chat_api`): a request's messages checked
and rendered with the model's chat template, a trajectory's next request checked against what it sent before, and the
model's sampled tokens turned into the assistant message an OpenAI client expects (tool calls parsed by
rollout/tool_parser.py). The HTTP side is rollout/agents/endpoint.py; the trajectory that uses these is
rollout/agents/trajectory.py.

Token in, token out. The first request of a trajectory is rendered whole (`ChatTemplate.render`, the template's
own tools section) and tokenized. A later request must extend the one before: the same tools, the same messages,
then the assistant message the endpoint returned (compared by its content and its tool calls' names and
arguments; ids and JSON spacing may differ), then new messages. Only the new messages are tokenized: the text the
template renders after the returned message (`delta`), appended after the tokens the model sampled, which are never
decoded and encoded again. A request that does not extend the trajectory (an agent that drops, rewrites or
reorders a message, edits the model's answer or changes its tools) is refused with `history_edited` naming the
first message that differs; so is a template that renders the earlier messages differently once more follow.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from async_rl.env_types import Action
from async_rl.hf_io import TOOLS_TEMPLATE, renders_tools, tools_chat_template

ROLES = ("system", "developer", "user", "assistant", "tool")
# A tokenizer without a chat template (the built-in tiny model's) renders with the ChatML template async-rl ships.
PLAIN_CHATML = '{%- set default_system = "" %}\n'


class ChatError(Exception):
    """A request the endpoint refuses (HTTP 400 unless `status` says): the message says what to change."""

    def __init__(self, message: str, code: str = "invalid_request_error", param: str | None = None,
                 status: int = 400) -> None:
        super().__init__(message)
        self.code, self.param, self.status = code, param, status

    def payload(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.code, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]  # normalised: role, content (str), tool_calls / tool_call_id / name where given
    tools: list[dict[str, Any]]  # OpenAI function specs as given ([] for none)
    parse_names: list[str]  # the tool names whose calls are parsed from the answer (tool_choice narrows them)
    max_new_tokens: int | None
    stream: bool


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text") \
                    and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatError(f"{where}: only text content is supported, got a {kind!r} part", param=where)
        return "".join(parts)
    raise ChatError(f"{where}: content must be a string or a list of text parts", param=where)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise ChatError(f"{where}.tool_calls must be a list", param=where)
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ChatError(f"{where}.tool_calls[{i}]: expected {{'type': 'function', 'function': {{'name', "
                            "'arguments'}}}", param=where)
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": name, "arguments": arguments}})
    return out


def normalise_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ChatError(f"{where}: expected an object with a role among {', '.join(ROLES)}", param=where)
        role = "system" if message["role"] == "developer" else message["role"]
        normal: dict[str, Any] = {"role": role, "content": _text(message.get("content"), where)}
        if role == "assistant" and message.get("tool_calls"):
            normal["tool_calls"] = _tool_calls(message["tool_calls"], where)
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if isinstance(message.get(key), str):
                    normal[key] = message[key]
        out.append(normal)
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ChatError("tools must be a list of function specs", param="tools")
    names = []
    for i, spec in enumerate(tools):
        function = spec.get("function") if isinstance(spec, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(spec, dict) or spec.get("type", "function") != "function" or not isinstance(name, str):
            raise ChatError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                            "...}}}", param="tools")
        names.append(name)
    if len(set(names)) != len(names):
        raise ChatError("tools: a tool name is given twice", param="tools")
    return [{"type": "function", "function": spec["function"]} for spec in tools]


def parse_request(body: Any, max_new_tokens: int | None = None) -> ChatRequest:
    """A chat-completions request body, checked. `temperature`, `top_p`, `seed`, `stop`, `logprobs` and the other
    sampling options are not honoured: the trajectory is sampled as `rollout.*` says (the policy being trained)."""
    if not isinstance(body, dict):
        raise ChatError("the request body must be a JSON object")
    if body.get("n", 1) != 1:
        raise ChatError("n: only one choice per request", param="n")
    messages = normalise_messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    names = [spec["function"]["name"] for spec in tools]
    choice = body.get("tool_choice", "auto")
    if choice in (None, "auto", "required"):
        parse_names = names
    elif choice == "none":
        parse_names = []
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict) \
            and choice["function"].get("name") in names:
        parse_names = [choice["function"]["name"]]
    else:
        raise ChatError(f"tool_choice: expected none, auto, required or a function of tools, got {choice!r}",
                        param="tool_choice")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ChatError(f"max_tokens: expected a positive integer, got {limit!r}", param="max_tokens")
    if limit is not None and max_new_tokens is not None:
        limit = min(limit, max_new_tokens)
    return ChatRequest(messages, tools, parse_names, limit, bool(body.get("stream", False)))


# --------------------------------------------------------------------------------------------------- the history
def _assistant_key(message: dict[str, Any]) -> tuple[str, list[tuple[str, Any]]]:
    calls = []
    for call in message.get("tool_calls", []):
        arguments = call["function"]["arguments"]
        with contextlib.suppress(ValueError):  # not JSON: compared as the string it is
            arguments = json.loads(arguments) if arguments.strip() else {}
        calls.append((call["function"]["name"], arguments))
    return message.get("content", "").strip(), calls


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["role"] == "assistant" and b["role"] == "assistant":
        return _assistant_key(a) == _assistant_key(b)
    return a == b


def first_difference(sent: list[dict[str, Any]], returned: dict[str, Any], tools: list[dict[str, Any]],
                     request: ChatRequest) -> str | None:
    """Why `request` does not extend a trajectory that sent `sent` with `tools` and got `returned`; None when it
    does."""
    if request.tools != tools:
        return "its tools differ from the trajectory's (they are part of the rendered prompt)"
    messages = request.messages
    for i, message in enumerate(sent):
        if i >= len(messages):
            return f"it has {len(messages)} messages, fewer than the {len(sent)} sent before"
        if not _same(message, messages[i]):
            return f"messages[{i}] ({messages[i]['role']}) differs from the one sent before"
    n = len(sent)
    if n >= len(messages):
        return f"it repeats the {n} messages sent before without the model's answer (messages[{n}])"
    if not _same(returned, messages[n]):
        return (f"messages[{n}] ({messages[n]['role']}) is not the model's answer as returned (its content and tool "
                "calls unchanged)")
    return None


# ----------------------------------------------------------------------------------------------------- rendering
class ChatTemplate:
    """The model's chat template, or for a tokenizer whose template shows no tools the ChatML tools template
    async-rl ships (as `async-rl model import` installs it); for a tokenizer without any, that ChatML template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.template: str | None = None  # None: the tokenizer's own
        if not getattr(tokenizer, "chat_template", None):
            self.template = PLAIN_CHATML + TOOLS_TEMPLATE.read_text()
        elif not renders_tools(tokenizer):
            self.template = tools_chat_template(tokenizer)  # None for a non-ChatML template: its own, tools unseen

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = {"chat_template": self.template} if self.template is not None else {}
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                      add_generation_prompt=generation_prompt, **kwargs)
        except Exception as exc:
            raise ChatError(f"the model's chat template cannot render these messages: {type(exc).__name__}: {exc}",
                            code="template_error") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def first(self, request: ChatRequest) -> list[int]:
        return self.encode(self.render(request.messages, request.tools, True))

    def delta(self, request: ChatRequest, through: int) -> list[int]:
        """The tokens of what the template renders after `request.messages[:through]` (the model's answer is the
        last of those), up to the next assistant turn's opening; ChatError when the template renders that earlier
        part differently once more messages follow."""
        head = self.render(request.messages[:through], request.tools, False)
        full = self.render(request.messages, request.tools, True)
        if not full.startswith(head):
            raise ChatError("history_edited: the chat template renders the earlier messages differently once more "
                            "follow (a template that rewrites history cannot be trained token for token)",
                            code="history_edited")
        return self.encode(full[len(head):])


# ------------------------------------------------------------------------------------------------------ answering
Parser = Callable[[str, Collection[str]], tuple[Action, int]]
_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


def assistant_message(text: str, parse: Parser, names: list[str], turn: int) -> tuple[dict[str, Any], int, int]:
    """The OpenAI assistant message for the model's text: its tool calls (ids `call_<turn>_<i>`) and its content
    (the text without the call blocks that parsed; None when nothing else is left and it called a tool); and the
    number of calls that parsed and that did not."""
    if not names:
        return {"role": "assistant", "content": text}, 0, 0
    action, errors = parse(text, names)
    content = text
    if action.tool_calls:  # the blocks that parsed leave the content; one that did not stays for the agent to see
        content = _BLOCK.sub(lambda m: "" if parse(m.group(0), names)[0].tool_calls else m.group(0), text).strip()
    calls = [{"id": f"call_{turn}_{i}", "type": "function",
              "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
             for i, call in enumerate(action.tool_calls)]
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message, len(calls), errors


def completion(message: dict[str, Any], finish_reason: str, model: str, completion_id: str, created: int,
               prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "id": completion_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def stream_events(payload: dict[str, Any]) -> bytes:
    """A finished completion as the server-sent events of a streamed one (`stream: true`): the role and content,
    each tool call, the finish reason, then [DONE]."""
    choice = payload["choices"][0]
    message = choice["message"]
    base = {k: payload[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        event = base | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        return "data: " + json.dumps(event) + "\n\n"

    events = [chunk({"role": "assistant", "content": message.get("content") or ""})]
    for i, call in enumerate(message.get("tool_calls", [])):
        events.append(chunk({"tool_calls": [{"index": i, **call}]}))
    events.append(chunk({}, choice["finish_reason"]))
    return ("".join(events) + "data: [DONE]\n\n").encode()
