"""The learner's log-probs at the trained positions only (learner/logits.py) against the full logits over every token,
forward + backward seconds side by side in one invocation, on packed rows of the learner's own layout.

Each item is a prompt (not trained) followed by an action (trained): --trained-share of its tokens, as in an agent's
trajectory or a demonstration (the warm start trains the assistant turns only). Rows are collated by learner/batch.py.
The model has the shape of SmolLM2-135M-Instruct (30 layers, hidden 576, 49,152-token vocabulary, tied embeddings)
with random weights (`--model tiny`: the suite's tiny Llama with the same vocabulary). Each timed run is one forward
and backward of the masked policy-gradient loss through either path; the two alternate within each round and the
speed-up is the median over rounds of full's time / trained-only's (back-to-back pairs: a shared machine's load
changes between rounds, much less within one). On CPU the time is this process's CPU seconds on one thread
(time.process_time), on a GPU wall clock with torch.cuda.synchronize. Both paths' losses and gradients are checked
equal before timing. The vocabulary-sized tensor of each path (logits in fp32) is given in MiB.

    python benchmarks/trained_logits.py                 # SmolLM2's shape, one 2,048-token row, 3 rounds
    python benchmarks/trained_logits.py --quick         # the tiny model, a 512-token row, 2 rounds: seconds

The last stdout line is JSON: {"device", "model", "row_tokens", "trained_tokens", "seconds", "speedup", "logits_mib"}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, paired_ratio, print_table  # noqa: E402 - benchmarks/ is not a package

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
VOCAB = 49152
SHAPES = {
    "smollm2": ["model.hidden_size=576", "model.num_layers=30", "model.num_heads=9", "model.num_kv_heads=3",
                "model.intermediate_size=1536", "model.max_seq_len=2048"],
    "tiny": ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
             "model.intermediate_size=128", "model.max_seq_len=2048"],
}


def agent_row(row_tokens: int, trained_share: float, seed: int):  # noqa: ANN201 - a TrainBatch
    """One packed row of seeded items (64-512 tokens), each a prompt then an action of `trained_share` of it."""
    from async_rl.protocol import ADVANTAGE, LOGPROB, MASK, TOKEN, TrainItem, pack
    from learner.batch import collate_rows

    rng = np.random.default_rng(seed)
    items, total = [], 0
    while total < row_tokens:
        n = min(int(rng.integers(64, 513)), row_tokens - total)
        n = max(n, min(2, row_tokens - total))
        mask = np.zeros(n, dtype=int)
        mask[n - max(1, int(n * trained_share)):] = 1
        items.append(TrainItem(
            item_id=len(items), kind="immediate", group_id="g", trajectory_id=f"t{len(items)}",
            tokens=pack(rng.integers(3, VOCAB, n).tolist(), TOKEN), loss_mask=pack(mask.tolist(), MASK),
            advantages=pack(rng.normal(size=n).tolist(), ADVANTAGE), behaviour_logprobs=pack([-9.0] * n, LOGPROB),
            policy_versions=pack([0] * n, TOKEN)))
        total += n
    return collate_rows(items, [list(range(len(items)))], packed=True)


def measure(shape: str, row_tokens: int, trained_share: float, rounds: int) -> dict:
    import torch

    from async_rl.config_load import load_config
    from async_rl.loss import token_logprobs_and_entropy
    from async_rl.model import build_tiny_model
    from learner.logits import trained_logprobs

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = load_config(None, ["wandb.mode=disabled", *SHAPES[shape]])
    model = build_tiny_model(config.model, config.run.seed, VOCAB, 0, 1).to(device).train()
    batch = agent_row(row_tokens, trained_share, seed=0).to(device)

    def full(model, batch, temperature):  # noqa: ANN001, ANN202 - the path before learner/logits.py
        return token_logprobs_and_entropy(model(**batch.model_inputs()).logits, batch.tokens, temperature, False)

    def trained(model, batch, temperature):  # noqa: ANN001, ANN202
        return trained_logprobs(model, batch, temperature)

    paths = {"full logits": full, "trained positions": trained}

    def step(name: str) -> tuple[float, float, list]:
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        cpu, wall = time.process_time(), time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            logp, _ = paths[name](model, batch, 1.0)
        loss = -(logp * batch.advantages * batch.loss_mask).sum() / batch.loss_mask.sum()
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        took = (time.perf_counter() - wall) if cuda else (time.process_time() - cpu)
        return took, float(loss.detach()), [p.grad for p in model.parameters()]

    _, loss_full, grads_full = step("full logits")  # warm-up and the check
    _, loss_trained, grads_trained = step("trained positions")
    tolerance = 2e-2 if cuda else 1e-4
    if abs(loss_full - loss_trained) > tolerance * max(1.0, abs(loss_full)):
        raise SystemExit(f"trained positions' loss {loss_trained} != full logits' {loss_full}")
    for a, b in zip(grads_full, grads_trained, strict=True):
        if not torch.allclose(a, b, rtol=tolerance, atol=tolerance * 1e-2):
            raise SystemExit("trained positions' gradient differs from the full logits'")
    seconds = {name: [] for name in paths}
    for _ in range(rounds):
        for name in paths:
            seconds[name].append(step(name)[0])
    trained_tokens = int(batch.loss_mask.sum())
    return {
        "device": device, "model": shape, "row_tokens": row_tokens, "trained_tokens": trained_tokens,
        "seconds": {name: round(statistics.median(values), 3) for name, values in seconds.items()},
        "speedup": round(paired_ratio(seconds["full logits"], seconds["trained positions"]), 2),
        "logits_mib": {"full logits": round(row_tokens * VOCAB * 4 / 2**20, 1),
                       "trained positions": round(trained_tokens * VOCAB * 4 / 2**20, 1)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model, a 512-token row, 2 rounds")
    parser.add_argument("--model", choices=sorted(SHAPES), default=None, help="default smollm2 (quick: tiny)")
    parser.add_argument("--row-tokens", type=int, default=None, help="default 2048 (quick 512)")
    parser.add_argument("--trained-share", type=float, default=0.3, help="of each item's tokens (default 0.3)")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (quick 2)")
    args = parser.parse_args()
    if not 0 < args.trained_share <= 1:
        parser.error("--trained-share must be in (0, 1]")
    result = measure(args.model or ("tiny" if args.quick else "smollm2"),
                     args.row_tokens or (512 if args.quick else 2048), args.trained_share,
                     args.rounds or (2 if args.quick else 3))
    print_table("trained_logits: forward + backward of one packed row", ["path", "seconds (median)", "logits MiB"],
                [[name, f"{result['seconds'][name]:.3f}", f"{result['logits_mib'][name]:.1f}"]
                 for name in result["seconds"]],
                caption=f"speed-up {result['speedup']}x, {result['trained_tokens']} of {result['row_tokens']} "
                        f"tokens trained, {result['model']} on {result['device']}")
    print(json.dumps({**result, "machine": machine()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
