#!/bin/sh
# A local container image for swe tasks that name one (no registry needed): Debian bookworm's minimal base with
# python3 and pytest, from debootstrap, imported into podman's store. Root; ~2 min on a fast link.
#   scripts/build_swe_image.sh [IMAGE] [ROOTFS_DIR]
set -eu
IMAGE=${1:-localhost/async-rl-swe:bookworm}
ROOTFS=${2:-/var/tmp/async-rl-swe-rootfs}
if [ ! -x "$ROOTFS/usr/bin/python3" ]; then
    debootstrap --variant=minbase --include=python3,python3-pytest bookworm "$ROOTFS" http://deb.debian.org/debian
fi
ln -sf python3 "$ROOTFS/usr/bin/python"
rm -rf "$ROOTFS/var/cache/apt/archives"/*.deb "$ROOTFS/var/lib/apt/lists"/*
tar -C "$ROOTFS" -c . | podman import - "$IMAGE"
