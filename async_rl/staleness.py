"""Staleness control of docs/algorithm.md, "Staleness": admission, not discard."""

from __future__ import annotations


def admission_allowed(groups_started: int, version: int, max_staleness: int, groups_per_step: int) -> bool:
    """May one more group start? `groups_started` counts it: groups_started ≤ (v + max_staleness + 1) · g."""
    return groups_started <= (version + max_staleness + 1) * groups_per_step


def staleness(learner_version: int, behaviour_version: int) -> int:
    """s_t = v − v_t."""
    return learner_version - behaviour_version


def immediate_trainable(learner_version: int, oldest_token_version: int, max_staleness: int) -> bool:
    """An immediate item is trained only within the hard bound; otherwise its credit waits for the correction."""
    return staleness(learner_version, oldest_token_version) <= max_staleness


def correction_trainable(learner_version: int, oldest_token_version: int, max_correction_staleness: int) -> bool:
    """A correction past its own bound is dropped and counted (`credit_dropped`), never silently."""
    return staleness(learner_version, oldest_token_version) <= max_correction_staleness
