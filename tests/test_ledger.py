"""The credit ledger (docs/algorithm.md): after finalization every stage's trained credit equals A_final."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from async_rl.advantages import final_credit, immediate_advantages, normalize, returns_to_go
from async_rl.config import AlgoConfig
from async_rl.ledger import ZERO_CORRECTION, GroupLedger

EPS = 1e-6


def reference_final_credit(rewards, outcomes, credit, omega, gamma):
    """An independent numpy transcription of docs/algorithm.md, "Final credit and correction"'s final credit."""
    members = sorted(outcomes)
    if len(members) < 2:
        return {}

    def norm(x):
        x = np.asarray(x, dtype=np.float64)
        std = x.std()
        return np.zeros_like(x) if std == 0 else (x - x.mean()) / (std + EPS)

    a_out = dict(zip(members, norm([outcomes[i] for i in members]), strict=True))
    result = {}
    ret = {}
    for i in members:
        r = np.array([0.0 if v is None else v for v in rewards[i]])
        ret[i] = np.array([sum(gamma ** (j - k) * r[j] for j in range(k, len(r))) for k in range(len(r))])
    for k in range(max(len(rewards[i]) for i in members)):
        peers = [i for i in members if k < len(rewards[i])]
        a_step = dict(zip(peers, norm([ret[i][k] for i in peers]), strict=True))
        for i in peers:
            result[(i, k)] = a_out[i] + (omega * a_step[i] if credit == "outcome+step" else 0.0)
    return result


reward = st.one_of(st.none(), st.sampled_from([0.0, 0.5, 1.0]), st.floats(-3, 3, allow_nan=False))


@st.composite
def groups(draw):
    size = draw(st.integers(2, 16))
    members = []
    for _ in range(size):
        stages = draw(st.integers(1, 8))
        members.append(
            {
                "rewards": draw(st.lists(reward, min_size=stages, max_size=stages)),
                "outcome": draw(st.one_of(st.sampled_from([0.0, 1.0]), st.floats(-2, 2, allow_nan=False))),
                "abandoned": draw(st.booleans()) and draw(st.booleans()),  # ~25%
            }
        )
    drop = draw(st.lists(st.booleans(), min_size=size * 8, max_size=size * 8))  # immediates dropped as stale
    return members, drop


def run_group(members, drop, algo):
    """Drive a ledger the way the replay service does; return it and every item's (stage, advantage, kind)."""
    ledger = GroupLedger(len(members))
    for i, m in enumerate(members):
        for k, r in enumerate(m["rewards"]):
            ledger.add_stage(i, k, r, terminal=k == len(m["rewards"]) - 1)
    items = []
    for k in range(8):
        assert ledger.stage_group_complete(k)
        for i, a_imm in ledger.immediate(k, algo).items():
            items.append(((i, k), a_imm, "immediate"))
            if not drop[i * 8 + k]:
                ledger.record_trained(i, k, a_imm, immediate=True)
    for i, m in enumerate(members):
        if m["abandoned"]:
            ledger.abandon(i)
        else:
            ledger.add_outcome(i, m["outcome"], len(m["rewards"]))
    assert ledger.outcomes_complete()
    ledger.finalize(algo)
    for (i, k), c in ledger.corrections().items():
        items.append(((i, k), c, "correction"))
        ledger.record_trained(i, k, c, immediate=False)
    return ledger, items


@settings(max_examples=300, deadline=None)
@given(groups(), st.sampled_from(["outcome+step", "outcome"]), st.sampled_from([1.0, 0.5]), st.sampled_from([0.95, 1]))
def test_trained_credit_equals_final_credit_with_corrections(group, credit, omega, gamma):
    members, drop = group
    algo = AlgoConfig(updates="immediate+correction", credit=credit, omega=omega, gamma=gamma)
    ledger, items = run_group(members, drop, algo)
    finished = {i: m for i, m in enumerate(members) if not m["abandoned"]}
    expected = reference_final_credit(
        {i: m["rewards"] for i, m in finished.items()}, {i: m["outcome"] for i, m in finished.items()},
        credit, omega, gamma,
    )
    assert ledger.a_final.keys() == expected.keys()
    for stage, a_final in expected.items():
        assert ledger.a_final[stage] == pytest.approx(a_final, abs=1e-9)
        trained = sum(a for s, a, _ in items if s == stage and (_ == "correction" or not drop[s[0] * 8 + s[1]]))
        # A correction within ZERO_CORRECTION of zero is not sent (by design), so that is the residual's bound.
        assert trained == pytest.approx(a_final, abs=ZERO_CORRECTION + 1e-12)
    assert max(ledger.residuals(), default=0.0) <= ZERO_CORRECTION + 1e-12
    abandoned = {i for i, m in enumerate(members) if m["abandoned"]}
    assert not any(kind == "correction" and s[0] in abandoned for s, _, kind in items)
    if len(finished) < 2:
        assert not any(kind == "correction" for _, _, kind in items)


@settings(max_examples=150, deadline=None)
@given(groups())
def test_outcome_only_trains_no_immediate_and_corrects_by_exactly_a_final(group):
    members, drop = group
    algo = AlgoConfig(updates="outcome-only")
    ledger, items = run_group(members, drop, algo)
    assert not any(kind == "immediate" for _, _, kind in items)
    corrections = {s: a for s, a, kind in items if kind == "correction"}
    for stage, a_final in ledger.a_final.items():
        assert corrections.get(stage, 0.0) == pytest.approx(a_final, abs=1e-8)


@settings(max_examples=150, deadline=None)
@given(groups())
def test_immediate_only_produces_no_corrections(group):
    members, drop = group
    ledger, items = run_group(members, drop, AlgoConfig(updates="immediate-only"))
    assert not any(kind == "correction" for _, _, kind in items)


def test_stale_immediate_leaves_issued_zero_so_the_correction_carries_it_all():
    algo = AlgoConfig()
    members = [{"rewards": [1.0], "outcome": 1.0, "abandoned": False}, {"rewards": [0.0], "outcome": 0.0,
                                                                        "abandoned": False}]
    ledger, items = run_group(members, [True] * 16, algo)
    corrections = {s: a for s, a, kind in items if kind == "correction"}
    assert corrections[(0, 0)] == pytest.approx(ledger.a_final[(0, 0)])
    assert ledger.issued == {}


def test_group_whose_corrections_are_all_zero_sends_none():
    algo = AlgoConfig(credit="outcome")
    # Same stage rewards and outcomes as the immediate: A_imm = A_out exactly, so C = 0 everywhere.
    members = [{"rewards": [1.0], "outcome": 1.0, "abandoned": False}, {"rewards": [0.0], "outcome": 0.0,
                                                                        "abandoned": False}]
    ledger, items = run_group(members, [False] * 16, algo)
    assert [kind for _, _, kind in items] == ["immediate", "immediate"]
    assert ledger.corrections() == {}


def test_resent_stage_is_not_recorded_twice():
    ledger = GroupLedger(2)
    assert ledger.add_stage(0, 0, 1.0, terminal=False)
    assert not ledger.add_stage(0, 0, 1.0, terminal=False)


def test_stage_group_waits_for_members_that_may_still_reach_the_stage():
    ledger = GroupLedger(3)
    ledger.add_stage(0, 0, 1.0, terminal=True)
    ledger.add_stage(1, 0, 0.0, terminal=False)
    assert not ledger.stage_group_complete(0)  # member 2 has not reported stage 0
    ledger.add_stage(2, 0, 0.0, terminal=False)
    assert ledger.stage_group_complete(0)
    ledger.add_stage(1, 1, 1.0, terminal=True)
    assert not ledger.stage_group_complete(1)  # member 2 may still produce stage 1
    ledger.abandon(2)
    assert ledger.stage_group_complete(1)  # member 0 ended before stage 1, member 2 was abandoned


# --- the formulas themselves, on numbers worked by hand ---------------------------------------------------


def test_immediate_advantage_by_hand():
    # rewards 1, 0: mean 0.5, population std 0.5 → ±1/(0.5+ε)·0.5 = ±(1 − 2ε) approximately
    a = immediate_advantages({0: 1.0, 1: 0.0, 2: None}, omega=1.0, eps=EPS)
    assert set(a) == {0, 1}
    assert a[0] == pytest.approx(0.5 / (0.5 + EPS)) and a[1] == pytest.approx(-0.5 / (0.5 + EPS))


def test_zero_std_and_lone_members_give_no_immediate_advantage():
    assert immediate_advantages({0: 1.0, 1: 1.0}, 1.0, EPS) == {}
    assert immediate_advantages({0: 1.0, 1: None}, 1.0, EPS) == {}
    assert normalize({0: 2.0, 1: 2.0}, EPS) == {0: 0.0, 1: 0.0}


def test_equal_values_whose_float_mean_misses_them_give_exactly_zero():
    # (3.3 + 3.3 + 3.3) / 3 is 3.3 plus an ulp: ÷ ε that was a 4.4e-10 advantage, an item of nothing, and a
    # correction below ZERO_CORRECTION left unsent (the chaos soak's worst ledger residual, docs/results.md)
    assert math.fsum([3.3] * 3) / 3 != 3.3
    assert normalize({0: 3.3, 1: 3.3, 2: 3.3}, EPS) == {0: 0.0, 1: 0.0, 2: 0.0}
    assert immediate_advantages({0: 3.3, 1: 3.3, 2: 3.3}, 1.0, EPS) == {}
    stages = final_credit({0: [3.3], 1: [3.3], 2: [3.3]}, {0: 1.0, 1: 1.0, 2: 1.0}, "outcome+step", 1.0, 0.95, EPS)
    assert stages == {0: [0.0], 1: [0.0], 2: [0.0]}


def test_returns_to_go_by_hand():
    assert returns_to_go([1.0, None, 2.0], 0.5) == pytest.approx([1.0 + 0.25 * 2.0, 1.0, 2.0])


def test_final_credit_by_hand():
    rewards = {0: [1.0, 1.0], 1: [0.0]}
    outcomes = {0: 1.0, 1: 0.0}
    out = final_credit(rewards, outcomes, "outcome", 1.0, 0.95, EPS)
    assert out[0] == pytest.approx([1.0, 1.0], abs=1e-5) and out[1] == pytest.approx([-1.0], abs=1e-5)
    both = final_credit(rewards, outcomes, "outcome+step", 1.0, 0.95, EPS)
    # stage 0: Ret = 1.95 vs 0 → A_step = ±1; stage 1: member 0 alone → A_step = 0
    assert both[0] == pytest.approx([2.0, 1.0], abs=1e-5) and both[1] == pytest.approx([-2.0], abs=1e-5)
    assert final_credit(rewards, {0: 1.0}, "outcome", 1.0, 0.95, EPS) == {}
