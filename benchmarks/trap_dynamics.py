"""The learning dynamics on the trap environment, in one process: does a task end solved or trapped, and why.

A single-process *model* of the learning rule, for research on the rule itself (not a measurement of the system:
no processes, no sockets, no DeepSpeed, no admission). Each step plays `algo.groups_per_step` groups of
`rollout.group_size` trajectories with the current policy (the real tiny model, environment, advantage
functions and loss of this project), trains the immediate items of those groups at once and their corrections
one step later (`C = A_final − issued`, so every token's total credit is `A_final`), with torch AdamW and the
learner's gradient clipping. What it adds is a probe: every `--probe-every` steps, for every task, the policy's
probability of the code symbol and of the trap symbol at each stage along the code path, which shows the race
between the two at a trap stage (docs/algorithm.md, "Entropy bonus").

    python benchmarks/trap_dynamics.py env.kwargs.seed=7 env.kwargs.stages=5        # ~3-5 min per 1,000 steps
    python benchmarks/trap_dynamics.py env.kwargs.seed=7 env.kwargs.stages=5 algo.entropy_coef=0
    python benchmarks/trap_dynamics.py --quick                                        # 40 steps

Prints a line every 50 steps: success over the last `replay.long_success_window` trajectories and one letter per
task (S solved, T trapped, F failed: the outcome of >= 75% of its last 64 trajectories; lower case when no
outcome reaches 75%). The probe goes to benchmarks/out/trap_dynamics/<tag>.probe.jsonl. The last stdout line is
JSON: the step at which the success rate reached `run.target_success` (or null), the final success rate and
the tasks that ended trapped.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import deque
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from async_rl.config_load import load_config  # noqa: E402
from async_rl.ledger import GroupLedger  # noqa: E402
from async_rl.loss import policy_loss, token_logprobs_and_entropy  # noqa: E402
from async_rl.model import build_tiny_model, word_tokenizer  # noqa: E402
from rollout.envs.base import Task  # noqa: E402
from rollout.envs.trap import OK, make_task, stage_word, symbol, task_word  # noqa: E402
from rollout.envs.trap import factory as trap_factory  # noqa: E402

OUT_DIR = REPO / "benchmarks" / "out" / "trap_dynamics"


class Model:
    def __init__(self, config) -> None:
        self.config = config
        self.factory = trap_factory(**config.env.kwargs)
        self.settings = self.factory.settings
        self.tokenizer = word_tokenizer(self.factory.vocabulary())
        tok = self.tokenizer
        self.net = build_tiny_model(config.model, config.run.seed, len(tok), tok.pad_token_id, tok.eos_token_id)
        self.optimizer = torch.optim.AdamW(
            self.net.parameters(), lr=config.learner.lr, weight_decay=config.learner.weight_decay
        )

    def padded(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.tokenizer.pad_token_id)
        mask = torch.zeros_like(ids)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        return ids, mask

    @torch.no_grad()
    def play(self, task_ids: list[int], rng: torch.Generator) -> list[dict]:
        """One trajectory per entry: tokens, (position, token, behaviour log-prob) per action, rewards, outcome."""
        tok, temperature = self.tokenizer, self.config.rollout.temperature
        runs = []
        for task_id in task_ids:
            env = self.factory.make()
            first = env.reset(Task(str(task_id), {"task": task_id}))
            runs.append({"task": task_id, "env": env, "tokens": tok(first)["input_ids"],
                         "actions": [], "rewards": []})
        live = list(range(len(runs)))
        while live:
            ids, mask = self.padded([runs[i]["tokens"] for i in live])
            logits = self.net(input_ids=ids, attention_mask=mask).logits
            last = torch.log_softmax(logits[torch.arange(len(live)), mask.sum(1) - 1] / temperature, -1)
            sampled = torch.multinomial(last.exp(), 1, generator=rng).squeeze(1)
            still = []
            for row, i in enumerate(live):
                run, token = runs[i], int(sampled[row])
                run["actions"].append((len(run["tokens"]), token, float(last[row, token])))
                run["tokens"].append(token)
                result = run["env"].step(tok.decode([token]))
                run["rewards"].append(result.reward)
                if not result.done:
                    run["tokens"] += tok(result.observation, add_special_tokens=False)["input_ids"]
                    still.append(i)
            live = still
        for run in runs:
            run["outcome"] = run["env"].judge().score
        return runs

    def train(self, items: list[tuple[list[int], list[tuple[int, int, float, float, int]]]]) -> None:
        """One optimizer step on items (tokens, [(position, token, behaviour log-prob, advantage, staleness)])."""
        ids, attention = self.padded([tokens for tokens, _ in items])
        shape = (len(items), ids.shape[1] - 1)
        advantages, behaviour, staleness, loss_mask = (torch.zeros(shape) for _ in range(4))
        for row, (_, actions) in enumerate(items):
            for position, _, logp_mu, advantage, stale in actions:
                column = position - 1  # token_logprobs row t predicts token t + 1
                advantages[row, column], behaviour[row, column] = advantage, logp_mu
                staleness[row, column], loss_mask[row, column] = stale, 1.0
        logits = self.net(input_ids=ids, attention_mask=attention).logits
        logp, entropy = token_logprobs_and_entropy(logits, ids, self.config.rollout.temperature)
        loss, _ = policy_loss(logp, behaviour, advantages, staleness, loss_mask, self.config.algo, entropy=entropy)
        self.optimizer.zero_grad()
        loss.backward()
        if self.config.learner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.config.learner.grad_clip)
        self.optimizer.step()

    @torch.no_grad()
    def probe(self) -> list[list[list[float | None]]]:
        """Per task, per stage along the code path: [p(code), p(trap) or None]."""
        tok, env = self.tokenizer, self.settings
        out = []
        for task_id in range(env.num_tasks):
            task = make_task(env, task_id)
            words, positions = [task_word(task_id), stage_word(0)], []
            for stage, code in enumerate(task.code):
                positions.append(len(tok(" ".join(words))["input_ids"]) - 1)
                words += [symbol(code)] + ([OK, stage_word(stage + 1)] if stage + 1 < env.stages else [])
            ids = torch.tensor([tok(" ".join(words))["input_ids"]])
            probs = torch.softmax(self.net(input_ids=ids).logits[0] / self.config.rollout.temperature, -1)
            row = []
            for stage, code in enumerate(task.code):
                at = probs[positions[stage]]
                p_code = float(at[tok.convert_tokens_to_ids(symbol(code))])
                trap = task.traps.get(stage)
                p_trap = None if trap is None else round(float(at[tok.convert_tokens_to_ids(symbol(trap))]), 4)
                row.append([round(p_code, 4), p_trap])
            out.append(row)
        return out


def group_items(config, runs: list[dict]):
    """Immediate items of one group now, its corrections for the next step, through the replay's own ledger
    (`async_rl.ledger.GroupLedger`, docs/algorithm.md). A correction item carries every stage of its member."""
    algo = config.algo
    ledger = GroupLedger(len(runs))
    for i, run in enumerate(runs):
        for k, reward in enumerate(run["rewards"]):
            ledger.add_stage(i, k, reward, terminal=k == len(run["rewards"]) - 1)
    immediate = []
    for k in range(max(len(r["rewards"]) for r in runs)):
        for i, advantage in ledger.immediate(k, algo).items():
            ledger.record_trained(i, k, advantage, immediate=True)
            position, token, logp_mu = runs[i]["actions"][k]
            immediate.append((runs[i]["tokens"], [(position, token, logp_mu, advantage, 0)]))
    for i, run in enumerate(runs):
        ledger.add_outcome(i, run["outcome"], len(run["rewards"]))
    a_final = ledger.finalize(algo)
    corrected = {i for i, _ in ledger.corrections()}
    corrections = []
    for i in sorted(corrected):
        actions = [(*action, a_final[(i, k)] - ledger.issued.get((i, k), 0.0), 1)
                   for k, action in enumerate(runs[i]["actions"])]
        corrections.append((runs[i]["tokens"], actions))
    return immediate, corrections


def letter(outcomes: deque) -> str:
    if not outcomes:
        return "?"
    counts = {c: list(outcomes).count(c) for c in "STF"}
    best = max(counts, key=counts.get)
    return best if counts[best] >= 0.75 * len(outcomes) else best.lower()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="section.key=value, as for async-rl train")
    parser.add_argument("--steps", type=int, default=1500, help="stop after this many steps (default 1500)")
    parser.add_argument("--probe-every", type=int, default=10)
    parser.add_argument("--tag", default=None, help="name of the probe file (default: from the overrides)")
    parser.add_argument("--quick", action="store_true", help="40 steps")
    args = parser.parse_args()
    steps = 40 if args.quick else args.steps
    config = load_config(None, args.overrides)
    torch.set_num_threads(1)
    torch.manual_seed(config.run.seed)
    sampler = torch.Generator().manual_seed(config.run.seed)
    task_rng = random.Random(config.run.seed)
    model = Model(config)
    G, P, T = config.rollout.group_size, config.algo.groups_per_step, model.settings.num_tasks
    window = deque(maxlen=config.replay.long_success_window)
    per_task = {t: deque(maxlen=64) for t in range(T)}
    stage_reward_first = stage_reward_last = None
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    tag = args.tag or ("_".join(args.overrides) or "default").replace("/", "-")
    probe_path = OUT_DIR / f"{tag}.probe.jsonl"
    started, hit, pending = time.monotonic(), None, []
    with probe_path.open("w") as probe_file:
        for step in range(steps):
            if step % args.probe_every == 0:
                probe_file.write(json.dumps({"step": step, "p": model.probe()}) + "\n")
            tasks = [task_rng.randrange(T) for _ in range(P)]
            runs = model.play([t for t in tasks for _ in range(G)], sampler)
            rewards = [r for run in runs for r in run["rewards"]]
            stage_reward = sum(rewards) / len(rewards)
            stage_reward_first = stage_reward if stage_reward_first is None else stage_reward_first
            stage_reward_last = stage_reward
            items, next_pending = [], []
            for g in range(P):
                group = runs[g * G:(g + 1) * G]
                for run in group:
                    window.append(run["outcome"])
                    per_task[run["task"]].append("T" if run["env"].trapped else "F" if run["env"].failed else "S")
                immediate, corrections = group_items(config, group)
                items += immediate
                next_pending += corrections
            if items or pending:
                model.train(items + pending)
            pending = next_pending
            success = sum(window) / len(window)
            target = config.run.target_success
            if hit is None and target is not None and len(window) == window.maxlen and success >= target:
                hit = step
            if step % 50 == 0 or step == steps - 1 or hit == step:
                letters = "".join(letter(per_task[t]) for t in range(T))
                print(f"step {step:5d}  success {success:.3f}  stage reward {stage_reward:.2f}  "
                      f"{time.monotonic() - started:5.0f} s  {letters}", flush=True)
            if hit is not None:
                break
    trapped = [t for t in range(T) if letter(per_task[t]) == "T"]
    print(json.dumps({"hit_step": hit, "steps": step + 1, "final_success": round(success, 4),
                      "tasks_trapped": trapped, "stage_reward_first": round(stage_reward_first, 4),
                      "stage_reward_last": round(stage_reward_last, 4), "probe": str(probe_path),
                      "wall_s": round(time.monotonic() - started, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
