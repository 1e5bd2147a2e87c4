"""HF directories, one per version: the `hf-dir` format, a model directory `weights/hf-v<N>/` (the model's config
files, one `model.safetensors`, a `manifest.json` of the files' sizes and crc32s), SGLang's and vLLM's disk
transport, read whole by the built-in engine or handed to servers as a view of hard links to the checked files;
and the `lora-adapter` format, a PEFT adapter directory `weights/lora-v<N>/` (`adapter_config.json`, the
adapters' tensors in `adapter_model.safetensors` under PEFT's key names, the manifest) that vLLM servers load
beside their unchanged base weights (`rollout.vllm.lora: adapter`).

The learner writes a directory whole (a staging directory, fsynced, renamed) and prunes the old ones; a reader
checks the files against the manifest before anything is loaded, and a server reads them through a view of hard
links (`load_view`) so that a prune between the check and its read takes nothing from under it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from async_rl.durable import MANIFEST, manifest_problem, write_manifest
from async_rl.errors import WeightsError
from async_rl.protocol import WeightsPublished
from async_rl.weights.file import read_weights, save_weights

HF_FILES = ("config.json", "generation_config.json")  # copied from the model directory beside the weights
WEIGHTS_FILE = "model.safetensors"
ADAPTER_CONFIG, ADAPTER_FILE = "adapter_config.json", "adapter_model.safetensors"  # a PEFT adapter directory's
LOAD_VIEW_PREFIX = ".sglang-load-"  # a rollout worker's hard links to an hf-v<N>/ while a server loads from them
STALE_LOAD_VIEW_S = 3600.0  # a view this old was left by a worker killed mid-load: the learner's prune removes it


def write_hf_dir(state_dict: dict[str, torch.Tensor], model_dir: Path, target: Path) -> Path:
    """An HF model directory SGLang can load: the model's config files and the new weights, with a manifest of their
    sizes and crc32s (checked by every reader before it loads them), made atomically."""

    def fill(staging: Path) -> None:
        for name in HF_FILES:
            if (model_dir / name).exists():
                shutil.copy(model_dir / name, staging / name)
        save_weights(state_dict, staging / WEIGHTS_FILE)

    return _write_whole(target, fill)


def write_adapter_dir(adapters: dict[str, torch.Tensor], adapter_config: dict, target: Path) -> Path:
    """A PEFT adapter directory vLLM can load (`/v1/load_lora_adapter`): `adapter_config` (PEFT's LoraConfig as a
    dict) and the adapters' tensors under PEFT's key names, with the manifest, made atomically."""

    def fill(staging: Path) -> None:
        (staging / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2))
        save_weights(adapters, staging / ADAPTER_FILE)

    return _write_whole(target, fill)


def _write_whole(target: Path, fill: Callable[[Path], None]) -> Path:
    """`target` made whole or not at all: `fill` writes a staging directory beside it, the manifest is added, and
    the staging directory is renamed into place (replacing a re-published version)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        fill(staging)
        write_manifest(staging)
    except OSError as exc:  # a full disk: WeightsError names the weights file, this the other files
        shutil.rmtree(staging, ignore_errors=True)
        raise WeightsError(f"{staging}: could not write the directory: {exc}") from None
    except WeightsError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(target, ignore_errors=True)  # a re-publish of the same version
    os.rename(staging, target)
    return target


def version_dirs(weights_dir: Path, prefix: str = "hf-v", file: str = WEIGHTS_FILE) -> dict[int, Path]:
    """The `<prefix><N>/` directories in `weights_dir` that hold `file`, by version, oldest first: hf-v<N>/ with its
    weights (the default), or lora-v<N>/ with its adapters (`prefix="lora-v", file=ADAPTER_FILE`)."""
    return {version: path for version, path in _numbered(weights_dir, prefix).items() if (path / file).is_file()}


def _numbered(weights_dir: Path, prefix: str) -> dict[int, Path]:
    """Every `<prefix><N>` in `weights_dir`, by N, oldest first."""
    n = len(prefix)
    found = {int(path.name[n:]): path for path in weights_dir.glob(f"{prefix}*") if path.name[n:].isdigit()}
    return dict(sorted(found.items()))


def read_dir(directory: Path) -> dict[str, torch.Tensor]:
    """The weights of an hf-v<N>/ directory, its files checked against its manifest first (and the tensors against
    the crc32 in their metadata). WeightsError naming the directory when it is torn, changed, gone or has no
    manifest: nothing of it is returned."""
    if not (directory / WEIGHTS_FILE).is_file():
        raise WeightsError(f"{directory}: no {WEIGHTS_FILE} there (pruned by learner.keep_weights, or not an hf-v<N> "
                           "directory)")
    problem = manifest_problem(directory)
    if problem is not None:
        raise WeightsError(f"{directory}: {problem}; not loaded")
    return read_weights(directory / WEIGHTS_FILE)


def load_view(directory: Path) -> Path:
    """A new directory beside `directory` holding hard links to its manifest and the files the manifest names: a
    reader of the view reads exactly these files, also when `directory` is removed meanwhile (the learner's prune
    of hf-v<N>/: the links keep the files' data), so a check of the view's files holds for what the reader gets.
    Copies where the filesystem takes no hard links. The caller removes it (`shutil.rmtree`) after the read.
    FileNotFoundError when `directory` or one of its files is gone (pruned); WeightsError when its manifest is
    missing or unreadable (it cannot be checked)."""
    view = Path(tempfile.mkdtemp(prefix=f"{LOAD_VIEW_PREFIX}{directory.name}-", dir=directory.parent))
    try:
        try:
            _link_or_copy(directory / MANIFEST, view / MANIFEST)
        except FileNotFoundError:
            if (directory / WEIGHTS_FILE).exists() or (directory / ADAPTER_FILE).exists():
                raise WeightsError(f"{directory}: no {MANIFEST} (its files' checksums): it cannot be checked") from None
            raise
        try:
            names = list(json.loads((view / MANIFEST).read_text())["files"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WeightsError(f"{directory}: its {MANIFEST} cannot be read ({exc})") from None
        for name in names:
            if "/" in name or name in (".", "..", MANIFEST):
                raise WeightsError(f"{directory}: its {MANIFEST} names {name!r}, not a file of the directory")
            _link_or_copy(directory / name, view / name)
    except BaseException:
        shutil.rmtree(view, ignore_errors=True)
        raise
    return view


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except FileNotFoundError:
        raise
    except OSError:  # no hard links here (another filesystem, or one without them): a private copy
        shutil.copyfile(source, target)


def prune_stale_load_views(weights_dir: Path, older_than_s: float = STALE_LOAD_VIEW_S) -> None:
    """Remove the load views (`load_view`) older than `older_than_s`: left by a worker killed while a server
    loaded from one (a live load removes its own within a request timeout)."""
    for view in weights_dir.glob(f"{LOAD_VIEW_PREFIX}*"):
        try:
            if time.time() - view.stat().st_mtime > older_than_s:
                shutil.rmtree(view, ignore_errors=True)
        except OSError:
            continue


class HFDirPublisher:
    """The learner's `hf-dir` transport: `weights_dir/hf-v<N>/`, written whole with its manifest."""

    format, prefix = "hf-dir", "hf-v"

    def __init__(self, weights_dir: Path, model_dir: Path) -> None:
        self.weights_dir, self.model_dir = weights_dir, model_dir

    def write(self, state_dict: dict[str, torch.Tensor], version: int) -> WeightsPublished:
        path = self._write_dir(state_dict, self.weights_dir / f"{self.prefix}{version}")
        return WeightsPublished(version=version, path=str(path), format=self.format)

    def _write_dir(self, state_dict: dict[str, torch.Tensor], target: Path) -> Path:
        return write_hf_dir(state_dict, self.model_dir, target)

    def prune(self, keep: int) -> None:
        for old in list(_numbered(self.weights_dir, self.prefix).values())[:-keep]:
            shutil.rmtree(old, ignore_errors=True)  # a worker loading it reads its own links (load_view)
        prune_stale_load_views(self.weights_dir)

    def close(self) -> None:
        """Nothing held."""


class AdapterDirPublisher(HFDirPublisher):
    """The learner's `lora-adapter` transport: `weights_dir/lora-v<N>/`, the adapters alone (what it is given is
    the adapters' state dict, learner/lora.py `adapter_state_dict`), written whole with its manifest."""

    format, prefix = "lora-adapter", "lora-v"

    def __init__(self, weights_dir: Path, adapter_config: dict) -> None:
        self.weights_dir, self.adapter_config = weights_dir, adapter_config

    def _write_dir(self, state_dict: dict[str, torch.Tensor], target: Path) -> Path:
        return write_adapter_dir(state_dict, self.adapter_config, target)
