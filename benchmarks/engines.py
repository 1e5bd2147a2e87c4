"""The quick start on each rollout engine: `async-rl train` on the same task and model with `rollout.engine` torch (the
built-in sampler), sglang and vllm (one real CPU server each), the runs interleaved round by round.

The task is the packaged default (the trap environment, target 0.8) on the tiny model with vLLM-sized heads
(`model.num_heads=2 model.num_kv_heads=1`: vLLM's CPU attention has no kernel for the default's head dimension of
16), built once and given to every run as `model.path`, so the three engines start from the same weights. Each
server engine's server is started once (scripts/start_sglang_server.py, scripts/start_vllm_server.py, their venvs
built by scripts/build_*_env.sh when missing) and set back to the version-0 weights before each of its runs; its
start-up is reported apart and is not in a run's time. Every server stays up through every run (an idle server
takes a few percent of a core), so all runs meet the same machine. Reported: per engine the median and range of
the wall time from the command to its exit, the summary line's figures, and each server engine's time ÷ the
built-in engine's, round by round.

    python benchmarks/engines.py                  # 3 rounds (docs/results.md, "Rollout engines")
    python benchmarks/engines.py --quick          # 1 round of 3 versions (the script runs end to end)
    python benchmarks/engines.py --engines torch,vllm --runs 5
    # servers already running on a model directory of that shape (the script resets them to its weights)
    python benchmarks/engines.py --engines torch,vllm --url vllm=http://127.0.0.1:8000 --model-dir DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import OUT_DIR, emit, machine, print_table  # noqa: E402
from quick_start import one_run  # noqa: E402

from async_rl.config_load import load_config  # noqa: E402
from rollout.prepare import prepare_model_dir  # noqa: E402
from rollout.settings import RolloutSettings  # noqa: E402

MODEL = ["model.num_heads=2", "model.num_kv_heads=1"]  # head dimension 32: a size vLLM's CPU kernels have
ENGINES = ("torch", "sglang", "vllm")
START = {"sglang": ("build_sglang_env.sh", "start_sglang_server.py"),
         "vllm": ("build_vllm_env.sh", "start_vllm_server.py")}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(engine: str, model_dir: Path, log_dir: Path) -> dict:
    """{"url", "pgid", "startup_s"} of a fresh server of `engine` on `model_dir` once it serves."""
    build_script, start_script = START[engine]
    build = subprocess.run(["bash", str(REPO / "scripts" / build_script)], capture_output=True, text=True,
                           timeout=1800)
    if build.returncode != 0:
        raise SystemExit(f"scripts/{build_script} failed: {build.stderr[-2000:]}")
    venv, port = build.stdout.strip().splitlines()[-1], free_port()
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / start_script), "--model-path", str(model_dir), "--port", str(port),
         "--venv", venv, "--log", str(log_dir / f"{engine}-{port}.log"), "--timeout", "400"],
        capture_output=True, text=True, timeout=450)
    if done.returncode != 0:
        raise SystemExit(f"the {engine} server did not start: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def reset(engine: str, url: str, model_dir: Path) -> None:
    """The server back on the version-0 weights, labelled "0" (what a fresh run expects to find)."""
    with httpx.Client(base_url=url, timeout=120) as http:
        if engine == "sglang":
            http.post("/update_weights_from_disk",
                      json={"model_path": str(model_dir), "weight_version": "0"}).raise_for_status()
            return
        http.post("/pause", params={"mode": "abort"}).raise_for_status()
        try:
            http.post("/collective_rpc", json={"method": "reload_weights",
                                               "kwargs": {"weights_path": str(model_dir)}}).raise_for_status()
            http.post("/update_weight_version", json={"new_version": "0"}).raise_for_status()
        finally:
            http.post("/resume").raise_for_status()


def engine_overrides(engine: str, url: str | None) -> list[str]:
    return ["rollout.engine=" + engine, *([f"rollout.{engine}.urls=[{url}]"] if url else [])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="rounds (each engine once per round)")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--quick", action="store_true", help="one round of 3 versions, no evaluation")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    parser.add_argument("--url", action="append", default=[], metavar="ENGINE=URL",
                        help="a running server of ENGINE to use instead of starting one (left running)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="the model directory those servers were started on (default: built here)")
    args = parser.parse_args()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if bad := [e for e in engines if e not in ENGINES]:
        parser.error(f"--engines: unknown {bad[0]!r} (expected some of {', '.join(ENGINES)})")
    if args.runs < 1:
        parser.error(f"--runs: expected >= 1, got {args.runs}")
    given = dict(u.split("=", 1) for u in args.url if "=" in u)
    if len(given) != len(args.url) or set(given) - set(START):
        parser.error(f"--url: expected ENGINE=URL with ENGINE sglang or vllm, got {args.url}")
    if given and args.model_dir is None:
        parser.error("--url: give the servers' --model-dir too (every engine must start from the same weights)")
    runs, task = (1, ["run.max_versions=3", "run.target_success=null", "run.eval_samples_per_task=0"]) \
        if args.quick else (args.runs, [])
    out = OUT_DIR / "engines"
    out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir or prepare_model_dir(
        RolloutSettings.from_config(load_config(None, [f"run.dir={out}", "run.name=base", *MODEL])).model_dir)
    servers: dict[str, dict] = {engine: {"url": url, "pgid": None, "startup_s": None} for engine, url in given.items()}
    try:
        for engine in engines:
            if engine != "torch" and engine not in servers:
                servers[engine] = start_server(engine, model_dir, out)
                print(f"{engine} server up in {servers[engine]['startup_s']:.0f} s", flush=True)
        results: dict[str, list[dict]] = {engine: [] for engine in engines}
        for n in range(1, runs + 1):
            for engine in engines:
                url = servers.get(engine, {}).get("url")
                if url:
                    reset(engine, url, model_dir)
                overrides = [f"model.path={model_dir}", *MODEL, *task, *engine_overrides(engine, url)]
                result = one_run(out / engine, n, overrides, args.timeout_s)
                results[engine].append(result)
                print(f"round {n} {engine}: {result['wall_s']:.1f} s, final success "
                      f"{result['final_success_rate']}, {result['versions']} versions", flush=True)
    finally:
        for server in servers.values():
            if server["pgid"] is not None:  # started here
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server["pgid"], signal.SIGTERM)
        time.sleep(2)
    cmd = "python benchmarks/engines.py" + (" --quick" if args.quick else f" --runs {runs}") + (
        f" --engines {args.engines}" if args.engines != ",".join(ENGINES) else "") + "".join(
        f" --url {u}" for u in args.url) + (f" --model-dir {args.model_dir}" if args.model_dir else "")
    columns = ["engine", "server start s", "median wall s", "range s", "÷ torch (median, range)", "final success",
               "versions"]
    rows, summary = [], {"machine": machine(), "command": cmd, "engines": {}}
    base = [r["wall_s"] for r in results.get("torch", [])]
    for engine in engines:
        walls = [r["wall_s"] for r in results[engine]]
        ratios = sorted(w / b for w, b in zip(walls, base, strict=True)) if base and engine != "torch" else []
        startup = servers.get(engine, {}).get("startup_s")
        rows.append([engine, f"{startup:.0f}" if startup is not None else "-",
                     f"{statistics.median(walls):.1f}", f"{min(walls):.1f}–{max(walls):.1f}",
                     f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}–{ratios[-1]:.2f})" if ratios else "-",
                     " ".join(f"{r['final_success_rate']:.2f}" for r in results[engine]),
                     " ".join(str(r["versions"]) for r in results[engine])])
        summary["engines"][engine] = {"runs": results[engine], "wall_s_median": statistics.median(walls),
                                      "ratio_to_torch": ratios,
                                      "server_startup_s": servers.get(engine, {}).get("startup_s")}
    print_table(f"the quick start's task on each engine, {runs} round(s)", columns, rows)
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
