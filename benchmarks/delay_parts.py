"""benchmarks/delay.py's tabulation: run names, success at fixed wall times, best settings and bounded ratios."""

from __future__ import annotations

import math
from collections.abc import Iterable

from common import fmt, median_or_none, ratio

WALL_FRACTIONS = (0.25, 0.5, 0.75, 1.0)  # where each run's success is read, as fractions of --max-wall-s


def setting_key(lr: float, scale: float) -> str:
    """A run's lr (and batch scale, where not 1) in its key: lr0.0005, lr0.0005-b0.25."""
    return f"lr{lr:g}" if scale == 1 else f"lr{lr:g}-b{scale:g}"


def run_key(traps: int | str, d: float, arm: str, lr: float, scale: float, seed: int) -> str:
    """A run's name: its folder and its file in done/ (what --reuse matches), e.g.
    hunt-D0-outcome-only+step-lr0.0005-seed0."""
    return f"{label(traps)}-D{d:g}-{arm}-{setting_key(lr, scale)}-seed{seed}"


def label(traps: int | str) -> str:
    """A setting's name in run keys and result cells: traps2, traps0, hunt."""
    return "hunt" if traps == "hunt" else f"traps{traps}"


def wall_marks(max_wall_s: float) -> list[float]:
    """The wall times at which every run's success is read: WALL_FRACTIONS of the cap."""
    return [round(f * max_wall_s, 1) for f in WALL_FRACTIONS]


def success_at_walls(lines: list[dict], marks: list[float]) -> dict[str, float]:
    """`success_rate_long` (the stop rule's window) of the run's last metrics line at or before each wall time, keyed
    by the time in seconds ("150" for 150.0 s): 0 before its first line; a run that stopped earlier (at 0.8, or its
    env-step budget) keeps its last value. A run that misses 0.8 within the cap shows as a curve, not only a miss."""
    curve = {}
    for mark in marks:
        before = [m for m in lines if m.get("wall_s", math.inf) <= mark]
        curve[f"{mark:g}"] = round(before[-1].get("success_rate_long", 0.0), 3) if before else 0.0
    return curve


def spread_at_walls(runs: list[dict], marks: list[float]) -> dict[str, dict | None]:
    """Per wall time: the median, min and max over the runs of their success there (None where no run has it)."""
    spread: dict[str, dict | None] = {}
    for mark in marks:
        key = f"{mark:g}"
        values = [m["success_at_wall"][key] for m in runs if key in (m.get("success_at_wall") or {})]
        spread[key] = ({"median": median_or_none(values), "min": min(values), "max": max(values)} if values
                       else None)
    return spread


def held_too_long(runs: Iterable[dict], share: float = 0.25) -> list[str]:
    """The runs whose guard held the learner over `share` of their wall time. The bound counts learner versions:
    an arm that also steps on immediate items spans ~3x the versions per judge delay (docs/results.md, "delay"),
    so a bound sized from D throttles it and its wall time measures the bound, not the rule."""
    return [run_key(m["traps"], m["d"], m["arm"], m["lr"], m.get("batch_scale", 1.0), m["seed"]) for m in runs
            if m.get("guard_held_s") and m.get("wall_s") and m["guard_held_s"] > share * m["wall_s"]]


def at_least(runs: list[dict], reached: str, end: str) -> float | None:
    """The median over seeds of `reached` (env steps or wall s to 0.8), a run that missed counted at its `end`:
    a lower bound on the true median, where that one is past the cap."""
    values = [m[reached] if m.get(reached) is not None else m.get(end) for m in runs]
    return None if not values or None in values else median_or_none(values)


def best_setting(per_setting: dict[tuple[float, float], dict]) -> tuple[float, float]:
    """An arm's best (lr, batch scale): the fewest median env steps to 0.8; where no setting's median reached it, the
    lowest bound on it (misses counted at their end), so the ratio is bounded with the setting most favourable to
    that arm (then the higher success at the end)."""
    def key(setting: tuple[float, float]) -> tuple[bool, float, float]:
        cell = per_setting[setting]
        steps = cell["env_steps"] if cell["env_steps"] is not None else cell["env_steps_at_least"]
        return cell["env_steps"] is None, math.inf if steps is None else steps, -(cell["final_success"] or 0.0)
    return min(per_setting, key=key)


def staleness_summary(runs: list[dict]) -> dict:
    """One `algo.max_staleness` value of the baseline's sweep: its runs' median wall s and env steps to 0.8 (a miss
    counted as infinite) and their median success at the end of their (short) cap."""
    return {"wall_s": median_or_none([m.get("wall_s_to_target") for m in runs]),
            "env_steps": median_or_none([m.get("env_steps_to_target") for m in runs]),
            "reached": sum(m.get("env_steps_to_target") is not None for m in runs), "seeds": len(runs),
            "final_success": median_or_none([m.get("final_success_long") for m in runs])}


def best_staleness(sweep: dict[int, dict]) -> int:
    """The baseline's best `algo.max_staleness` of a sweep: the fewest median wall seconds to 0.8 (admission sets how
    much is generated while outcomes are pending, i.e. the pace in wall time), a miss counted as infinite; where
    no value's median reached 0.8, the highest median success at the sweep's cap; then the smaller value."""
    def key(value: int) -> tuple[float, float, int]:
        cell = sweep[value]
        return (math.inf if cell["wall_s"] is None else cell["wall_s"], -(cell["final_success"] or 0.0), value)
    return min(sweep, key=key)


def censored(ours: dict, theirs: dict, key: str) -> tuple[float | None, float | None]:
    """(at most, at least) for ours ÷ theirs in `key` (env_steps or wall_s) where one median missed 0.8 and the
    other did not: the one that missed counted at its runs' end gives an upper bound (theirs missed) or a lower
    bound (ours missed) on the ratio. (None, None) where both reached or both missed."""
    if ours[key] is not None and theirs[key] is None:
        return ratio(ours[key], theirs[f"{key}_at_least"]), None
    if ours[key] is None and theirs[key] is not None:
        return None, ratio(ours[f"{key}_at_least"], theirs[key])
    return None, None


def bounds(ours: dict, theirs: dict) -> dict[str, float | None]:
    steps_most, steps_least = censored(ours, theirs, "env_steps")
    wall_most, wall_least = censored(ours, theirs, "wall_s")
    return {"env_steps_at_most": steps_most, "wall_s_at_most": wall_most, "env_steps_at_least": steps_least,
            "wall_s_at_least": wall_least}


def ratio_text(cell: str, r: dict) -> str:
    text = (f"{cell} {fmt(r['env_steps'], '.2f', 'n/a')}, {fmt(r['wall_s'], '.2f', 'n/a')}; "
            f"{fmt(r['env_steps_half'], '.2f', 'n/a')}, {fmt(r['wall_s_half'], '.2f', 'n/a')}")
    if r.get("env_steps_at_most") is not None:
        text += (f" (outcome-only+step's median missed 0.8: at most {fmt(r['env_steps_at_most'], '.2f')}, "
                 f"{fmt(r['wall_s_at_most'], '.2f', 'n/a')}, its misses counted at their end)")
    if r.get("env_steps_at_least") is not None:
        text += (f" (immediate+correction's median missed 0.8: at least {fmt(r['env_steps_at_least'], '.2f')}, "
                 f"{fmt(r['wall_s_at_least'], '.2f', 'n/a')}, its misses counted at their end)")
    return text


def setting_cell(runs: list[dict], marks: list[float]) -> dict:
    """One arm's figures at one (lr, batch scale) over its seeds: medians (a miss infinite), counts, bounds."""
    return {
        "env_steps": median_or_none([m["env_steps_to_target"] for m in runs]),
        "wall_s": median_or_none([m["wall_s_to_target"] for m in runs]),
        "reached": sum(m["env_steps_to_target"] is not None for m in runs),
        "seeds": len(runs),
        "max_staleness": sorted({m.get("max_staleness") for m in runs}, key=str),
        "d_measured": median_or_none([m["d_measured"] for m in runs]),
        "d_from_updates": median_or_none([m.get("d_from_updates") for m in runs]),
        "credit_dropped": sum(m["credit_dropped"] for m in runs),
        "guard_held_s": median_or_none([m["guard_held_s"] for m in runs]),
        "bound_needed": median_or_none([m.get("bound_needed") for m in runs]),
        "reached_half": sum(m.get("env_steps_to_half") is not None for m in runs),
        "env_steps_half": median_or_none([m.get("env_steps_to_half") for m in runs]),
        "wall_s_half": median_or_none([m.get("wall_s_to_half") for m in runs]),
        "final_success": median_or_none([m.get("final_success_long") for m in runs]),
        # success at fixed wall times (WALL_FRACTIONS of the cap): a capped miss as a curve
        "success_at_wall": spread_at_walls(runs, marks),
        # a run that missed counted at its end: a lower bound on the median to 0.8
        "env_steps_at_least": at_least(runs, "env_steps_to_target", "env_steps_end"),
        "wall_s_at_least": at_least(runs, "wall_s_to_target", "wall_s"),
    }


def tabulate(result: dict, traps_list: list, ds: list[float], arms: list[str],
             settings: list[tuple[float, float]], marks: list[float]) -> list[list[str]]:
    """Fills result["best"] (each arm at its best setting, per cell) and result["ratios"] (immediate+correction ÷
    outcome-only+step, best against best); returns the table's rows."""
    rows = []
    for traps in traps_list:
        for d in ds:
            best: dict[str, dict] = {}
            for arm in arms:
                per_setting = {}
                for lr, scale in settings:
                    runs = [m for m in result["runs"].values()
                            if (m["traps"], m["d"], m["arm"], m["lr"], m.get("batch_scale", 1.0))
                            == (traps, d, arm, lr, scale)]
                    per_setting[lr, scale] = setting_cell(runs, marks)
                lr_best, scale_best = best_setting(per_setting)
                best[arm] = {"lr": lr_best, "batch_scale": scale_best, **per_setting[lr_best, scale_best],
                             "per_setting": {setting_key(*k): v for k, v in per_setting.items()}}
                b = best[arm]
                rows.append([str(traps), f"{d:g}", fmt(b["d_measured"], ".1f", "n/a"),
                             fmt(b["d_from_updates"], ".1f", "n/a"), arm, f"{lr_best:g}", f"{scale_best:g}",
                             ",".join(str(v) for v in b["max_staleness"]),
                             f"{b['reached']}/{b['seeds']}", fmt(b["env_steps"], ",.0f"), fmt(b["wall_s"], ".0f"),
                             f"{b['reached_half']}/{b['seeds']}", fmt(b["env_steps_half"], ",.0f"),
                             fmt(b["wall_s_half"], ".0f"), fmt(b["final_success"], ".2f", "n/a"),
                             str(b["credit_dropped"]), fmt(b["guard_held_s"], ".0f", "n/a"),
                             fmt(b["bound_needed"], ".0f", "n/a")])
            cell = f"{label(traps)}-D{d:g}"
            result["best"][cell] = best
            if {"immediate+correction", "outcome-only+step"} <= best.keys():
                ours, theirs = best["immediate+correction"], best["outcome-only+step"]
                result["ratios"][cell] = {"env_steps": ratio(ours["env_steps"], theirs["env_steps"]),
                                          "wall_s": ratio(ours["wall_s"], theirs["wall_s"]),
                                          "env_steps_half": ratio(ours["env_steps_half"], theirs["env_steps_half"]),
                                          "wall_s_half": ratio(ours["wall_s_half"], theirs["wall_s_half"]),
                                          # where one arm's median missed 0.8 within the cap: bounds, its misses
                                          # counted at their end
                                          **bounds(ours, theirs)}
    return rows


def columns() -> list[str]:
    return ["traps (or env)", "D asked", "D measured", "judge delay × updates/s", "arm", "best lr", "batch scale",
            "max_staleness", "reached", "env steps to 0.8", "wall s to 0.8", "reached 0.5", "env steps to 0.5",
            "wall s to 0.5", "success at end", "credit dropped", "guard held s", "bound needed"]


def curve_table(result: dict, marks: list[float]) -> tuple[list[str], list[list[str]]]:
    """The second table: per cell and arm (at its best setting), success over the stop rule's window at each fixed
    wall time, median (min–max) over seeds: where an arm misses 0.8 within the cap, how far it got and when."""
    header = ["cell", "arm", "max_staleness", "seeds", *(f"success at {m:g} s" for m in marks)]
    rows = [[cell, arm, ",".join(str(v) for v in b["max_staleness"]), str(b["seeds"]),
             *("n/a" if s is None else f"{s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f})"
               for s in b["success_at_wall"].values())]
            for cell, best in result["best"].items() for arm, b in best.items()]
    return header, rows


def sweep_text(cell: str, sweep: dict) -> str:
    """The caption's account of one cell's max_staleness sweep: each value's median wall s to 0.8 or success at the
    sweep's cap, and the one chosen."""
    per_value = ", ".join(f"{v}: {fmt(s['wall_s'], '.0f', 'missed')}"
                          + ("" if s["wall_s"] is not None else f" ({fmt(s['final_success'], '.2f', 'n/a')} at cap)")
                          for v, s in sweep["per_value"].items())
    return (f"{cell} outcome-only+step at max_staleness {sweep['chosen']} (swept {sweep['seeds']} seed(s) x "
            f"{sweep['max_wall_s']:g} s, wall s to 0.8: {per_value})")
