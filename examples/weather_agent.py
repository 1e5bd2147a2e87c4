"""An agent written against the OpenAI client alone: asked about a city's weather, it calls its one tool, then
answers in one word. `async-rl train env.name=agent` trains it as it is (README, "Your agent as it is")."""
import json

import async_rl

WEATHER = {"paris": "sunny", "oslo": "snowy", "cairo": "windy", "lima": "foggy", "tokyo": "rainy", "delhi": "cloudy"}
TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "Today's weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def question(task: dict) -> str:
    return f"What is the weather in {task['city']} ? Answer in one word."


async def run(task: dict, client, model: str) -> float:
    messages = [{"role": "user", "content": question(task)}]
    for _ in range(2):  # look it up, then answer
        reply = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=48)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:  # the answer
            return float((message.content or "").strip().lower().rstrip(".") == task["answer"])
        for call in message.tool_calls:
            city = json.loads(call.function.arguments).get("city")
            if city == task["city"]:
                await async_rl.reward(client, 0.1)  # a stage reward for this completion: the right look-up
            messages.append({"role": "tool", "tool_call_id": call.id, "content": WEATHER.get(city, "no such city")})
    return 0.0


# The built-in tiny model's words (a real model ignores them): one token each, so a random policy can call the tool.
CALLS = [json.dumps({"name": "weather", "arguments": {"city": city}}, separators=(",", ":")) for city in WEATHER]
VOCABULARY = [*WEATHER, *WEATHER.values(), *(f"<tool_call>{call}</tool_call>" for call in CALLS)]
