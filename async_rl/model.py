"""The policy model and its tokenizer, shared by the learner and the built-in engine.

By default a tiny Llama-architecture causal LM is built from `model.*` sizes with random weights (seeded by
`run.seed`) and a tokenizer built here: word-level over the environment's declared vocabulary (one token per
word: a small action space a random policy can explore), or byte-level when the environment declares none (any
UTF-8 text, exactly). It is written once, as an ordinary Hugging Face model directory under the run directory,
so the learner, every rollout worker and an SGLang server all load the very same version-0 weights. The rollout
side builds it (it knows the environment); the learner waits for it. `model.path` points at any local HF model.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from async_rl.config import ModelConfig, checked_model_path
from async_rl.errors import AsyncRLError, ConfigError, WeightsError  # noqa: F401 - WeightsError: its old home
from async_rl.weights.file import read_weights

log = logging.getLogger("async_rl.model")


PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIALS = [PAD, EOS, UNK]  # ids 0, 1, 2 in both tokenizers


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A whitespace-split, word-level tokenizer: one token per word; decoding joins words with one space."""
    vocab = {w: i for i, w in enumerate(dict.fromkeys(SPECIALS + list(words)))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD, eos_token=EOS, unk_token=UNK)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte (GPT-2's byte-to-unicode alphabet, no merges): encodes any text and decodes it back
    exactly, whitespace included (code needs its indentation)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(SPECIALS + alphabet)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD, eos_token=EOS, unk_token=UNK)


def build_tiny_model(model: ModelConfig, seed: int, vocab_size: int, pad_id: int, eos_id: int) -> LlamaForCausalLM:
    """The tiny Llama of the `model` section's sizes (the section as a whole: its sizes are the model), initialized
    from `seed` (run.seed)."""
    m = model
    if m.hidden_size % m.num_heads or m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.hidden_size ({m.hidden_size}) must divide by model.num_heads ({m.num_heads}), "
            f"and num_heads by model.num_kv_heads ({m.num_kv_heads})"
        )
    llama = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=m.max_seq_len,
        tie_word_embeddings=False,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
    )
    # a directory of it that model.path names keeps the tiny model's defaults (async_rl/model_defaults.py); an extra
    # attribute is saved into config.json like the declared ones
    llama.async_rl_tiny_model = True
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama).float()


def ensure_model_dir(model: ModelConfig, run_dir: Path, seed: int, words: list[str] | None = None) -> Path:
    """The HF directory every role loads: `model.path`, or `<run_dir>/model` built (atomically, once) for the tiny
    default model of the `model` section's sizes (seeded by `seed`, run.seed), with a word-level tokenizer over
    `words` (an environment's declared vocabulary) or a byte-level one when None."""
    configured = checked_model_path(model.path)
    if configured is not None:
        return configured
    target = run_dir / "model"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(words) if words else byte_tokenizer()
    built = build_tiny_model(model, seed, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    staging = Path(tempfile.mkdtemp(prefix=".model-", dir=target.parent))
    built.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    try:
        os.rename(staging, target)
        log.info("built tiny model (%d parameters) at %s", sum(p.numel() for p in built.parameters()), target)
    except OSError:  # another role won the race; its copy is identical (same seed and config)
        shutil.rmtree(staging, ignore_errors=True)
    return target


def wait_for_model_dir(model_path: str, run_dir: Path, timeout_s: float = 600.0, poll_s: float = 0.5) -> Path:
    """The model directory, for a role that cannot build it (the learner does not know the environment, which
    chooses the tiny model's tokenizer): `model_path` (model.path), or `<run_dir>/model` once the launcher or a
    rollout worker has built it."""
    configured = checked_model_path(model_path)
    if configured is not None:
        return configured
    target = run_dir / "model"
    deadline = time.monotonic() + timeout_s
    if not (target / "config.json").exists():
        log.info("waiting for a rollout worker to build the model directory %s", target)
    while not (target / "config.json").exists():
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"no model directory at {target} after {timeout_s:.0f} s: start a rollout worker with the same "
                "config (it builds the tiny model for its environment), or set model.path"
            )
        time.sleep(poll_s)
    return target


def load_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path)


def resolve_device(setting: str, key: str, cuda_available: bool) -> str:
    """A `device` setting ("auto", "cpu" or "cuda") resolved to "cuda" or "cpu": auto is cuda when torch sees a GPU.
    `key` names the setting in the error (learner.device, rollout.device). The caller passes
    torch.cuda.is_available(); tests pass the answer of a machine they are not on."""
    if setting == "cuda" and not cuda_available:
        raise ConfigError(f"{key}: cuda was asked for but torch sees no CUDA device (set auto or cpu)")
    if setting == "auto":
        return "cuda" if cuda_available else "cpu"
    return setting


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """`read_weights` (async_rl/weights/file.py) into `model` (nothing of a file that fails its check is loaded)."""
    load_state(model, read_weights(path), path)


def load_state(model: torch.nn.Module, state: dict[str, torch.Tensor], source: Path) -> None:
    """Checked weights into `model`; RuntimeError naming `source` when they do not fit it."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if "rotary" not in k]:
        raise RuntimeError(f"weights {source} do not fit the model: missing={missing} unexpected={unexpected}")
