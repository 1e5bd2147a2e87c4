#!/bin/sh
# The roles' install steps, shared by deploy/Dockerfile (CUDA) and deploy/Dockerfile.cpu (Debian, built here).
#   install-roles.sh deps PYTHON [TORCH_WHEEL]  the venv /opt/venv from PYTHON and every package of the lock, hashes
#                                               checked; with TORCH_WHEEL (a CPU build of the locked torch, checked
#                                               against deploy/torch-cpu.sha256) in place of the lock's CUDA torch
#   install-roles.sh package                    the package in the working directory (no deps) and user 10001
set -eu
venv=/opt/venv
case "$1" in
deps)
    uv venv --python "$2" "$venv"
    lock=deploy/requirements.lock
    if [ -n "${3:-}" ]; then
        [ "$(sha256sum "$3" | cut -d' ' -f1)" = "$(cut -d' ' -f1 deploy/torch-cpu.sha256)" ] \
            || { echo "$3 is not the torch CPU wheel of deploy/torch-cpu.sha256" >&2; exit 1; }
        # The lock's torch is the CUDA build, which alone pulls triton, nvidia-* and cuda-* wheels: leave them out.
        awk '/^[^ #-]/ { skip = ($0 ~ /^(torch|triton|nvidia-[a-z0-9-]+|cuda-[a-z-]+)==/) } !skip' "$lock" \
            > /tmp/requirements-cpu.lock
        lock=/tmp/requirements-cpu.lock
    fi
    uv pip sync --require-hashes --python "$venv/bin/python" "$lock"
    if [ -n "${3:-}" ]; then
        uv pip install --python "$venv/bin/python" --no-deps "$3"
    fi
    ;;
package)
    # Its dependencies are already installed, exactly as locked.
    uv pip install --python "$venv/bin/python" --no-deps --no-build-isolation .
    # A fixed non-root uid: the manifests set runAsUser: 10001 and fsGroup: 10001 to match.
    groupadd --gid 10001 app
    useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp app
    ;;
*)
    echo "usage: install-roles.sh deps PYTHON [TORCH_WHEEL] | package" >&2
    exit 2
    ;;
esac
# The build's scratch (uv's locks, the CPU lock): the pods mount an emptyDir on /tmp, which podman fills from here.
rm -rf /tmp/*
