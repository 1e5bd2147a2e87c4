"""Loading a run configuration: YAML (a file or a packaged config) with `section.key=value` overrides, into the
Structs of async_rl/config.py, validated before any process starts. A wrong key, type or range raises `ConfigError`
whose message names the dotted key, the bad value and what is allowed, e.g. `algo.max_staleness: expected int >= 0,
got -1`.
"""

from __future__ import annotations

import difflib
import importlib.resources
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml

from async_rl.config import Config, EnvConfig
from async_rl.errors import ConfigError
from async_rl.model_defaults import FOLLOWS_MODEL, follow_model

# The packaged configs (package data, async_rl/configs/<name>.yaml; configs/ in a checkout links to them): `local`
# (the Structs' defaults as a commented file), `cluster` (deploy/k8s), `smollm2` (a real model with a tool).
PACKAGED = importlib.resources.files("async_rl") / "configs"


def packaged_config_names() -> list[str]:
    return sorted(entry.name.removesuffix(".yaml") for entry in PACKAGED.iterdir() if entry.name.endswith(".yaml"))


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's floats: `3e-4` is a number (YAML 1.1 wants `3.0e-4` and reads `3e-4`
    as a string, which then failed validation as "expected float, got '3e-4'")."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # a SafeLoader: no arbitrary objects


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config of `path` with `a.b=value` overrides applied, validated. `path`: None for the defaults (the structs
    above; nothing is read), a YAML file, or a packaged config by name (`cluster`; a file of that name is `./cluster`).
    A file that does not exist is an error that names it: nothing falls back to the defaults."""
    return load_config_explained(path, overrides)[0]


def load_config_explained(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                          warm_start: bool = False) -> tuple[Config, dict[str, str]]:
    """`load_config`, and where each model-following key's value came from (async_rl/model_defaults.py): key ->
    a sentence the commands print. The layers, lowest first: the structs' defaults, the file, the overrides. A key
    counts as set when the command line sets it, or the file does; a packaged config (or a file identical to one,
    such as configs/local.yaml) writing out the built-in default does not set it: that is the default, written down,
    so with model.path it follows the model like the default it is. `warm_start`: the config of `async-rl sft`, whose
    rate for a pretrained model is the warm start's."""
    raw: Any = {}
    set_by: dict[str, str] = {}
    if path is not None:
        source, text, packaged = _read_config(path)
        try:
            raw = _yaml(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: not valid YAML: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a mapping of sections at the top level, got {type(raw).__name__}")
        defaults = config_to_dict(Config())
        for key in FOLLOWS_MODEL:
            value = _lookup(raw, key.split("."))
            if value is not None and not (packaged and value == _lookup(defaults, key.split("."))):
                set_by[key] = f"in {path}"
    for override in overrides:
        _apply_override(raw, override)
        key = override.partition("=")[0]
        for follows in FOLLOWS_MODEL:
            if follows == key or follows.startswith(key + "."):
                set_by[follows] = "on the command line"
    return _resolved(raw, set_by, warm_start)


# Keys the code no longer has: (section, key) -> (the value it had by default, why it went). A run directory's
# config.yaml written before (every key is in it) still loads when the key holds that value, which is what the code
# now does; any other value is refused with the reason.
REMOVED_KEYS = {
    ("algo", "hold_immediates"): (False, "the ablation of immediate+correction was removed from the product (its "
                                         "result is in docs/research/log.md; reproducible at commit 6d4d567)"),
    ("algo", "entropy_floor"): (0.0, "the entropy floor was removed (measured, not met: docs/research/log.md; "
                                     "reproducible at commit cceb674)"),
    ("algo", "entropy_floor_step"): (0.005, "the entropy floor was removed (docs/research/log.md)"),
    ("algo", "entropy_floor_max"): (1.0, "the entropy floor was removed (docs/research/log.md)"),
}


def _drop_removed(raw: dict[str, Any]) -> None:
    for (section, key), (default, why) in REMOVED_KEYS.items():
        values = raw.get(section)
        if isinstance(values, dict) and key in values:
            if values[key] != default:
                raise ConfigError(f"{section}.{key}: {why}; only {default!r} is accepted, got {values[key]!r}")
            del values[key]


def _read_config(path: str | Path) -> tuple[str, str, bool]:
    """(what to call it in an error, its text, whether it is a packaged config): a packaged config when `path` is
    one's bare name, else a file (packaged too when its text is one's: configs/ in a checkout links to them)."""
    if isinstance(path, str) and path in packaged_config_names():
        resource = PACKAGED / f"{path}.yaml"
        return f"packaged config {path} ({resource})", resource.read_text(), True
    source = Path(path)
    try:
        text = source.read_text()
    except FileNotFoundError:
        names = ", ".join(packaged_config_names())
        raise ConfigError(f"config file {source} does not exist (a packaged config is named without a path or "
                          f".yaml: {names})") from None
    except OSError as exc:  # a directory, no permission
        raise ConfigError(f"config file {source}: cannot read it: {exc}") from None
    packaged = any(entry.name.endswith(".yaml") and entry.read_text() == text for entry in PACKAGED.iterdir())
    return str(source), text, packaged


def config_from_dict(raw: dict[str, Any]) -> Config:
    """The config of a mapping of sections (every key it holds counts as set), validated; the model-following keys
    it leaves out follow model.path (async_rl/model_defaults.py)."""
    given = {key: "in the config given" for key in FOLLOWS_MODEL if _lookup(raw, key.split(".")) is not None}
    return _resolved(raw, given)[0]


def _resolved(raw: dict[str, Any], set_by: dict[str, str], warm_start: bool = False
              ) -> tuple[Config, dict[str, str]]:
    if not isinstance(raw.get("model", {}), dict) or not isinstance(raw.get("learner", {}), dict):
        return _validated(raw), {}  # the mapping is refused by name there
    notes = follow_model(raw, set_by, warm_start)
    return _validated(raw), notes


def _validated(raw: dict[str, Any]) -> Config:
    _drop_removed(raw)
    _check_keys(raw, Config, "")
    try:
        config = msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(exc, raw)) from None
    _check_relations(config)
    return config


def config_to_dict(config: Config) -> dict[str, Any]:
    return msgspec.to_builtins(config)


def dump_config(config: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))


def load_run_config(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config of the run in `run_dir` (its config.yaml, with `overrides` on top), pointed at that directory
    wherever the command runs from (`async-rl train --resume`, `async-rl export`). Raises ConfigError naming what
    is missing."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
    config = load_config(run_dir / "config.yaml", list(overrides))
    run = msgspec.structs.replace(config.run, dir=str(run_dir.resolve().parent), name=run_dir.resolve().name)
    return msgspec.structs.replace(config, run=run)


def _apply_override(raw: dict[str, Any], override: str) -> None:
    key, sep, text = override.partition("=")
    if not sep or not key or not re.fullmatch(r"[a-z_]+(\.[A-Za-z_][A-Za-z0-9_]*)+", key):
        raise ConfigError(f"override {override!r}: expected section.key=value, e.g. algo.max_staleness=2")
    try:
        value = _yaml(text) if text != "" else ""
    except yaml.YAMLError:
        value = text
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {part} is a value, not a section")
        node = child
    node[leaf] = value


def _struct_type(annotation: Any) -> type[msgspec.Struct] | None:
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return annotation
    return None


def _check_keys(raw: Any, struct: type[msgspec.Struct], prefix: str) -> None:
    if not isinstance(raw, dict):
        where = prefix.rstrip(".") or "config"
        raise ConfigError(f"{where}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(struct, include_extras=True)
    for key, value in raw.items():
        if key not in struct.__struct_fields__:
            close = difflib.get_close_matches(str(key), struct.__struct_fields__, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else ""
            if struct is EnvConfig:
                hint = f"; an environment's own settings go under env.kwargs, e.g. env.kwargs.{key}={raw[key]!r}"
            allowed = ", ".join(struct.__struct_fields__)
            raise ConfigError(f"{prefix}{key}: unknown key{hint} (allowed: {allowed})")
        sub = _struct_type(hints[key])
        if sub is not None:
            _check_keys(value, sub, f"{prefix}{key}.")


def _lookup(raw: Any, dotted: list[str]) -> Any:
    for part in dotted:
        if isinstance(raw, dict) and part in raw:
            raw = raw[part]
        elif isinstance(raw, list) and part.isdigit() and int(part) < len(raw):
            raw = raw[int(part)]
        else:
            return None
    return raw


def allowed(annotation: Any) -> str:
    """A short human description of what a field accepts."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        base, *metas = typing.get_args(annotation)
        bounds = []
        for meta in metas:
            for name, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
                bound = getattr(meta, name, None)
                if bound is not None:
                    bounds.append(f"{op} {bound}")
        return f"{allowed(base)} {' and '.join(bounds)}".strip()
    if origin is Literal:
        return "one of " + " | ".join(repr(v) for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(allowed(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _field_annotation(dotted: list[str]) -> Any:
    struct: Any = Config
    annotation: Any = None
    for part in dotted:
        hints = typing.get_type_hints(struct, include_extras=True)
        if part not in hints:
            return annotation
        annotation = hints[part]
        struct = _struct_type(annotation) or annotation
    return annotation


def _explain(exc: msgspec.ValidationError, raw: dict[str, Any]) -> str:
    message = str(exc)
    match = re.search(r" - at `\$\.?(.*)`$", message)
    path = match.group(1) if match else ""
    dotted = [p for p in re.split(r"[.\[\]]+", path) if p]
    key = ".".join(dotted) or "config"
    annotation = _field_annotation(dotted)
    got = _lookup(raw, dotted)
    accepted = allowed(annotation) if annotation is not None else message.split(" - at ")[0]
    return f"{key}: expected {accepted}, got {got!r}"


def _check_relations(config: Config) -> None:
    rollout, replay = config.rollout, config.replay
    if rollout.max_inflight < rollout.group_size:
        raise ConfigError(
            f"rollout.max_inflight: expected >= rollout.group_size ({rollout.group_size}), got {rollout.max_inflight}"
        )
    if any(not stop for stop in rollout.stop):
        raise ConfigError("rollout.stop: expected non-empty stop strings, got an empty one")
    if replay.min_stage_peers > rollout.group_size:
        raise ConfigError(
            f"replay.min_stage_peers: expected <= rollout.group_size ({rollout.group_size}), "
            f"got {replay.min_stage_peers}"
        )
    if rollout.engine == "sglang" and not rollout.sglang.urls:
        raise ConfigError("rollout.sglang.urls: expected at least one server URL when rollout.engine is 'sglang'")
    if rollout.engine == "vllm" and not rollout.vllm.urls:
        raise ConfigError("rollout.vllm.urls: expected at least one server URL when rollout.engine is 'vllm'")
    if config.algo.clip_high <= 0 and config.algo.ppo_epochs > 1:
        raise ConfigError("algo.clip_high: expected > 0 when algo.ppo_epochs > 1")
    learner = config.learner
    if learner.momentum > 0 and learner.optimizer != "sgd":
        raise ConfigError(f"learner.momentum: only learner.optimizer sgd has a momentum, got {learner.momentum} with "
                          f"{learner.optimizer!r}")
    lora = learner.lora
    if lora.rank > 0 and (not lora.target_modules or any(not name.strip() for name in lora.target_modules)):
        raise ConfigError(f"learner.lora.target_modules: expected names of the model's linear layers (e.g. q_proj) "
                          f"when learner.lora.rank > 0, got {lora.target_modules!r}")
    vllm = rollout.vllm
    if lora.rank > 0 and rollout.engine == "vllm" and vllm.lora == "adapter" and vllm.weight_sync == "distributed":
        raise ConfigError("rollout.vllm.lora: `adapter` publishes each version's LoRA adapters as a directory the "
                          "servers read, but rollout.vllm.weight_sync is `distributed` (no shared disk assumed): set "
                          "rollout.vllm.lora: merged (the merged weights are pushed) or weight_sync: disk")
    if learner.pack_row_tokens is not None and learner.pack_row_tokens > learner.micro_batch_tokens:
        raise ConfigError(
            f"learner.pack_row_tokens: expected <= learner.micro_batch_tokens ({learner.micro_batch_tokens}), "
            f"got {learner.pack_row_tokens}"
        )
    if config.security.curve_dir is not None and not config.security.curve_dir.strip():
        raise ConfigError("security.curve_dir: expected a directory of CURVE keys (`async-rl keys DIR`) or null, "
                          "got ''")
    for name in ("replay.endpoint", "learner.publish_endpoint"):
        section, field = name.split(".")
        value = getattr(getattr(config, section), field)
        if not re.fullmatch(r"(auto|tcp://[^\s:]+:\d+|ipc://\S+|inproc://\S+)", value):
            raise ConfigError(f"{name}: expected tcp://HOST:PORT, ipc://PATH or auto, got {value!r}")
