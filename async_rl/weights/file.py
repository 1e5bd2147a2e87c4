"""The `safetensors` format: one file per version, `weights/v<N>.safetensors`, the crc32 of its tensors in its
metadata (written by `save_weights`, checked by `read_weights`); the built-in engine's transport.

Files are written to a temporary and renamed, so a reader never sees half of one. The learner's publisher does not
fsync them (`durable=False`): the durable copy of the policy is the checkpoint, and a file a machine crash tore
fails its checksum.
"""

from __future__ import annotations

import os
import shutil
import zlib
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from async_rl.durable import fsync_path
from async_rl.errors import WeightsError
from async_rl.protocol import WeightsPublished

CRC_KEY = "async_rl.crc32"  # in a weights file's safetensors metadata: `tensors_crc` of its tensors, as hex


def save_weights(state_dict: dict[str, torch.Tensor], path: Path, durable: bool = True) -> None:
    """Write a safetensors file atomically (a temporary, fsynced when `durable`, then renamed: readers never see a
    partial file), with the crc32 of its tensors in its metadata (`CRC_KEY`, checked by `read_weights`).
    WeightsError naming the file when the disk refuses it (the temporary is removed; a file of that name written
    before stays)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    try:
        save_file(tensors, str(tmp), metadata={CRC_KEY: f"{tensors_crc(tensors):08x}"})
        if durable:
            fsync_path(tmp)
        os.replace(tmp, path)
        if durable:
            fsync_path(path.parent)
    except (OSError, SafetensorError) as exc:
        tmp.unlink(missing_ok=True)
        free = shutil.disk_usage(path.parent).free
        raise WeightsError(f"{path}: could not write the weights: {exc} ({free} bytes free there)") from None


def tensors_crc(tensors: dict[str, torch.Tensor]) -> int:
    """zlib.crc32 over the tensors in name order: each one's name, dtype, shape and bytes (host tensors)."""
    crc = 0
    for name in sorted(tensors):
        tensor = tensors[name]
        crc = zlib.crc32(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode(), crc)
        crc = zlib.crc32(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data, crc)
    return crc


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, checked against the crc32 written with them (files without one, e.g. a Hugging
    Face model's, are read as they are). WeightsError naming the file when it is missing, torn or changed."""
    try:
        with safe_open(str(path), framework="pt") as f:
            written = (f.metadata() or {}).get(CRC_KEY)
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open is no mapping
    except (OSError, SafetensorError) as exc:
        raise WeightsError(f"{path}: cannot be read as safetensors (missing, torn or corrupt): {exc}") from None
    if written is not None and f"{tensors_crc(tensors):08x}" != written:
        raise WeightsError(f"{path}: its tensors do not match the checksum written with them (the file changed "
                           "after it was written: a torn write or a bad disk)")
    return tensors


def version_files(weights_dir: Path) -> dict[int, Path]:
    """The `v<N>.safetensors` files in `weights_dir`, by version, oldest first."""
    found = {int(path.stem[1:]): path for path in weights_dir.glob("v*.safetensors") if path.stem[1:].isdigit()}
    return dict(sorted(found.items()))


class FilePublisher:
    """The learner's `safetensors` transport: `weights_dir/v<N>.safetensors`, not fsynced (see above)."""

    format = "safetensors"

    def __init__(self, weights_dir: Path) -> None:
        self.weights_dir = weights_dir

    def write(self, state_dict: dict[str, torch.Tensor], version: int) -> WeightsPublished:
        path = self.weights_dir / f"v{version}.safetensors"
        save_weights(state_dict, path, durable=False)
        return WeightsPublished(version=version, path=str(path), format=self.format)

    def prune(self, keep: int) -> None:
        for old in list(version_files(self.weights_dir).values())[:-keep]:
            old.unlink(missing_ok=True)

    def close(self) -> None:
        """Nothing held."""
