"""The weights seam's interfaces: a `Publisher` per transport on the learner's side, a `Loader` per format on the
receiver's, chosen by `WeightsPublished.format` (a format the receiver cannot load is refused by name).

A publisher puts policy version N where its receivers find it (a file, a directory, or the receivers' own memory
over a broadcast) and returns the notice that says so; the learner (learner/publisher.py) records the notice in
`latest.json` and announces it. A receiver (a rollout engine) keeps a table of loaders by format and asks
`loader_for` for the notice's: it never trusts its own configuration to agree with the learner's. A loader checks
the checksums written with the weights before anything is loaded (`WeightsError` naming the file otherwise).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

import torch

from async_rl.errors import WeightsError
from async_rl.protocol import WeightsPublished

# Every format a learner writes, with what it is (the words of a refusal).
FORMATS = {
    "safetensors": "one safetensors file with the crc32 of its tensors (async_rl/weights/file.py)",
    "hf-dir": "an HF model directory with a manifest of its files' crc32s (async_rl/weights/hf_dir.py)",
    "lora-adapter": "a PEFT LoRA adapter directory with a manifest of its files' crc32s, loaded by vLLM servers "
                    "beside their base weights (async_rl/weights/hf_dir.py)",
    "distributed": "in the servers already, no file to read: pushed by the learner over a torch.distributed group "
                   "(async_rl/weights/distributed.py), or loaded into SGLang servers by the learner with their admin "
                   "key (learner/sglang_disk.py)",
}


class WeightsFormatError(WeightsError):
    """A receiver was told of weights in a format it cannot load (or one no learner writes); the message names the
    format, what it is, and the formats the receiver loads."""


class Publisher(Protocol):
    """The learner's side of one transport."""

    format: str  # the `WeightsPublished.format` of its notices

    def write(self, state_dict: dict[str, torch.Tensor], version: int) -> WeightsPublished:
        """Put version `version` where the receivers find it; the notice that says where. WeightsError naming the
        file when the disk refuses (nothing of it is left to be found)."""
        ...

    def prune(self, keep: int) -> None:
        """Remove all but the newest `keep` versions written."""
        ...

    def close(self) -> None: ...


# A receiver's loader for one format: take policy `version` from `path` (as the notice names it), its checksums
# checked first; WeightsError naming the file when it is torn, changed or gone (nothing of it loaded).
Loader = Callable[[int, str], None]


def loader_for(loaders: Mapping[str, Loader], notice_format: str, receiver: str) -> Loader:
    """The loader of `receiver` (its name, for the error) for weights of `notice_format`; WeightsFormatError naming
    the format and the ones it loads when it has none."""
    if notice_format in loaders:
        return loaders[notice_format]
    what = FORMATS.get(notice_format, "a format no async-rl learner of this version writes")
    raise WeightsFormatError(f"{receiver} cannot load weights of format {notice_format!r} ({what}); it loads "
                             f"{', '.join(repr(name) for name in loaders)}")


def format_of(path: str) -> str:
    """The format of a `latest.json` written before it recorded one: the path's shape says it."""
    if not path:
        return "distributed"
    if path.endswith(".safetensors"):
        return "safetensors"
    return "lora-adapter" if Path(path).name.startswith("lora-v") else "hf-dir"
