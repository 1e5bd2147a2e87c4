"""Every config key's type, default and meaning, read from async_rl/config.py's structs (each meaning written once,
beside its field, with `config.doc`): what `async-rl config --explain` prints, docs/configuration.md's key tables
(generated: `async-rl config --explain --markdown`, checked current by tests/test_docs.py) and the JSON schema."""

from __future__ import annotations

import inspect
import json
import typing
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from async_rl.config import Config
from async_rl.config_load import allowed, config_to_dict
from async_rl.errors import ConfigError

GENERATED_BEGIN = "<!-- generated from async_rl/config.py by: async-rl config --explain --markdown -->"
GENERATED_END = "<!-- end of the generated key tables -->"


@dataclass(frozen=True)
class KeyDoc:
    key: str  # dotted: learner.lora.rank
    accepts: str  # what the field accepts: "int >= 0", "one of 'disk' | 'distributed'"
    default: Any  # the default run's value (the packaged local config's)
    meaning: str  # Markdown


def _struct(annotation: Any) -> type[msgspec.Struct] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct) else None


def _meaning(annotation: Any) -> str:
    if typing.get_origin(annotation) is not Annotated:
        return ""
    return " ".join(getattr(meta, "description", None) or "" for meta in typing.get_args(annotation)[1:]).strip()


def sections() -> list[tuple[str, str, list[KeyDoc]]]:
    """(section, its intro or "", its keys) in the structs' order; a nested struct (learner.lora) within its parent."""
    defaults = config_to_dict(Config())

    def walk(struct: type[msgspec.Struct], prefix: str, values: dict[str, Any]) -> list[KeyDoc]:
        hints = typing.get_type_hints(struct, include_extras=True)
        found: list[KeyDoc] = []
        for name in struct.__struct_fields__:
            nested = _struct(hints[name])
            if nested is not None:
                found += walk(nested, f"{prefix}{name}.", values[name])
            else:
                found.append(KeyDoc(f"{prefix}{name}", allowed(hints[name]), values[name], _meaning(hints[name])))
        return found

    hints = typing.get_type_hints(Config, include_extras=True)
    return [(name, inspect.cleandoc(hints[name].__doc__ or ""), walk(hints[name], f"{name}.", defaults[name]))
            for name in Config.__struct_fields__]


def keys() -> list[KeyDoc]:
    return [doc for _, _, docs in sections() for doc in docs]


def shown(value: Any) -> str:
    """A default as YAML flow text: null, true, 0.0005, "" for an empty string, [a, b], {}."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, list):
        return "[" + ", ".join(shown(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {shown(v)}" for k, v in value.items()) + "}"
    return str(value)


def explain(prefix: str = "") -> str:
    """The keys under `prefix` ("" all, "algo", "algo.max_staleness") as text: key, accepts, default, meaning."""
    chosen = [doc for doc in keys() if not prefix or doc.key == prefix or doc.key.startswith(prefix.rstrip(".") + ".")]
    if not chosen:
        raise ConfigError(f"{prefix}: no such config key or section (sections: {', '.join(Config.__struct_fields__)})")
    return "\n".join(f"{doc.key}  ({doc.accepts}; default {shown(doc.default)})\n    {doc.meaning}\n"
                     for doc in chosen)


def markdown() -> str:
    """docs/configuration.md's key tables: a `## section` heading per section, its intro, a key / default / meaning
    table, between the GENERATED markers."""
    parts = [GENERATED_BEGIN, ""]
    for section, intro, docs in sections():
        parts += [f"## {section}", ""] + ([intro, ""] if intro else [])
        parts += ["| key | default | meaning |", "|---|---|---|"]
        parts += [f"| `{doc.key}` | `{shown(doc.default)}` | {doc.meaning.replace('|', chr(92) + '|')} |"
                  for doc in docs]
        parts.append("")
    return "\n".join([*parts, GENERATED_END])


def schema() -> str:
    """The config's JSON schema (msgspec's, every key's meaning as its description), for an editor's YAML checks."""
    return json.dumps(msgspec.json.schema(Config), indent=2)
