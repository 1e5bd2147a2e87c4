"""The built-in multi-step tool task: follow a chain of look-ups to a number (docs/environments.md, "chain").

Each task hides a table of keys. The question names a starting key; the `lookup` tool answers a key's value,
which is the next key of the chain or, after `hops` look-ups, a number. The agent must make the `hops` calls in
order (each call's argument is the previous call's result) and then state the number:

    user: Key ravo starts a chain ... → lookup(ravo) → "kelu" → lookup(kelu) → "47" → <answer>47</answer>

At `forks` of the hops the value names two keys ("kelu or pime"), in a random order: one goes on, the other is a
decoy whose value is "dead end". Nothing in the text says which: an agent picks one and, on a dead end, must
look up the other (its turns permitting), so a policy that only copies what it is shown succeeds about once in
2^forks, and one that learns to recover does better.

Stage reward: `step_reward` for each call that looks up the chain's next key (a call that advances the
solution), 0 for any other turn. Outcome: 1 when the final answer is the chain's number, else 0, after
`judge_delay_s` (a slow grader). `demonstration(task)` gives the turns that solve a task (the calls, then the
answer), for `async-rl demos` (rollout/demos.py).
"""

from __future__ import annotations

import json
import random
import time
from typing import Annotated, Any, Literal

import msgspec

from async_rl.env_types import Action, Judgement, StepResult, Task, ToolResult
from rollout.envs.base import EnvError, settings_from_kwargs
from rollout.envs.tasks import INSTRUCTIONS, final_answer, last_number, without_calls

LOOKUP_SPEC = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up a key; returns its value: another key (or two: \"A or B\"), a number, or "
                       "\"dead end\".",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string", "description": "the key, e.g. ravo"}},
            "required": ["key"],
        },
    },
}
CONSONANTS, VOWELS = "bdfgklmnprstvz", "aeiou"


class ChainSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    seed: int = 0  # derives every task's keys and number, and the split
    num_tasks: Annotated[int, msgspec.Meta(ge=2)] = 1000
    eval_fraction: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] = 0.2  # the held-out share of the tasks
    hops: Annotated[int, msgspec.Meta(ge=2, le=8)] = 2  # look-ups to reach the number
    forks: Annotated[int, msgspec.Meta(ge=0)] = 0  # hops whose value names the next key and a decoy (dead end)
    max_turns: Annotated[int, msgspec.Meta(ge=1)] = 6  # turns per episode, the final answer's included
    step_reward: Annotated[float, msgspec.Meta(ge=0.0)] = 0.1  # per call that looks up the chain's next key
    judge_delay_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0  # a sleep inside judge(): a slow grader
    # What a final turn without <answer>...</answer> answers: its text, or its last number.
    untagged: Literal["text", "last-number"] = "last-number"

    def __post_init__(self) -> None:
        if self.forks > self.hops - 1:
            raise ValueError(f"forks: expected <= hops - 1 ({self.hops - 1}: the last value is the number), "
                             f"got {self.forks}")


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(2))


def make_task(index: int, settings: ChainSettings) -> Task:
    """Task `index`: its chain of `hops` distinct keys, the number at its end, and at `forks` hops a decoy key
    listed beside the next one (which first: `decoy_first`)."""
    rng = random.Random(f"chain/{settings.seed}/{index}")
    words: list[str] = []
    while len(words) < settings.hops + settings.forks:
        word = _word(rng)
        if word not in words:
            words.append(word)
    keys, spare = words[: settings.hops], words[settings.hops :]
    number = rng.randint(10, 99)
    forks = sorted(rng.sample(range(settings.hops - 1), settings.forks))  # the values that are keys: hops 0..h-2
    decoys = {str(at): {"key": spare[i], "first": rng.random() < 0.5} for i, at in enumerate(forks)}
    return Task(id=f"chain/{index}", data={"keys": keys, "answer": str(number), "decoys": decoys})


def question(task: Task) -> str:
    forks = " A value may name two keys (A or B): one leads on, the other to a dead end." if task.data["decoys"] else ""
    return (f"Key {task.data['keys'][0]} starts a chain. The lookup tool gives a key's value: another key, or a "
            f"number.{forks} Follow the chain from {task.data['keys'][0]} to its number and answer that number. "
            f"{INSTRUCTIONS}")


def value_of(task: Task, position: int) -> str:
    """What `lookup` answers for the chain's key at `position`: the next key (with its decoy, at a fork) or the
    number."""
    keys = task.data["keys"]
    if position + 1 == len(keys):
        return task.data["answer"]
    decoy = task.data["decoys"].get(str(position))
    if decoy is None:
        return keys[position + 1]
    pair = (decoy["key"], keys[position + 1]) if decoy["first"] else (keys[position + 1], decoy["key"])
    return f"{pair[0]} or {pair[1]}"


class ChainEnv:
    def __init__(self, settings: ChainSettings) -> None:
        self.settings = settings
        self.task: Task | None = None
        self.reached = 0  # keys of the chain looked up, in order
        self.turns = self.calls = self.errors = self.dead_ends = 0
        self.answer = ""

    def tools(self) -> list[dict]:
        return [LOOKUP_SPEC]

    def reset(self, task: Task) -> str:
        self.task = task
        return question(task)

    def step(self, action: str | Action) -> StepResult:
        if isinstance(action, str):
            action = Action(action, [])
        self.turns += 1
        answer = final_answer(action.text)
        if answer is None and (action.tool_calls or action.parse_error) and self.turns < self.settings.max_turns:
            results, advanced = self._run_calls(action)
            return StepResult(results, self.settings.step_reward * advanced, False)
        if answer is None:
            text = without_calls(action.text)
            answer = last_number(text) if self.settings.untagged == "last-number" else text
        self.answer = answer
        return StepResult(None, 0.0, True)

    def _run_calls(self, action: Action) -> tuple[list[ToolResult], int]:
        assert self.task is not None
        keys, results, advanced = self.task.data["keys"], [], 0
        decoys = {decoy["key"] for decoy in self.task.data["decoys"].values()}
        for call in action.tool_calls:
            self.calls += 1
            key = call.arguments.get("key")
            key = key.strip() if isinstance(key, str) else key
            if key in decoys:
                self.dead_ends += 1
                results.append(ToolResult("dead end", call.name, call.id))
                continue
            if not isinstance(key, str) or key not in keys:
                self.errors += 1
                results.append(ToolResult(f"error: no key {key!r}", call.name, call.id))
                continue
            position = keys.index(key)
            if position == self.reached:  # the chain's next key: this call advances the solution
                self.reached += 1
                advanced += 1
            results.append(ToolResult(value_of(self.task, position), call.name, call.id))
        if action.parse_error:
            self.errors += 1
            results.append(ToolResult(f"error: {action.parse_error}"))
        return results, advanced

    def judge(self) -> Judgement:
        if self.settings.judge_delay_s:
            time.sleep(self.settings.judge_delay_s)
        assert self.task is not None
        success = self.answer.strip() == self.task.data["answer"]
        info = {"tool_calls": float(self.calls), "tool_errors": float(self.errors),
                "called_tool": float(self.calls > 0),
                "chain_reached": self.reached / len(self.task.data["keys"]), "dead_ends": float(self.dead_ends)}
        return Judgement(score=float(success), success=success, info=info)


class ChainFactory:
    max_action_tokens = 48

    def __init__(self, settings: ChainSettings) -> None:
        self.settings = settings
        tasks = [make_task(i, settings) for i in range(settings.num_tasks)]
        random.Random(settings.seed).shuffle(tasks)
        n_eval = max(1, round(len(tasks) * settings.eval_fraction))
        self.splits = {"eval": tasks[:n_eval], "train": tasks[n_eval:]}

    def tasks(self, split: str) -> list[Task]:
        if split not in self.splits:
            raise EnvError(f"env 'chain': no split {split!r} (train, eval)")
        return list(self.splits[split])

    def make(self) -> ChainEnv:
        return ChainEnv(self.settings)

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """The assistant turns that solve `task` (OpenAI chat format): one lookup per key, then the answer."""
        turns: list[dict[str, Any]] = [
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "lookup", "arguments": json.dumps({"key": key})}}]}
            for key in task.data["keys"]
        ]
        return [*turns, {"role": "assistant", "content": f"<answer>{task.data['answer']}</answer>"}]


def factory(**kwargs: Any) -> ChainFactory:
    """`env.name=chain` with `env.kwargs` (ChainSettings)."""
    return ChainFactory(settings_from_kwargs("chain", ChainSettings, kwargs))
