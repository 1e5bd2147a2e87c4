#!/usr/bin/env bash
# Build (idempotently) the isolated virtualenv that runs a REAL SGLang server on
# a CPU-only machine for tests.  See docs/sglang-notes.md.
#
#   scripts/build_sglang_env.sh            # build or verify; prints the venv path
#   ASYNC_RL_SGLANG_VENV=/some/dir scripts/build_sglang_env.sh
#   scripts/build_sglang_env.sh --force    # rebuild from scratch
#
# What it does:
#   * creates a venv at ${ASYNC_RL_SGLANG_VENV:-$HOME/.cache/async-rl/sglang-venv}
#     with Python 3.11 (sglang's and torch's wheels here are cp311);
#   * `pip install --no-deps --only-binary=:all: -r scripts/sglang-requirements.txt`
#     (sglang==0.5.23, torch==2.13.0 CPU from the local wheel, triton, a patched
#     torchvision and an exact pure-Python closure; nothing is resolved, so pip
#     can never pull a CUDA torch);
#   * installs the stub `sgl_kernel` package from scripts/sglang_stub/;
#   * patches torchvision so it imports without its C extension;
#   * checks that the server modules import, then writes a marker file holding
#     a hash of this script, the requirements and the stub.  A later run with a
#     matching marker exits at once.
#
# The last line printed on success is the venv path.  Exit status is non-zero,
# with a message on stderr, if the environment cannot be built.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REQS="$SCRIPT_DIR/sglang-requirements.txt"
STUB_DIR="$SCRIPT_DIR/sglang_stub"
VENV="${ASYNC_RL_SGLANG_VENV:-$HOME/.cache/async-rl/sglang-venv}"
MARKER="$VENV/.async-rl-sglang-env"
FORCE=0
[[ "${1:-}" == "--force" ]] && FORCE=1

die() { echo "build_sglang_env.sh: ERROR: $*" >&2; exit 1; }
log() { echo "build_sglang_env.sh: $*" >&2; }

[[ -f "$REQS" ]] || die "missing $REQS"
[[ -f "$STUB_DIR/sgl_kernel/__init__.py" ]] || die "missing $STUB_DIR/sgl_kernel"

# Hash of everything that defines the environment.
compute_hash() {
    {
        cat "${BASH_SOURCE[0]}" "$REQS" "$SCRIPT_DIR/patch_torchvision.py"
        find "$STUB_DIR" -type f -name '*.py' -print0 | LC_ALL=C sort -z | xargs -0 cat
    } | sha256sum | cut -d' ' -f1
}
WANT_HASH="$(compute_hash)"

if [[ $FORCE -eq 0 && -f "$MARKER" && -x "$VENV/bin/python" ]] \
    && [[ "$(cat "$MARKER")" == "$WANT_HASH" ]]; then
    echo "$VENV"
    exit 0
fi

# Pick a Python 3.11 interpreter.
PY="${ASYNC_RL_SGLANG_PYTHON:-}"
if [[ -z "$PY" ]]; then
    for cand in python3.11 python3 python; do
        if command -v "$cand" >/dev/null 2>&1 \
            && "$cand" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' 2>/dev/null; then
            PY="$("$cand" -c 'import sys; print(sys.executable)')"
            break
        fi
    done
fi
[[ -n "$PY" ]] || die "no Python 3.11 interpreter found (set ASYNC_RL_SGLANG_PYTHON)"

mkdir -p "$(dirname "$VENV")"
# Serialize concurrent builds of the same venv.
exec 9>"$VENV.lock"
flock 9
# Another process may have finished the build while we waited.
if [[ $FORCE -eq 0 && -f "$MARKER" && "$(cat "$MARKER")" == "$WANT_HASH" ]]; then
    echo "$VENV"
    exit 0
fi

START=$(date +%s)
log "building SGLang venv at $VENV (python: $PY)"
rm -rf "$VENV"
"$PY" -m venv "$VENV" || die "python -m venv failed"
VPY="$VENV/bin/python"

# --no-deps: the requirements file is the complete, exact closure.
# --only-binary: never build anything from source.
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
if ! "$VPY" -m pip install --quiet --no-deps --only-binary=:all: -r "$REQS" \
        > "$VENV/.pip-install.log" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$VENV/.pip-install.log" | tail -n 30 >&2 || true
    rm -f "$MARKER"
    die "pip install of $REQS failed (full log: $VENV/.pip-install.log)"
fi

# Guard: the torch in the venv must be the local CPU build 2.13.0.
TORCH_VER="$("$VPY" -c 'import torch; print(torch.__version__)' 2>/dev/null)" \
    || die "torch does not import in the venv"
[[ "$TORCH_VER" == 2.13.0* ]] || die "unexpected torch version $TORCH_VER (wanted 2.13.0 CPU)"

SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

# Stub sgl_kernel (the real one is CUDA-only).
rm -rf "$SITE/sgl_kernel"
cp -r "$STUB_DIR/sgl_kernel" "$SITE/sgl_kernel"
find "$SITE/sgl_kernel" -name '__pycache__' -prune -exec rm -rf {} +

# torchvision from PyPI is a CUDA build: its C extension (_C.so) cannot load
# beside CPU torch, after which torchvision/_meta_registrations.py fails at
# import with "operator torchvision::nms does not exist".  Make those fake-op
# registrations conditional on the extension having loaded.
"$VPY" "$SCRIPT_DIR/patch_torchvision.py" "$SITE/torchvision/_meta_registrations.py" \
    || die "patching torchvision failed"

# Smoke test: the modules the server needs must import on the CPU engine.
if ! SGLANG_USE_CPU_ENGINE=1 "$VPY" -c '
import torch, triton, torchvision.transforms, sgl_kernel, transformers
assert getattr(sgl_kernel, "IS_ASYNC_RL_STUB", False)
import sglang
from sglang.srt.server_args import ServerArgs
import sglang.srt.entrypoints.http_server
import sglang.srt.configs.model_config
print("sglang", sglang.__version__, "torch", torch.__version__)
' > "$VENV/.smoke.log" 2>&1; then
    tail -n 30 "$VENV/.smoke.log" >&2
    die "the SGLang venv was installed but its server modules do not import"
fi
log "$(tail -n 1 "$VENV/.smoke.log")"

echo "$WANT_HASH" > "$MARKER"
log "done in $(( $(date +%s) - START ))s"
echo "$VENV"
