"""The coding environment's sandbox: executions per second, and the judge's latency on HumanEval.

Measured through the real code paths (no training run):
  executions/s   `Sandbox.run` of HumanEval/0's canonical solution against its 2 visible tests, each a fresh
                 isolated process: serially (1 thread), and from `--concurrency` threads at the sandbox's limit
                 of the same number of concurrent executions; for both isolation modes ("auto": namespaces + uid
                 here; "basic": the no-namespace fallback)
  judge latency  `CodingEnv.judge()` (judge_delay_s=0) on every HumanEval canonical solution, one at a time:
                 median, p90, max; and how many of the 164 the judge passes (and how many pass all their
                 visible tests: the visible tests derived from docstrings must agree with the solutions)

    python benchmarks/sandbox.py            # 100 + 200 executions per mode, all 164 problems (~1 min on 2 cores)
    python benchmarks/sandbox.py --quick    # 10 + 20 executions, the auto mode, 16 problems (~10 s)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import console, emit, machine, markdown_table, print_table  # noqa: E402 - benchmarks/ is not a package

from rollout.envs.coding import factory  # noqa: E402
from rollout.sandbox import Sandbox, Test  # noqa: E402


def executions_per_second(sandbox: Sandbox, code: str, tests: list[Test], setup: str, n: int, threads: int) -> float:
    def one(_):
        result = sandbox.run(code, tests, setup=setup)
        if result.passed != len(tests):
            raise RuntimeError(f"the canonical solution failed in the sandbox: {result}")
        return result

    sandbox.run(code, tests, setup=setup)  # warm the page cache
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(n)))
    return n / (time.perf_counter() - start)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short form (~10 s)")
    parser.add_argument("--concurrency", type=int, default=4, help="the sandbox's limit (the env's default: 4)")
    args = parser.parse_args()
    n_serial, n_concurrent, n_problems = (10, 20, 16) if args.quick else (100, 200, 164)
    modes = ["auto"] if args.quick else ["auto", "basic"]
    info = machine()

    env_factory = factory(max_concurrent_executions=args.concurrency, eval_fraction=0.0)
    tasks = sorted(env_factory.tasks("train"), key=lambda t: int(t.id.split("/")[1]))
    first = tasks[0].data
    tests = [Test(f"visible {i}", s) for i, s in enumerate(first["visible_tests"])]
    rows = []
    headline: dict[str, float | int | str] = {}
    isolation = {}
    for mode in modes:
        sandbox = Sandbox(env_factory.limits, max_concurrent=args.concurrency, isolation=mode)
        isolation[mode] = "+".join(sandbox.run(first["canonical_solution"], tests, setup=first["setup"]).isolation)
        console.print(f"[{mode}] executions, serial then {args.concurrency} threads ...")
        serial = executions_per_second(sandbox, first["canonical_solution"], tests, first["setup"], n_serial, 1)
        parallel = executions_per_second(
            sandbox, first["canonical_solution"], tests, first["setup"], n_concurrent, args.concurrency
        )
        rows.append([f"executions/s, serial ({mode}: {isolation[mode]})", f"{serial:.1f}"])
        rows.append([f"executions/s, {args.concurrency} concurrent ({mode})", f"{parallel:.1f}"])
        headline[f"exec_per_s_serial_{mode}"] = round(serial, 2)
        headline[f"exec_per_s_concurrent_{mode}"] = round(parallel, 2)

    console.print(f"judging {n_problems} canonical solutions ...")
    latencies, judged_ok, visible_ok, failures = [], 0, 0, []
    for task in tasks[:n_problems]:
        env = env_factory.make()
        env.reset(task)
        step = env.step(f"```python\n{task.data['canonical_solution']}\n```")
        visible_ok += step.reward == 1.0
        start = time.perf_counter()
        judgement = env.judge()
        latencies.append(time.perf_counter() - start)
        judged_ok += judgement.success
        if not judgement.success or step.reward != 1.0:
            failures.append(task.id)
    rows.append([f"judge latency median / p90 / max ({n_problems} problems, serial)", ""])
    rows[-1][1] = " / ".join(f"{1000 * x:.0f} ms" for x in (statistics.median(latencies), percentile(latencies, 0.9)))
    rows[-1][1] += f" / {1000 * max(latencies):.0f} ms"
    rows.append(["canonical solutions judged successful", f"{judged_ok}/{n_problems}"])
    rows.append(["canonical solutions passing all visible tests", f"{visible_ok}/{n_problems}"])
    headline.update(
        judge_median_ms=round(1000 * statistics.median(latencies), 1),
        judge_p90_ms=round(1000 * percentile(latencies, 0.9), 1),
        judge_max_ms=round(1000 * max(latencies), 1),
        judged_ok=judged_ok,
        visible_ok=visible_ok,
        problems=n_problems,
        failures=",".join(failures),
    )
    caption = (
        f"{info['date']}, {info['cpus']} CPUs, Python {info['python']}, load {info['load_avg_1m_at_start']} at start"
    )
    print_table("Sandbox throughput and judge latency", ["what", "measured"], rows, caption)
    command = "python benchmarks/sandbox.py" + (" --quick" if args.quick else "")
    print(markdown_table(["what", "measured"], rows, command))
    emit({**headline, **info})
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
