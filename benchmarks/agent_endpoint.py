"""The OpenAI-compatible endpoint's throughput against the engine called directly (issue 54; docs/results.md).

The same work three ways, on the same model with the same seed: `--trajectories` conversations of `--turns`
completions of exactly `--action` tokens each (EOS does not stop them), each turn followed by one short user
message ("again"), rendered with the same chat template:

    engine     the engine's generate() called directly, every conversation in one batch a turn: no runner, no
               env, no HTTP (the ceiling)
    runner     the episode runner with a plain text Env (what any env gets: env threads, batching, the prompter)
    endpoint   the `agent` env: an agent per trajectory on its own thread calling the worker's endpoint with the
               openai client (HTTP over loopback, chat-template rendering, tool-call parsing, the agent's loop)

Each figure is completions per second (and generated tokens per second), a median over `--rounds` rounds run
interleaved in one process (the machine is shared and noisy), with the endpoint's ratio to each of the others.
The tiny model makes a forward pass cheap, so it shows the endpoint's overhead at its largest; `--layers N` uses
SmolLM2-135M's shape at N layers (random weights) for a model whose forward pass costs what a small real one does.

    python benchmarks/agent_endpoint.py                       # 64 conversations x 4 turns x 32 tokens, tiny, 3 rounds
    python benchmarks/agent_endpoint.py --layers 30 --rounds 2   # the same on SmolLM2-135M's shape (~30 min)
    python benchmarks/agent_endpoint.py --quick               # 8 x 2 x 8, 1 round
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import OUT_DIR, emit, machine, markdown_table, print_table  # noqa: E402

from async_rl.config_load import load_config  # noqa: E402
from async_rl.env_types import Judgement, StepResult, Task  # noqa: E402
from async_rl.model import load_tokenizer  # noqa: E402
from rollout.agents.chat_api import ChatTemplate, parse_request  # noqa: E402
from rollout.engines import SamplingParams  # noqa: E402
from rollout.engines.torch_engine import TorchEngine  # noqa: E402
from rollout.envs.base import load_factory  # noqa: E402
from rollout.prepare import prepare_model_dir  # noqa: E402
from rollout.runner import EpisodeRunner  # noqa: E402
from rollout.settings import RolloutSettings  # noqa: E402

BATCH_WAIT_S = load_config().rollout.engine_batch_wait_s  # the shipped config's

async def bench_agent(task: dict, client, model: str) -> float:
    """The endpoint arm's agent: ask, then "again" after every answer, `turns` times."""
    messages = [{"role": "user", "content": task["question"]}]
    for _ in range(task["turns"]):
        reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=task["action"])
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    return 1.0


class _AgainEnv:
    def __init__(self, turns: int) -> None:
        self.turns, self.done = turns, 0

    def reset(self, task: Task) -> str:
        return task.data["question"]

    def step(self, action: str) -> StepResult:
        self.done += 1
        return StepResult("again", 0.0, self.done >= self.turns)

    def judge(self) -> Judgement:
        return Judgement(1.0, True)


class _AgainFactory:
    def __init__(self, tasks: list[Task], turns: int) -> None:
        self._tasks, self.turns = tasks, turns

    def tasks(self, split: str) -> list[Task]:
        return self._tasks

    def make(self) -> _AgainEnv:
        return _AgainEnv(self.turns)


class _Count:
    def __init__(self) -> None:
        self.stages, self.tokens, self.abandoned = 0, 0, 0

    def stage(self, episode, generation, reward, terminal) -> None:
        self.stages += 1
        self.tokens += len(generation.token_ids)

    def outcome(self, episode, judgement, reason) -> None:
        self.abandoned += judgement is None


def model_dir(out: Path, layers: int) -> Path:
    tiny_config = load_config(None, [f"run.dir={out}", "run.name=tiny", "model.max_seq_len=4096"])
    tiny = prepare_model_dir(RolloutSettings.from_config(tiny_config).model_dir)
    if not layers:
        return tiny
    sys.path.insert(0, str(REPO / "benchmarks"))
    from engine_cache import model_dir as smollm2_shape

    return smollm2_shape(out, layers)


def run_engine(engine: TorchEngine, prompts: list[list[int]], again: list[int], args) -> tuple[float, int, int]:
    params = SamplingParams(max_new_tokens=args.action)
    contexts = [list(p) for p in prompts]
    started = time.perf_counter()
    completions = tokens = 0
    for turn in range(args.turns):
        for row, generation in enumerate(engine.generate(contexts, params)):
            contexts[row] += generation.token_ids + (again if turn + 1 < args.turns else [])
            completions += 1
            tokens += len(generation.token_ids)
    engine.cache.clear()
    return time.perf_counter() - started, completions, tokens


def run_runner(factory, engine: TorchEngine, tokenizer, tasks: list[Task], args) -> tuple[float, int, int]:
    sink = _Count()
    params = SamplingParams(max_new_tokens=args.action)
    runner = EpisodeRunner("bench", factory, engine, tokenizer, params, 4096, sink, len(tasks), step_timeout_s=600,
                           batch_wait_s=BATCH_WAIT_S)
    started = time.perf_counter()
    try:
        for n, task in enumerate(tasks):
            runner.start_group(f"g{n}", task, 1)
        while not runner.idle():
            runner.pump(0.01)
    finally:
        runner.close()
    engine.cache.clear()
    if sink.abandoned:
        raise SystemExit(f"{sink.abandoned} trajectories abandoned")
    return time.perf_counter() - started, sink.stages, sink.tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--action", type=int, default=32, help="tokens per completion (default 32)")
    parser.add_argument("--layers", type=int, default=0, help="0: the tiny model; N: SmolLM2-135M's shape at N layers")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="8 conversations x 2 turns x 8 tokens, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.trajectories, args.turns, args.action, args.rounds = 8, 2, 8, 1
    torch.set_num_threads(1)
    out = OUT_DIR / "agent_endpoint"
    out.mkdir(parents=True, exist_ok=True)
    path = model_dir(out, args.layers)
    tokenizer = load_tokenizer(path)
    template = ChatTemplate(tokenizer)
    if template.template is not None:  # no template of its own: every arm renders with the endpoint's ChatML
        tokenizer.chat_template = template.template
        template = ChatTemplate(tokenizer)
    records = [{"id": f"q{i}", "question": f"conversation {i}: tell me something", "turns": args.turns,
                "action": args.action} for i in range(args.trajectories)]
    tasks_file = out / "tasks.jsonl"
    tasks_file.write_text("".join(json.dumps(r) + "\n" for r in records))
    tasks = [Task(r["id"], r) for r in records]
    prompts = [template.first(parse_request({"messages": [{"role": "user", "content": r["question"]}]}))
               for r in records]
    again = template.encode("<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    sys.path.insert(0, str(REPO / "benchmarks"))
    agent = load_factory("agent", {"entry": "agent_endpoint:bench_agent", "tasks": str(tasks_file),
                                   "eval_fraction": 0.5})
    agent.tasks = lambda split: tasks  # every task, one trajectory each
    text = _AgainFactory(tasks, args.turns)
    engine = TorchEngine(path, seed=0)
    arms = {"engine": lambda: run_engine(engine, prompts, again, args),
            "runner": lambda: run_runner(text, engine, tokenizer, tasks, args),
            "endpoint": lambda: run_runner(agent, engine, tokenizer, tasks, args)}
    rates: dict[str, list[float]] = {name: [] for name in arms}
    token_rates: dict[str, list[float]] = {name: [] for name in arms}
    with torch.inference_mode():
        run_runner(agent, engine, tokenizer, tasks[:2], args)  # warm-up: imports, the endpoint, the first client
        for _ in range(args.rounds):
            for name, arm in arms.items():
                wall, completions, tokens = arm()
                expected = args.trajectories * args.turns
                if completions != expected:
                    raise SystemExit(f"{name}: {completions} completions, expected {expected}")
                rates[name].append(completions / wall)
                token_rates[name].append(tokens / wall)
                print(f"round {len(rates[name])}: {name} {completions / wall:.2f} completions/s", file=sys.stderr,
                      flush=True)
    agent.close()
    median = {name: statistics.median(r) for name, r in rates.items()}
    columns = ["arm", "completions/s (median)", "range", "tokens/s", "endpoint ÷ arm"]
    rows = [[name, f"{median[name]:.1f}", f"{min(r):.1f}–{max(r):.1f}", f"{statistics.median(token_rates[name]):.0f}",
             f"{median['endpoint'] / median[name]:.2f}"] for name, r in rates.items()]
    model = "the tiny model" if not args.layers else f"SmolLM2-135M's shape at {args.layers} layers"
    flags = " --quick" if args.quick else ((f" --layers {args.layers}" if args.layers else "")
                                           + (f" --rounds {args.rounds}" if args.rounds != 3 else ""))
    print_table(f"{args.trajectories} conversations x {args.turns} turns x {args.action} tokens, {model} "
                f"(median of {args.rounds})", columns, rows)
    print(markdown_table(columns, rows, "python benchmarks/agent_endpoint.py" + flags))
    emit({"machine": machine(), "layers": args.layers, "trajectories": args.trajectories, "turns": args.turns,
          "action": args.action, "rounds": args.rounds,
          "completions_per_s": {name: [round(x, 2) for x in r] for name, r in rates.items()},
          "endpoint_vs_engine": round(median["endpoint"] / median["engine"], 3),
          "endpoint_vs_runner": round(median["endpoint"] / median["runner"], 3)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
