"""Builds the roles' CPU image (deploy/Dockerfile.cpu) with podman's tools, no registry, cached by a hash of its inputs.

    python scripts/build_pod_image.py [--tag async-rl:0.1.0] [--torch-wheel PATH]

1. The base: Debian 12 (bookworm, minbase) with python3, python3-venv and ca-certificates, made by debootstrap and
   `podman import`ed as localhost/async-rl-base:bookworm-<hash of the recipe>.
2. The image: `buildah bud --isolation chroot --layers` of deploy/Dockerfile.cpu on that base, from a build context
   of exactly the files deploy/Dockerfile.cpu.dockerignore lets in (plus the torch CPU wheel in torch-cpu/), labelled
   async-rl.inputs=<hash of the base, the Containerfile and every file of the context>.
A step whose result already exists with the same hash is skipped: the container store (and, for the context and the
wheel, ~/.cache/async-rl/pods, or $ASYNC_RL_CACHE/pods) is the cache. Needs root, podman, buildah, runc and
debootstrap (Debian: apt-get install podman buildah runc debootstrap).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("ASYNC_RL_CACHE", Path.home() / ".cache" / "async-rl")) / "pods"
CONTAINERFILE = ROOT / "deploy" / "Dockerfile.cpu"
TOOLS = ("podman", "buildah", "runc", "debootstrap")
APT_PACKAGES = ("podman", "buildah", "runc", "debootstrap")
# debootstrap's recipe: everything that decides what the base holds.
BASE_RECIPE = ("bookworm", "minbase", "python3,python3-venv,ca-certificates", "http://deb.debian.org/debian")
# A tar has no image config: set what an image of Debian's would (without PATH, `sh -c "exec async-rl"` finds nothing).
BASE_CHANGES = ("ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", 'CMD ["/bin/bash"]')
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"  # pip and uv inside RUN steps verify TLS with the host's bundle
# runc, not crun: crun cannot set RLIMIT_NOFILE/NPROC on some hosts (this one); runc keeps limits within these.
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
"""


class BuildError(RuntimeError):
    """A tool is missing or a build step failed; the message says which and what to do."""


def tools_missing() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def engine_env() -> dict[str, str]:
    """The environment for podman and buildah: CONTAINERS_CONF is ours unless the caller set one."""
    env = dict(os.environ)
    if "CONTAINERS_CONF" not in env:
        conf = CACHE / "containers.conf"
        conf.parent.mkdir(parents=True, exist_ok=True)
        if not conf.exists() or conf.read_text() != CONTAINERS_CONF:
            conf.write_text(CONTAINERS_CONF)
        env["CONTAINERS_CONF"] = str(conf)
    return env


def run(argv: list[str], **kwargs) -> None:  # noqa: ANN003
    """Runs a build step, its output appended to the cache's build.log (its tail in the error if it fails)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    log_path = CACHE / "build.log"
    with log_path.open("a") as log:
        log.write(f"--- {time.strftime('%H:%M:%S')} {' '.join(argv)}\n")
        log.flush()
        code = subprocess.run(argv, env=engine_env(), stdout=log, stderr=subprocess.STDOUT, **kwargs).returncode
    if code != 0:
        tail = log_path.read_text()[-4000:]
        raise BuildError(f"{' '.join(argv[:3])} ... failed ({code}); the end of {log_path}:\n{tail}")


def image_label(tag: str, label: str) -> str | None:
    """The image's label, or None when there is no such image."""
    out = subprocess.run(["podman", "image", "inspect", "--format", f'{{{{index .Labels "{label}"}}}}', tag],
                         env=engine_env(), text=True, capture_output=True)
    return out.stdout.strip() if out.returncode == 0 else None


def digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.hexdigest()


def build_base() -> str:
    """The Debian base image, made by debootstrap unless an image of the same recipe exists."""
    suite, variant, include, mirror = BASE_RECIPE
    tag = f"localhost/async-rl-base:{suite}-{digest(*(p.encode() for p in BASE_RECIPE + BASE_CHANGES))[:16]}"
    if image_label(tag, "async-rl.recipe") is not None:
        return tag
    rootfs = CACHE / "base-rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    rootfs.parent.mkdir(parents=True, exist_ok=True)
    run(["debootstrap", f"--variant={variant}", f"--include={include}", suite, str(rootfs), mirror])
    for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):  # no package files in the image
        for entry in (rootfs / cache).glob("*"):
            if entry.is_file():
                entry.unlink()
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    changes = [arg for change in BASE_CHANGES for arg in ("--change", change)]
    run(["podman", "import", *changes, "--change", f"LABEL async-rl.recipe={' '.join(BASE_RECIPE)}", "-", tag],
        stdin=tar.stdout)
    tar.wait()
    shutil.rmtree(rootfs)
    return tag


def torch_wheel(given: Path | None) -> Path:
    """The torch CPU wheel of deploy/torch-cpu.sha256: the given file, or `pip download`ed into the cache (with
    PIP_INDEX_URL=https://download.pytorch.org/whl/cpu where the machine has no local CPU build)."""
    sha, name = (ROOT / "deploy" / "torch-cpu.sha256").read_text().split()
    wheels = CACHE / "wheels"
    path = given or wheels / name
    if given is None and not path.exists():
        version = name.split("-")[1].split("+")[0]
        subprocess.run([sys.executable, "-m", "pip", "download", f"torch=={version}", "--no-deps", "--only-binary",
                        ":all:", "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64", "-d",
                        str(wheels)], check=False, capture_output=True)
    if not path.exists():
        raise BuildError(f"no {name} (torch's CPU build): pass --torch-wheel, or set "
                         "PIP_INDEX_URL=https://download.pytorch.org/whl/cpu so that pip download finds it")
    if hashlib.sha256(path.read_bytes()).hexdigest() != sha:
        raise BuildError(f"{path} is not the wheel of deploy/torch-cpu.sha256 ({sha})")
    return path


def context_files() -> list[str]:
    """The repository's files deploy/Dockerfile.cpu.dockerignore lets into the build (its `!` lines)."""
    allowed = [line[1:] for line in (ROOT / "deploy" / "Dockerfile.cpu.dockerignore").read_text().splitlines()
               if line.startswith("!") and line[1:] != "torch-cpu"]
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *allowed],
                            cwd=ROOT, text=True, capture_output=True, check=True).stdout.split()
    return sorted(f for f in listed if "__pycache__" not in f and (ROOT / f).is_file())


def build_context(wheel: Path) -> tuple[Path, str]:
    """The build context in the cache, and the hash of everything in it."""
    context = CACHE / "context"
    shutil.rmtree(context, ignore_errors=True)
    parts = [CONTAINERFILE.read_bytes(), wheel.name.encode(), hashlib.sha256(wheel.read_bytes()).hexdigest().encode()]
    for name in context_files():
        target = context / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
        parts += [name.encode(), target.read_bytes()]
    shutil.copy2(CONTAINERFILE, context / "deploy" / CONTAINERFILE.name)
    (context / "torch-cpu").mkdir()
    try:
        os.link(wheel, context / "torch-cpu" / wheel.name)
    except OSError:
        shutil.copy2(wheel, context / "torch-cpu" / wheel.name)
    return context, digest(*parts)


def build_image(tag: str, wheel: Path) -> tuple[str, bool]:
    """Base and image; returns the image's input hash and whether it was built (False: the cache had it)."""
    base = build_base()
    context, inputs = build_context(wheel)
    inputs = digest(inputs.encode(), base.encode())
    if image_label(tag, "async-rl.inputs") == inputs:
        return inputs, False
    run(["buildah", "bud", "--isolation", "chroot", "--layers", "-f", str(context / "deploy" / CONTAINERFILE.name),
         "--build-arg", f"BASE={base}", "-v", f"{CA_BUNDLE}:{CA_BUNDLE}:ro", "--label", f"async-rl.inputs={inputs}",
         "-t", tag, str(context)])
    return inputs, True


def default_tag() -> str:
    return "async-rl:" + tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default=default_tag(), help="the image's name (default: the manifests' image)")
    parser.add_argument("--torch-wheel", type=Path, help="torch's CPU wheel (default: pip download into the cache)")
    args = parser.parse_args(argv)
    missing = tools_missing()
    if missing:
        print(f"missing {', '.join(missing)}: apt-get install {' '.join(APT_PACKAGES)}", file=sys.stderr)
        return 1
    start = time.monotonic()
    try:
        inputs, built = build_image(args.tag, torch_wheel(args.torch_wheel))
    except BuildError as error:
        print(error, file=sys.stderr)
        return 1
    print(f"{args.tag} {'built' if built else 'cached'} (inputs {inputs[:16]}) in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
