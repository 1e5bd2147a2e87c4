"""SGLang under frequent aborting weight updates: partial rollouts against discarding and regenerating.

One real SGLang server (CPU, the tiny model; the venv from scripts/build_sglang_env.sh) and one SGLangEngine
generating batches of long actions (`--batch` prompts x `--tokens` new tokens, no stop token) back to back,
while an updater thread, every `--update-every` seconds, aborts everything running and loads the other of two
checkpoints under the next version: /pause_generation {"mode": "abort"} -> /update_weights_from_disk ->
/continue_generation (what `pause_mode: abort` does to a worker's requests). Two variants, alternated, the same
schedule for each:
  partial   rollout.sglang.partial_rollouts=true: an aborted action keeps its tokens (log-probs, versions) and
            continues from them on the new weights
  discard   partial_rollouts=false: the tokens of an aborted action are thrown away and the action starts over
Reported per variant, summed over its repeats:
  wasted     tokens the server generated and the engine threw away (percent of all generated)
  useful/s   tokens of finished actions per second of generation
  staleness  per token of a finished action: the newest version loaded when its batch returned minus the
             token's version (mean, max); "mixed" = actions whose tokens span more than one version
  preempted  rows sent again after an abort
A batch still unfinished at twice a row's time is given up (counted: discarding livelocks when updates come
faster than a batch of actions takes). `throughput_ratio` = useful tokens/s partial / discard per interval.

    python benchmarks/sglang_interrupt.py            # updates every 1 s and every 3 s, 45 s per row (~4 min)
    python benchmarks/sglang_interrupt.py --quick    # the same rows, 5 s each (~1 min)

`--url URL --model-dir DIR` measures a server already running on the model in DIR (the suite passes the one its
SGLang tests share, tests/sglang_server.py, started the same way) instead of starting one; it is left running, and
the second checkpoint is DIR's model perturbed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import OUT_DIR, REPO, emit, machine, markdown_table, pinned_env, print_table  # noqa: E402

from async_rl.config import Config, RolloutConfig, SGLangConfig  # noqa: E402
from async_rl.config_load import load_config  # noqa: E402
from async_rl.model import ensure_model_dir, load_model  # noqa: E402
from async_rl.weights.hf_dir import write_hf_dir  # noqa: E402
from rollout.engines import EngineStopped, SamplingParams  # noqa: E402
from rollout.engines.sglang import SGLangEngine  # noqa: E402
from rollout.settings import RolloutSettings  # noqa: E402

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 12, 13, 14, 15, 16, 17, 18], [1, 20, 21], [1, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(model_dir: Path, log_dir: Path) -> tuple[str, int]:
    """(url, pgid) of a fresh server on `model_dir`, once it answers /health_generate."""
    build = subprocess.run(["bash", str(REPO / "scripts" / "build_sglang_env.sh")], capture_output=True, text=True,
                           timeout=1200)
    if build.returncode != 0:
        raise SystemExit(f"scripts/build_sglang_env.sh failed: {build.stderr[-2000:]}")
    venv = build.stdout.strip().splitlines()[-1]
    port = free_port()
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "start_sglang_server.py"), "--model-path", str(model_dir), "--port",
         str(port), "--venv", venv, "--log", str(log_dir / f"sglang-{port}.log"), "--timeout", "240"],
        capture_output=True, text=True, timeout=300, env=pinned_env(),
    )
    if done.returncode != 0:
        raise SystemExit(f"the SGLang server did not start: {done.stderr[-2000:]}")
    info = json.loads(done.stdout.strip().splitlines()[-1])
    return info["url"], info["pgid"]


class Updater:
    """Every `every_s`: abort everything running on `url` and load the next checkpoint as the next version."""

    def __init__(self, url: str, paths: list[Path], every_s: float) -> None:
        self.url, self.paths, self.every_s = url, paths, every_s
        self.version = 0  # the newest version loaded (read by the generating thread)
        self.updates = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=120) as http:
            while not self.stop.wait(self.every_s):
                http.post(self.url + "/pause_generation", json={"mode": "abort"}).raise_for_status()
                try:
                    http.post(self.url + "/update_weights_from_disk", json={
                        "model_path": str(self.paths[(self.version + 1) % 2]),
                        "weight_version": str(self.version + 1)}).raise_for_status()
                    self.version += 1
                    self.updates += 1
                finally:
                    http.post(self.url + "/continue_generation", json={}).raise_for_status()


def measure(url: str, paths: list[Path], partial: bool, every_s: float, seconds: float,
            args: argparse.Namespace) -> dict:
    # Start every variant from model A at version 0, so that both see the same schedule.
    httpx.post(url + "/update_weights_from_disk", timeout=120,
               json={"model_path": str(paths[0]), "weight_version": "0"}).raise_for_status()
    stop = threading.Event()  # a batch unfinished at twice the deadline (discard can livelock) is given up
    sglang = SGLangConfig(urls=[url], request_timeout_s=120.0, partial_rollouts=partial)
    engine = SGLangEngine(RolloutSettings.from_config(Config(rollout=RolloutConfig(sglang=sglang))).engine.sglang, stop)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.tokens)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    updater = Updater(url, paths, every_s)
    useful = actions = mixed = batches = given_up = 0
    behind: list[int] = []
    updater.thread.start()
    started = time.monotonic()
    threading.Timer(2 * seconds, stop.set).start()
    while time.monotonic() - started < seconds:
        try:
            generations = engine.generate(prompts, params)
        except EngineStopped:
            given_up += 1
            break
        newest = updater.version
        batches += 1
        for g in generations:
            useful += len(g.token_ids)
            actions += 1
            mixed += len(set(g.versions)) > 1
            behind += [newest - v for v in g.versions]
    wall = time.monotonic() - started
    stop.set()
    updater.stop.set()
    updater.thread.join(120)
    engine.close()
    return {
        "wall_s": wall, "batches": batches, "batches_given_up": given_up, "actions": actions,
        "useful_tokens": useful, "mixed": mixed,
        "wasted_tokens": engine.tokens_discarded, "kept_tokens": engine.tokens_kept,
        "preempted": engine.preemptions, "updates": updater.updates,
        "staleness_sum": sum(behind), "staleness_max": max(behind, default=0), "tokens": len(behind),
    }


def merge(runs: list[dict]) -> dict:
    total = {key: sum(r[key] for r in runs) for key in runs[0] if key != "staleness_max"}
    total["staleness_max"] = max(r["staleness_max"] for r in runs)
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 s per row (past the 3 s row's first update)")
    parser.add_argument("--repeats", type=int, default=None, help="alternated repeats per row (default 1)")
    parser.add_argument("--seconds", type=float, default=None, help="generation time per row (default 45)")
    parser.add_argument("--update-every", default="1,3", help="seconds between aborting updates; a list is a row each")
    parser.add_argument("--batch", type=int, default=16, help="prompts per generate call")
    parser.add_argument("--tokens", type=int, default=200, help="new tokens per action (max_new_tokens)")
    parser.add_argument("--url", default=None,
                        help="a running SGLang server to measure instead of starting one (left running); needs "
                             "--model-dir")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="with --url: the model directory that server was started on")
    args = parser.parse_args()
    if (args.url is None) != (args.model_dir is None):
        parser.error("--url and --model-dir go together: a running server and the model it was started on")
    repeats = args.repeats or 1
    seconds = args.seconds or (5.0 if args.quick else 45.0)
    intervals = [float(x) for x in args.update_every.split(",")]
    torch.set_num_threads(1)
    out = OUT_DIR / "sglang_interrupt"
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    base = load_config(None, [f"run.dir={out}", "run.name=base"])
    model_dir = args.model_dir or ensure_model_dir(base.model, base.run_dir, base.run.seed)
    model_b = load_model(model_dir)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for parameter in model_b.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    path_b = write_hf_dir({k: v.detach().clone() for k, v in model_b.state_dict().items()}, model_dir, out / "hf-b")
    url, pgid = (args.url, None) if args.url else start_server(model_dir, out)
    results: dict[tuple[float, str], list[dict]] = {(e, n): [] for e in intervals for n in ("partial", "discard")}
    try:
        for repeat in range(repeats):
            for every_s, name in results:
                run = measure(url, [model_dir, path_b], name == "partial", every_s, seconds, args)
                results[every_s, name].append(run)
                print(f"repeat {repeat + 1}/{repeats} update every {every_s:g} s {name}: {json.dumps(run)}",
                      file=sys.stderr, flush=True)
    finally:
        if pgid is not None:
            os.killpg(pgid, signal.SIGTERM)
    columns = ["update every", "variant", "updates", "actions (batches given up)", "preempted rows",
               "tokens wasted (% of generated)", "useful tokens/s", "staleness mean / max", "mixed-version actions"]
    rows, headline = [], {}
    for (every_s, name), runs in results.items():
        t = merge(runs)
        generated = t["useful_tokens"] + t["wasted_tokens"]
        throughput = t["useful_tokens"] / t["wall_s"]
        staleness = t["staleness_sum"] / max(1, t["tokens"])
        rows.append([
            f"{every_s:g} s", name, str(t["updates"]), f"{t['actions']} ({t['batches_given_up']})",
            str(t["preempted"]), f"{t['wasted_tokens']:,} ({100 * t['wasted_tokens'] / max(1, generated):.1f}%)",
            f"{throughput:,.0f}", f"{staleness:.2f} / {t['staleness_max']}",
            f"{t['mixed']} ({100 * t['mixed'] / max(1, t['actions']):.0f}%)",
        ])
        headline[f"{name}@{every_s:g}s"] = {
            "useful_tokens_per_s": round(throughput, 1), "wasted_tokens": t["wasted_tokens"],
            "wasted_fraction": round(t["wasted_tokens"] / max(1, generated), 4), "kept_tokens": t["kept_tokens"],
            "staleness_mean": round(staleness, 3), "staleness_max": t["staleness_max"], "mixed_actions": t["mixed"],
            "actions": t["actions"], "preempted": t["preempted"], "updates": t["updates"],
            "batches_given_up": t["batches_given_up"],
        }
    command = "python benchmarks/sglang_interrupt.py" + (" --quick" if args.quick else "")
    caption = (f"{repeats} x {seconds:g} s per row, {args.batch} x {args.tokens} tokens per batch, "
               f"load average {info['load_avg_1m_at_start']} at the start")
    print_table("partial rollouts vs discard under aborting weight updates", columns, rows, caption)
    (out / "table.md").write_text(markdown_table(columns, rows, command) + f"\n{caption}\n")
    ratios = {}
    for every_s in intervals:
        kept, discarded = headline[f"partial@{every_s:g}s"], headline[f"discard@{every_s:g}s"]
        ratios[f"{every_s:g}s"] = (round(kept["useful_tokens_per_s"] / discarded["useful_tokens_per_s"], 3)
                                   if discarded["useful_tokens_per_s"] else None)  # None: discard finished nothing
    emit({"variants": headline, "throughput_ratio": ratios, "machine": info})
    return 0


if __name__ == "__main__":
    sys.exit(main())
