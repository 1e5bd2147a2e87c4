"""Advantages of docs/algorithm.md, "Final credit and correction" as pure functions. Symbols are named as in the text.

Members are indexed by their position in the group (`i`), stages by `k` (from 0 here). A reward of
`None` is an absent stage reward: 0 in returns, not counted in stage statistics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from async_rl.config import CreditMode


def normalize(values: Mapping[int, float], eps: float) -> dict[int, float]:
    """(x − mean) / (std + ε) with the population std; std = 0 gives 0 for every member (no gradient)."""
    # Equal values are std = 0 exactly: their float mean can miss them by an ulp, which ÷ ε would give ~1e-10
    if len(values) < 2 or max(values.values()) == min(values.values()):
        return {i: 0.0 for i in values}
    mean = math.fsum(values.values()) / len(values)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in values.values()) / len(values))
    return {i: (x - mean) / (std + eps) for i, x in values.items()}


def immediate_advantages(
    stage_rewards: Mapping[int, float | None], omega: float, eps: float
) -> dict[int, float]:
    """A_imm[i,k] = ω · (r[i,k] − mean_j r[j,k]) / (std_j r[j,k] + ε), over the members of one stage group.

    Members whose reward is absent get no immediate advantage. A stage group with fewer than two rewarded
    members, or with std = 0, yields nothing: no item, no entry in `issued`.
    """
    rewarded = {i: r for i, r in stage_rewards.items() if r is not None}
    if len(rewarded) < 2:
        return {}
    normalized = normalize(rewarded, eps)
    if all(a == 0.0 for a in normalized.values()):
        return {}
    return {i: omega * a for i, a in normalized.items()}


def returns_to_go(rewards: Sequence[float | None], gamma: float) -> list[float]:
    """Ret[i,k] = Σ_{k' ≥ k} γ^(k'−k) · r[i,k']."""
    ret, running = [0.0] * len(rewards), 0.0
    for k in range(len(rewards) - 1, -1, -1):
        running = (rewards[k] or 0.0) + gamma * running
        ret[k] = running
    return ret


def final_credit(
    stage_rewards: Mapping[int, Sequence[float | None]],
    outcomes: Mapping[int, float],
    credit: CreditMode,
    omega: float,
    gamma: float,
    eps: float,
) -> dict[int, list[float]]:
    """A_final[i,k] for every stage of every finished member (abandoned members are not passed in).

    A_out[i]     = (R_i − mean_j R_j) / (std_j R_j + ε)
    A_step[i,k]  = (Ret[i,k] − mean_j Ret[j,k]) / (std_j Ret[j,k] + ε), peers = members with a stage k
    A_final[i,k] = A_out[i] + ω · A_step[i,k]   ("outcome+step")   or   A_out[i]   ("outcome")

    A group of fewer than two finished members yields no final credit ({}).
    """
    members = sorted(outcomes)
    if len(members) < 2:
        return {}
    a_out = normalize({i: outcomes[i] for i in members}, eps)
    a_final = {i: [a_out[i]] * len(stage_rewards[i]) for i in members}
    if credit == "outcome":
        return a_final
    ret = {i: returns_to_go(stage_rewards[i], gamma) for i in members}
    for k in range(max(len(ret[i]) for i in members)):
        peers = {i: ret[i][k] for i in members if k < len(ret[i])}
        for i, a_step in normalize(peers, eps).items():
            a_final[i][k] = a_out[i] + omega * a_step
    return a_final
