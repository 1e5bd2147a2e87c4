"""What each of the replay's components reads of the run's config, one frozen struct per component, built once at
the role's entry (replay/server.py) by `ReplaySettings.from_config`: the one reader of `Config` below the entry.

A field keeps its config key's name (`max_staleness` is `algo.max_staleness`), so a key is followed from its YAML
line to the components that read it by its name; a component gets its own struct and nothing else of the config.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from async_rl.config import Config, CreditMode, UpdateMode
from replay.hold import HoldSettings


class GroupSettings(msgspec.Struct, frozen=True, kw_only=True):
    """A group's transitions (replay/group.py) and its ledger's credit (async_rl/ledger.py `CreditRule`)."""

    updates: UpdateMode  # algo.updates
    credit: CreditMode  # algo.credit
    omega: float  # algo.omega
    gamma: float  # algo.gamma
    eps: float  # algo.eps
    stage_group_timeout_s: float  # replay.stage_group_timeout_s
    min_stage_peers: int  # replay.min_stage_peers


class EdgeSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Validation against the state (replay/edge.py)."""

    ppo_epochs: int  # algo.ppo_epochs
    max_version_lead: int  # replay.max_version_lead
    vocab_size: int | None  # replay.vocab_size
    max_seq_len: int  # model.max_seq_len


class GuardSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The correction-staleness guard (replay/guard.py)."""

    correction_guard: bool  # algo.correction_guard
    updates: UpdateMode  # algo.updates
    mode: Literal["async", "sync"]  # algo.mode
    max_correction_staleness: int | Literal["auto"]  # algo.max_correction_staleness
    max_correction_staleness_cap: int  # algo.max_correction_staleness_cap
    ppo_epochs: int  # algo.ppo_epochs
    max_seq_len: int  # model.max_seq_len
    batch_budget: Literal["padded", "packed"]  # learner.batch_budget
    group_size: int  # rollout.group_size
    guard_abandon_s: float  # replay.guard_abandon_s


class RoundSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Lock-step rounds (replay/rounds.py)."""

    groups_per_step: int  # algo.groups_per_step
    max_env_steps: int | None  # run.max_env_steps


class LeaseSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Admission, leases and worker sessions (replay/leases.py)."""

    mode: Literal["async", "sync"]  # algo.mode
    max_staleness: int  # algo.max_staleness
    groups_per_step: int  # algo.groups_per_step
    group_size: int  # rollout.group_size
    max_env_steps: int | None  # run.max_env_steps
    max_open_groups: int  # replay.max_open_groups
    lease_timeout_s: float  # replay.lease_timeout_s


class ServingSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Batches, acks and requeues (replay/serving.py)."""

    mode: Literal["async", "sync"]  # algo.mode
    max_staleness: int  # algo.max_staleness
    updates: UpdateMode  # algo.updates
    batch_budget: Literal["padded", "packed"]  # learner.batch_budget
    max_env_steps: int | None  # run.max_env_steps
    batch_ack_timeout_s: float  # replay.batch_ack_timeout_s


class ReplaySettings(msgspec.Struct, frozen=True, kw_only=True):
    """The service's own values (the success windows, the learner's token budget until it tells its own) and each
    component's struct; the rollback reads one value, `checkpoint_every`."""

    success_window: int  # replay.success_window
    long_success_window: int  # replay.long_success_window
    batch_tokens: int  # learner.batch_tokens
    checkpoint_every: int  # learner.checkpoint_every (replay/rollback.py)
    group: GroupSettings
    edge: EdgeSettings
    guard: GuardSettings
    rounds: RoundSettings
    leases: LeaseSettings
    serving: ServingSettings
    hold: HoldSettings

    @classmethod
    def from_config(cls, config: Config) -> ReplaySettings:
        """The replay's settings from the run's config: called by the role's entry (replay/server.py) only."""
        algo, replay, run, learner = config.algo, config.replay, config.run, config.learner
        max_seq_len, group_size = config.model.max_seq_len, config.rollout.group_size
        return cls(
            success_window=replay.success_window, long_success_window=replay.long_success_window,
            batch_tokens=learner.batch_tokens, checkpoint_every=learner.checkpoint_every,
            group=GroupSettings(updates=algo.updates, credit=algo.credit, omega=algo.omega, gamma=algo.gamma,
                                eps=algo.eps, stage_group_timeout_s=replay.stage_group_timeout_s,
                                min_stage_peers=replay.min_stage_peers),
            edge=EdgeSettings(ppo_epochs=algo.ppo_epochs, max_version_lead=replay.max_version_lead,
                              vocab_size=replay.vocab_size, max_seq_len=max_seq_len),
            guard=GuardSettings(correction_guard=algo.correction_guard, updates=algo.updates, mode=algo.mode,
                                max_correction_staleness=algo.max_correction_staleness,
                                max_correction_staleness_cap=algo.max_correction_staleness_cap,
                                ppo_epochs=algo.ppo_epochs, max_seq_len=max_seq_len,
                                batch_budget=learner.batch_budget, group_size=group_size,
                                guard_abandon_s=replay.guard_abandon_s),
            rounds=RoundSettings(groups_per_step=algo.groups_per_step, max_env_steps=run.max_env_steps),
            leases=LeaseSettings(mode=algo.mode, max_staleness=algo.max_staleness,
                                 groups_per_step=algo.groups_per_step, group_size=group_size,
                                 max_env_steps=run.max_env_steps, max_open_groups=replay.max_open_groups,
                                 lease_timeout_s=replay.lease_timeout_s),
            serving=ServingSettings(mode=algo.mode, max_staleness=algo.max_staleness, updates=algo.updates,
                                    batch_budget=learner.batch_budget, max_env_steps=run.max_env_steps,
                                    batch_ack_timeout_s=replay.batch_ack_timeout_s),
            hold=HoldSettings(
                immediate_hold=algo.immediate_hold if algo.updates == "immediate+correction" and algo.mode == "async"
                else 0.0,
                batch_trajectories=algo.groups_per_step * group_size),
        )
