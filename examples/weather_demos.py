"""weather_demos.py: one demonstration per train task of weather_tasks.jsonl, for `async-rl sft` (README, "Your agent
as it is"): the conversation weather_agent.run holds when it does right (the look-up, its result, the one-word
answer), with the agent's tools, one JSON object a line in weather_demos.jsonl. Held-out tasks are never written."""
import json
from pathlib import Path

from weather_agent import TOOLS, WEATHER, question

tasks = [json.loads(line) for line in (Path(__file__).parent / "weather_tasks.jsonl").read_text().splitlines()]
with open("weather_demos.jsonl", "w") as f:
    for task in tasks:
        if task.get("split") != "train":
            continue
        call = {"id": "call_0", "type": "function",
                "function": {"name": "weather", "arguments": json.dumps({"city": task["city"]})}}
        f.write(json.dumps({"tools": TOOLS, "messages": [
            {"role": "user", "content": question(task)},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": WEATHER[task["city"]]},
            {"role": "assistant", "content": task["answer"]}]}) + "\n")
