"""A verifiers (v1) taskset that needs no network, for tests/test_verifiers_env.py: taskset id `vf-tiny-taskset`
(this module on PYTHONPATH). Its harness is an in-process two-turn chat loop over the OpenAI client verifiers'
interception server hands it (a task whose prompt is "boom" makes it raise, "hang" wait until cancelled); its
task's `@reward` is the share of "yes" words in the last reply, and `@metric` turns counts the assistant messages.
`VOCABULARY` makes the tiny model's tokenizer word-level over a few words, so a random policy says "yes" often."""

from __future__ import annotations

import asyncio

import openai
import verifiers.v1 as vf

VOCABULARY = ["yes", "no", "maybe", "again"]
SEEN: dict[str, list[str]] = {}  # task prompt -> the replies its harness got, in order


class TinyConfig(vf.TasksetConfig):
    tasks: int = 6
    fail_load: bool = False  # Taskset.load raises
    fail_init: bool = False  # the taskset's constructor raises
    first: str = ""  # the first task's prompt: "boom" (its harness raises), "hang" (it waits forever), else "say yes 0"


def score(reply: str) -> float:
    words = reply.split()
    return sum(w == "yes" for w in words) / len(words) if words else 0.0


class TinyTask(vf.Task):
    @vf.reward
    async def says_yes(self, trace: vf.Trace) -> float:
        return score(trace.last_reply)

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages))


class TinyTaskset(vf.Taskset[TinyTask, TinyConfig]):
    def __init__(self, config: TinyConfig) -> None:
        if config.fail_init:
            raise RuntimeError("this taskset cannot be built")
        super().__init__(config)

    def load(self):
        if self.config.fail_load:
            raise RuntimeError("this taskset's rows are gone")
        for i in range(self.config.tasks):
            prompt = self.config.first if i == 0 and self.config.first else f"say yes {i}"
            yield TinyTask(vf.TaskData(id=f"t{i}", prompt=prompt), self.config.task)


class TinyHarness(vf.Harness[vf.HarnessConfig]):
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        if data.prompt == "boom":
            raise RuntimeError("the harness broke on this task")
        if data.prompt == "hang":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                SEEN["hang"] = ["cancelled"]
                raise
        replies = SEEN.setdefault(data.prompt, [])
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            messages = [{"role": "user", "content": data.prompt}]
            for _ in range(2):
                answer = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=6)
                content = answer.choices[0].message.content or ""
                replies.append(content)
                messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "again"}]
        return vf.ProgramResult(0, "", "")


__all__ = ["TinyHarness", "TinyTaskset"]
