#!/usr/bin/env bash
# The node image for amd64 and arm64, one multi-arch manifest list in podman's storage, built
# offline: each architecture's image is deploy/Containerfile (FROM scratch: nothing is pulled,
# nothing runs, so no emulation is needed) holding that architecture's static cnibpf.
#   deploy/build-image.sh TAG AMD64_BINARY ARM64_BINARY
# `cargo xtask image` (./dev image) runs it; push with `podman manifest push TAG REGISTRY/...`.
set -euo pipefail
if [ $# -ne 3 ]; then
    echo "usage: $0 TAG AMD64_BINARY ARM64_BINARY" >&2
    exit 2
fi
tag=$1
declare -A binaries=([amd64]=$2 [arm64]=$3)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
# A list or an image of that name from an earlier build goes first: `--manifest` adds to a list.
podman manifest rm "$tag" >/dev/null 2>&1 || podman rmi --force "$tag" >/dev/null 2>&1 || true
podman manifest create "$tag" >/dev/null
for arch in amd64 arm64; do
    mkdir -p "$context/$arch"
    cp "${binaries[$arch]}" "$context/$arch/cnibpf"
    podman build --quiet --platform "linux/$arch" --manifest "$tag" \
        --file "$here/Containerfile" "$context/$arch" >/dev/null
done
echo "$tag: linux/amd64 and linux/arm64"
