"""Config: the embedded default loads, round-trips, and every bad value is named by its dotted key."""

import re

import pytest

from async_rl.config import Config, config_from_dict, config_to_dict, dump_config, load_config
from async_rl.errors import ConfigError


def test_embedded_default_has_the_documented_defaults():
    config = load_config()
    assert config.algo.updates == "immediate+correction"
    assert config.algo.credit == "outcome+step"
    assert (config.algo.omega, config.algo.gamma, config.algo.is_cap, config.algo.staleness_decay) == (
        1.0, 0.95, 2.0, 1.0,
    )
    assert config.env.name == "trap"
    assert config.wandb.mode == "offline"


def test_round_trip_through_yaml(tmp_path):
    config = load_config(None, ["algo.max_staleness=2", "env.kwargs.seed=7", "rollout.sglang.urls=[http://a:1]"])
    path = tmp_path / "c.yaml"
    dump_config(config, path)
    again = load_config(path)
    assert again == config
    assert config_from_dict(config_to_dict(config)) == config


def test_overrides_parse_yaml_scalars():
    config = load_config(None, ["algo.omega=0.5", "run.target_success=null", "algo.updates=outcome-only"])
    assert config.algo.omega == 0.5
    assert config.run.target_success is None
    assert config.algo.updates == "outcome-only"


def test_exponent_floats_without_a_dot_are_numbers_in_overrides_and_files(tmp_path):
    """`learner.lr=3e-4` was read as the string '3e-4' (YAML 1.1 floats need a dot) and refused as "expected float";
    YAML 1.2's form is a number now, on the command line and in a file; a name that only contains one stays text."""
    config = load_config(None, ["learner.lr=3e-4", "algo.kl_beta=1E-9", "run.name=x1e5"])
    assert (config.learner.lr, config.algo.kl_beta, config.run.name) == (3e-4, 1e-9, "x1e5")
    path = tmp_path / "c.yaml"
    path.write_text("learner:\n  lr: 2e-5\nalgo:\n  kl_beta: -0e0\n")
    assert (load_config(path).learner.lr, load_config(path).algo.kl_beta) == (2e-5, 0.0)


def test_an_empty_file_means_all_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == Config()


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("algo.max_staleness=-1", "algo.max_staleness: expected int >= 0, got -1"),
        ("algo.updates=sometimes", "algo.updates: expected one of"),
        ("algo.credit=step", "algo.credit: expected one of"),
        ("algo.maxstaleness=1", "algo.maxstaleness: unknown key; did you mean algo.max_staleness?"),
        ("rollout.group_size=1", "rollout.group_size: expected int >= 2, got 1"),
        ("rollout.group_size=eight", "rollout.group_size: expected int >= 2, got 'eight'"),
        ("algo.gamma=1.5", "algo.gamma: expected float >= 0.0 and <= 1.0, got 1.5"),
        ("algo.is_cap=0", "algo.is_cap: expected float > 0.0, got 0"),
        ("wandb.mode=loud", "wandb.mode: expected one of 'offline' | 'online' | 'disabled', got 'loud'"),
        ("env.traps=9", "env.traps: unknown key; an environment's own settings go under env.kwargs, e.g. env.kwargs."),
        ("rollout.max_inflight=4", "rollout.max_inflight: expected >= rollout.group_size (16), got 4"),
        ("rollout.stop=['']", "rollout.stop: expected non-empty stop strings"),
        ("learner.zero_stage=4", "learner.zero_stage: expected int >= 0 and <= 3, got 4"),
        ("replay.endpoint=localhost", "replay.endpoint: expected tcp://HOST:PORT, ipc://PATH or auto"),
        ("rollout.engine=sglang", "rollout.sglang.urls: expected at least one server URL"),
        ("bogus.key=1", "bogus: unknown key"),
        ("algo=3", "expected section.key=value"),
    ],
)
def test_bad_config_is_rejected_naming_the_key(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert expected in str(info.value)


def test_a_section_that_is_not_a_mapping_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("algo: 3\n")
    with pytest.raises(ConfigError, match="algo: expected a mapping"):
        load_config(path)


def test_missing_file_and_bad_yaml_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    path = tmp_path / "broken.yaml"
    path.write_text("algo: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_every_shipped_config_is_valid():
    from pathlib import Path

    configs = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        load_config(path)


@pytest.mark.parametrize("overrides, message", [
    ("learner.momentum=0.9", "learner.momentum: only learner.optimizer sgd has a momentum, got 0.9 with 'adamw'"),
    ("learner.optimizer=adam", "learner.optimizer: expected one of 'adamw' | 'sgd', got 'adam'"),
    ("learner.momentum=1.0", "learner.momentum: expected"),  # 1 never forgets a gradient
])
def test_optimizer_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [overrides])


def test_sgd_takes_a_momentum():
    sgd = load_config(None, ["learner.optimizer=sgd", "learner.momentum=0.9"]).learner
    assert (sgd.optimizer, sgd.momentum) == ("sgd", 0.9)


def test_a_removed_key_loads_at_its_old_default_and_is_refused_otherwise_with_the_reason():
    """algo.hold_immediates left the product: a run directory's config.yaml written before (every key is in it)
    still loads with its default, false; true names why it went and where it still runs."""
    assert load_config(None, ["algo.hold_immediates=false"]) == load_config(None, [])
    with pytest.raises(ConfigError, match=re.escape("algo.hold_immediates: the ablation of immediate+correction was "
                                                    "removed from the product (its result is in docs/research/log.md; "
                                                    "reproducible at commit 6d4d567); only False is accepted, got "
                                                    "True")):
        load_config(None, ["algo.hold_immediates=true"])
