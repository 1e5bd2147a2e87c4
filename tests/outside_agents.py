"""Agents written against the `openai` client only, as a user outside the project writes them, for
tests/test_openai_agent.py (`env.name=agent env.kwargs.entry=outside_agents:NAME`). Each records what it received
in SEEN, by task id, for the test to compare with what the trajectory recorded."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai

import async_rl

SEEN: dict[str, dict] = {}  # task id -> what the agent got back
LOCK = threading.Lock()
WAITING = {"now": 0, "peak": 0}  # agents inside a completion request at once


def _seen(task: dict) -> dict:
    with LOCK:
        return SEEN.setdefault(task.get("id", str(task)), {"contents": [], "prompt_tokens": [], "ids": []})


async def _ask(client: openai.AsyncOpenAI, model: str, messages: list, **kwargs):
    with LOCK:
        WAITING["now"] += 1
        WAITING["peak"] = max(WAITING["peak"], WAITING["now"])
    try:
        return await client.chat.completions.create(model=model, messages=messages, max_tokens=8, **kwargs)
    finally:
        with LOCK:
            WAITING["now"] -= 1


async def two_turns(task: dict, client: openai.AsyncOpenAI, model: str) -> float:
    """Ask, then ask again after the answer; a stage reward on the first completion."""
    seen = _seen(task)
    messages = [{"role": "user", "content": task["question"]}]
    for turn in range(2):
        reply = await _ask(client, model, messages)
        message = reply.choices[0].message
        seen["contents"].append(message.content)
        seen["prompt_tokens"].append(reply.usage.prompt_tokens)
        seen["ids"].append(reply.id)
        seen["key"] = client.api_key
        if turn == 0:
            await async_rl.reward(client, 0.25)
        messages += [message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    return {"reward": 1.0, "success": True, "turns": 2}


async def edits_history(task: dict, client: openai.AsyncOpenAI, model: str) -> float:
    """Sends the model's answer back rewritten (refused: history_edited), then as it was (accepted)."""
    messages = [{"role": "user", "content": task["question"]}]
    reply = await _ask(client, model, messages)
    answer = reply.choices[0].message.model_dump(exclude_none=True)
    edited = dict(answer, content="something the model never said")
    try:
        await _ask(client, model, [*messages, edited, {"role": "user", "content": "again"}])
        return 0.0
    except openai.BadRequestError as exc:
        assert exc.code == "history_edited", exc
    try:  # a different system prompt in front: the history is not the trajectory's either
        await _ask(client, model, [{"role": "system", "content": "x"}, *messages, answer])
        return 0.0
    except openai.BadRequestError as exc:
        assert exc.code == "history_edited", exc
    await _ask(client, model, [*messages, answer, {"role": "user", "content": "again"}])
    return 1.0


async def fails(task: dict, client: openai.AsyncOpenAI, model: str) -> float:
    """task["mode"]: ok, raise (after one completion), hang (awaits forever after one), block (a synchronous sleep
    after one: it holds its own thread only), silent (returns without calling the model)."""
    mode = task["mode"]
    if mode == "silent":
        return 1.0
    await _ask(client, model, [{"role": "user", "content": task["question"]}])
    if mode == "raise":
        raise ValueError("the agent's own bug")
    if mode == "hang":
        await asyncio.sleep(3600)
    if mode == "block":
        time.sleep(task.get("block_s", 4.0))
    return 1.0


async def protocol(task: dict, client: openai.AsyncOpenAI, model: str) -> float:
    """The endpoint's HTTP surface from a client's side; every check an assert (an agent that raises is counted)."""
    base = str(client.base_url).rstrip("/")
    root = base.split("/t/")[0] + "/v1"
    async with httpx.AsyncClient() as http:
        listed = (await http.get(f"{root}/models")).json()
        assert [m["id"] for m in listed["data"]] == [model], listed
        assert (await http.get(f"{base}/models")).json() == listed
        unknown = await http.post(f"{root.replace('/v1', '')}/t/nobody/v1/chat/completions", json={})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_trajectory"
    try:
        await async_rl.reward(client, 1.0)
        raise AssertionError("a reward before any completion was taken")
    except openai.BadRequestError as exc:
        assert exc.code == "no_completion", exc
    try:
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], n=2)
        raise AssertionError("n=2 was taken")
    except openai.BadRequestError as exc:
        assert exc.param == "n", exc
    messages = [{"role": "user", "content": task["question"]}]
    first, second = await asyncio.gather(_ask(client, model, messages), _ask(client, model, messages),
                                         return_exceptions=True)
    refused = [r for r in (first, second) if isinstance(r, Exception)]
    answered = [r for r in (first, second) if not isinstance(r, Exception)]
    assert len(refused) == 1 and isinstance(refused[0], openai.ConflictError), (first, second)
    message = answered[0].choices[0].message
    # streamed (stream: true): the same kind of answer as events; by the bearer key on the plain /v1 path
    messages += [message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
    plain = openai.AsyncOpenAI(base_url=root, api_key=client.api_key, max_retries=0)
    async with plain:
        stream = await plain.chat.completions.create(model=model, messages=messages, max_tokens=8, stream=True)
        chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length"), chunks[-1]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    _seen(task)["contents"] += [message.content, text]
    await async_rl.reward(client, 0.5)
    return 1.0


def sync_agent(task: dict, client: openai.OpenAI, model: str) -> float:
    """A synchronous agent (smolagents-style) gets an openai.OpenAI client; async_rl.reward works without await."""
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": task["question"]}],
                                           max_tokens=8)
    _seen(task)["contents"].append(reply.choices[0].message.content)
    async_rl.reward(client, 0.75)
    return 0.5


WEATHER = {"paris": "sunny", "oslo": "snowy", "cairo": "windy", "lima": "foggy", "tokyo": "rainy", "delhi": "cloudy"}


async def agents_sdk(task: dict, client: openai.AsyncOpenAI, model: str) -> float:
    """examples/weather_agent.py's task written with the OpenAI Agents SDK (`pip install openai-agents`), unchanged
    but for its model: the SDK's chat-completions model on the client the trajectory was handed."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from agents.exceptions import MaxTurnsExceeded

    set_tracing_disabled(True)  # its traces would go to OpenAI's servers

    @function_tool
    async def weather(city: str) -> str:
        """Today's weather in a city."""
        if city == task["city"]:
            await async_rl.reward(client, 0.1)
        return WEATHER.get(city, "no such city")

    agent = Agent(name="weather", instructions="Answer in one word.", tools=[weather],
                  model=OpenAIChatCompletionsModel(model=model, openai_client=client),
                  model_settings=ModelSettings(max_tokens=48))
    try:
        result = await Runner.run(agent, f"What is the weather in {task['city']} ?", max_turns=2)
    except MaxTurnsExceeded:
        return 0.0
    _seen(task)["contents"].append(result.final_output)
    return float(str(result.final_output).strip().lower().rstrip(".") == task["answer"])


async def slow_clients(task: dict, client: openai.AsyncOpenAI, model: str) -> float:
    """Opens 200 connections to the endpoint that never send a body (half send nothing at all, half a request head
    with this trajectory's key and a Content-Length), then asks for a completion as usual."""
    host, port = client.base_url.host, client.base_url.port
    path = client.base_url.raw_path.decode().rstrip("/") + "/chat/completions"
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
            "\r\n").encode()
    held = []
    try:
        for i in range(200):
            reader, writer = await asyncio.open_connection(host, port)
            if i % 2:
                writer.write(head)
                await writer.drain()
            held.append(writer)
        reply = await _ask(client, model, [{"role": "user", "content": task["question"]}])
        _seen(task)["contents"].append(reply.choices[0].message.content)
        return 1.0
    finally:
        for writer in held:
            writer.close()


STREAM = {"first_piece": threading.Event()}  # set by `streamed` at its first content piece


async def streamed(task: dict, client: openai.AsyncOpenAI, model: str) -> float:
    """Two completions asked with stream=True (the second after the first's answer, as any streaming agent sends it
    back): records each content piece as it arrives and what the pieces add up to."""
    seen = _seen(task)
    seen["pieces"] = []
    messages = [{"role": "user", "content": task["question"]}]
    for _ in range(2):
        stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=32, stream=True)
        pieces, finish = [], None
        async for chunk in stream:
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is not None and delta.content:
                pieces.append(delta.content)
                STREAM["first_piece"].set()
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        assert finish in ("stop", "length"), finish
        seen["pieces"].append(pieces)
        seen["contents"].append("".join(pieces))
        messages += [{"role": "assistant", "content": "".join(pieces)}, {"role": "user", "content": "again"}]
    return 1.0


HANG = {"release": threading.Event()}


def sync_hangs(task: dict, client: openai.OpenAI, model: str) -> float:
    """A synchronous agent that blocks its thread after one completion until the test releases it (a hung tool)."""
    _seen(task)["timeout"] = client.timeout
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": task["question"]}],
                                   max_tokens=8)
    HANG["release"].wait(120)
    return 1.0
