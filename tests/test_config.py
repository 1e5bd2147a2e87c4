"""Config: the embedded default loads, round-trips, and every bad value is named by its dotted key."""

import re
from pathlib import Path

import pytest
import yaml

from async_rl.config import Config
from async_rl.config_load import config_from_dict, config_to_dict, dump_config, load_config
from async_rl.errors import ConfigError


def test_embedded_default_has_the_documented_defaults():
    config = load_config()
    assert config.algo.updates == "immediate+correction"
    assert config.algo.credit == "outcome+step"
    assert (config.algo.omega, config.algo.gamma, config.algo.is_cap, config.algo.staleness_decay) == (
        1.0, 0.95, 2.0, 1.0,
    )
    assert config.env.name == "trap"
    assert config.wandb.mode == "disabled"  # W&B when asked: each role's service costs the quick start ~40 s
    # the README's default run: what configs/local.yaml said while the structs said 0.0, 2000 and null
    assert (config.algo.entropy_coef, config.run.max_versions, config.learner.pack_row_tokens) == (0.2, 10_000, 64)
    assert config.run.target_success == 0.8


def _flat(tree: dict, prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and key != "kwargs":
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def test_the_local_config_is_the_structs_defaults_key_by_key():
    """configs/local.yaml is the defaults as a commented file, not a second source: every key it sets equals the
    structs' default, so loading it gives the defaults exactly (a wheel, which runs the structs, runs the same)."""
    from async_rl.config_load import PACKAGED

    written = _flat(yaml.safe_load((PACKAGED / "local.yaml").read_text()))
    defaults = _flat(config_to_dict(Config()))
    assert set(written) <= set(defaults), set(written) - set(defaults)
    differ = {key: (value, defaults[key]) for key, value in written.items() if value != defaults[key]}
    assert not differ, f"configs/local.yaml (file, struct): {differ}"
    assert config_to_dict(load_config("local")) == config_to_dict(Config()) == config_to_dict(load_config())
    assert len(written) >= 40  # the knobs a newcomer turns: run, model, env, rollout, replay, learner, algo, wandb


def test_a_packaged_config_is_named_and_a_missing_file_is_named_in_the_error(tmp_path, monkeypatch):
    from async_rl.config_load import packaged_config_names

    assert packaged_config_names() == ["cluster", "cluster-vllm", "local", "smollm2", "smollm2-chain"]
    repo = Path(__file__).resolve().parent.parent
    for name in packaged_config_names():  # configs/ in the checkout is the packaged files, linked
        assert load_config(name) == load_config(repo / "configs" / f"{name}.yaml")
    cluster = load_config("cluster")
    assert (cluster.rollout.engine, cluster.wandb.mode, cluster.algo.entropy_coef) == ("sglang", "online", 0.0)
    assert load_config("cluster-vllm").rollout.engine == "vllm"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cluster").write_text("run:\n  name: mine\n")
    assert load_config("./cluster").run.name == "mine"  # a path is a file; a bare name the packaged config
    assert load_config("cluster").run.name == "agent-grpo"
    with pytest.raises(ConfigError,
                       match=r"config file clutser\.yaml does not exist .*: cluster, cluster-vllm, local, smollm2"):
        load_config("clutser.yaml")
    with pytest.raises(ConfigError, match=f"config file {re.escape(str(tmp_path))}/dir: cannot read it"):
        (tmp_path / "dir").mkdir()
        load_config(tmp_path / "dir")


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
    with pytest.raises(ConfigError, match=f"config file {re.escape(str(tmp_path / 'nope.yaml'))} does not exist"):
        load_config(tmp_path / "nope.yaml")
    path = tmp_path / "broken.yaml"
    path.write_text("algo: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_every_shipped_config_is_valid():
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


def test_a_vllm_sections_distributed_keys_reach_the_learners_transport_and_the_workers_engine():
    """`rollout.vllm.weight_sync: distributed` and its dist_* keys: the learner's transport settings
    (learner/settings.py `VLLMSyncSettings`, beside SGLang's, each engine's own weight_sync), the workers'; every
    pause_mode has its vLLM `/pause?mode=`; the tensors are described to the servers in the broadcast's order."""
    from typing import get_args, get_type_hints

    import torch

    from async_rl.config import VLLM_PAUSE_MODES, VLLMConfig
    from learner.settings import LearnerSettings
    from learner.sglang_sync import Tensors
    from rollout.settings import RolloutSettings

    config = load_config(None, ["rollout.engine=vllm", "rollout.vllm.urls=[http://a:1,http://b:2]",
                                "rollout.vllm.weight_sync=distributed", "rollout.vllm.pause_mode=keep",
                                "rollout.vllm.dist_master_port=31000", "rollout.vllm.dist_backend=nccl"])
    publisher = LearnerSettings.from_config(config).publisher
    assert (publisher.engine, publisher.vllm.weight_sync, publisher.sglang.weight_sync) == ("vllm", "distributed",
                                                                                           "disk")
    assert publisher.vllm.urls == ("http://a:1", "http://b:2")
    assert (publisher.vllm.pause_mode, publisher.vllm.dist_backend, publisher.vllm.dist_master_addr,
            publisher.vllm.dist_master_port) == ("keep", "nccl", "127.0.0.1", 31000)
    assert RolloutSettings.from_config(config).engine.vllm.weight_sync == "distributed"
    assert load_config().rollout.vllm.weight_sync == "disk"
    assert set(VLLM_PAUSE_MODES) == set(get_args(get_type_hints(VLLMConfig)["pause_mode"]))
    assert VLLM_PAUSE_MODES == {"in_place": "wait", "abort": "abort", "keep": "keep"}
    tensors = {"b.weight": torch.zeros(2, 3), "a.bias": torch.zeros(4, dtype=torch.bfloat16)}
    assert Tensors.of(tensors) == Tensors(["b.weight", "a.bias"], ["float32", "bfloat16"], [[2, 3], [4]])
