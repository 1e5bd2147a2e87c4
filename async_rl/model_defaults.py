"""Defaults that follow the model: with `model.path` naming a pretrained model, `model.max_seq_len` and `learner.lr`
take the model's values (its context, capped; a pretrained model's learning rate) unless the command line or a
config file sets them. async_rl/config_load.py decides what was set and calls `follow_model`; each resolved key
comes with a sentence saying where its value came from, which the commands print.

Reads the model directory's config.json only (no torch): `async-rl train` resolves its config before importing it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from async_rl.config import Config

# The context a run gets from a pretrained model's max_position_embeddings is capped here, for a CPU machine of
# ~24 GiB shared by every role: at 2,048 tokens SmolLM2-135M's learner micro-batch holds ~1.2 GB of logits (49,152
# vocabulary x fp32, with log-softmax and gradient) and ~4.5 GB of dense attention scores kept for backward (30
# layers x 9 heads x 2,048^2 x 4 B); at its 8,192 the scores alone would be 16 times that. Set model.max_seq_len
# to go past it.
SEQ_LEN_CAP = 2048
FULL_LR = 1e-5  # RL on a pretrained model, full fine-tune (the recipes': configs/smollm2*.yaml)
LORA_LR = 1e-4  # its LoRA adapters (learner.lora.rank > 0)
# A warm start (`async-rl sft`) moves further than RL, at ten times the rate, as the recipes' warm starts do (README:
# full at 1e-4, 12 steps, then a well-formed call in 200 of 200 held-out episodes; LoRA at 1e-3). At RL's 1e-4,
# four LoRA steps on 48 demonstrations of a tool env taught SmolLM2-135M no well-formed call.
SFT_FULL_LR = 1e-4
SFT_LORA_LR = 1e-3
FOLLOWS_MODEL = ("model.max_seq_len", "learner.lr")


def _get(raw: dict[str, Any], dotted: str) -> Any:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _put(raw: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _model_config(model_dir: Path) -> dict[str, Any]:
    try:
        found = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _context(model_config: dict[str, Any]) -> int | None:
    """The model's own context (config.json's max_position_embeddings), or None when it states none."""
    found = model_config.get("max_position_embeddings")
    return found if isinstance(found, int) and found > 0 else None


def follow_model(raw: dict[str, Any], set_by: dict[str, str], warm_start: bool = False) -> dict[str, str]:
    """Fill in `raw` (the config as read, overrides applied) the model-following keys that `set_by` does not name
    (key -> where it was set: "on the command line", "in FILE"), when model.path names a model directory; returns key ->
    a sentence on where its value comes from, for every model-following key. `warm_start`: the rate is for
    `async-rl sft`, not RL."""
    model_path = _get(raw, "model.path")
    notes: dict[str, str] = {}
    for key in FOLLOWS_MODEL:
        if key in set_by:
            notes[key] = f"{_get(raw, key)}, set {set_by[key]}"
    if not model_path:
        return {key: notes.get(key, f"{_default(key)}, the built-in default (the tiny model's; model.path is empty)")
                for key in FOLLOWS_MODEL}
    model_dir = Path(str(model_path))
    if not (model_dir / "config.json").is_file():  # the command that needs the model refuses it by name
        return {key: notes.get(key, f"{_default(key)}, the built-in default ({model_dir} has no config.json to "
                                    "follow)") for key in FOLLOWS_MODEL}
    model_config = _model_config(model_dir)  # read once for both keys
    if model_config.get("async_rl_tiny_model"):  # built by async_rl/model.py: random init, not pretrained
        return {key: notes.get(key, f"{_default(key)}, the built-in default ({model_dir} is async-rl's tiny model)")
                for key in FOLLOWS_MODEL}
    if "model.max_seq_len" not in set_by:
        context = _context(model_config)
        if context is None:
            notes["model.max_seq_len"] = (f"{_default('model.max_seq_len')}, the built-in default "
                                          f"({model_dir}/config.json states no max_position_embeddings)")
        else:
            length = min(context, SEQ_LEN_CAP)
            _put(raw, "model.max_seq_len", length)
            capped = f", capped at {SEQ_LEN_CAP} for this machine's memory" if context > SEQ_LEN_CAP else ""
            notes["model.max_seq_len"] = (f"{length}, the model's context (max_position_embeddings {context} in "
                                          f"{model_dir}/config.json){capped}")
    if "learner.lr" not in set_by:
        lora = bool(_get(raw, "learner.lora.rank"))
        rates = (SFT_LORA_LR, SFT_FULL_LR) if warm_start else (LORA_LR, FULL_LR)
        rate = rates[0] if lora else rates[1]
        _put(raw, "learner.lr", rate)
        notes["learner.lr"] = (f"{rate:g}, a pretrained model's {'warm-start' if warm_start else 'RL'} rate for "
                               f"{'LoRA (learner.lora.rank > 0)' if lora else 'a full fine-tune'}")
    return {key: notes[key] for key in FOLLOWS_MODEL}


def _default(dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(Config(), section), key)


def said(command: str, model_path: str, notes: dict[str, str]) -> list[str]:
    """The lines a command prints on stderr about where the model-following values came from: none for the tiny
    model (its defaults are not news)."""
    return [f"async-rl {command}: {key} = {note}" for key, note in notes.items()] if model_path else []
