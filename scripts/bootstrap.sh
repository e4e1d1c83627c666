#!/usr/bin/env bash
# Installs everything cnibpf's build, tests and demo need, idempotently. A second run only checks
# (a few seconds). Run as root: it installs Debian packages and mounts bpffs.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
started=$SECONDS
step() { printf '\033[1m[bootstrap %3ss]\033[0m %s\n' "$((SECONDS - started))" "$*"; }

toolchain_channel() { sed -n 's/^channel *= *"\(.*\)"/\1/p' "$1" | head -n1; }
userspace_toolchain=$(toolchain_channel "$repo/toolchains.toml")
ebpf_toolchain=$(toolchain_channel "$repo/cnibpf-ebpf/rust-toolchain.toml")
tools_dir="${CNIBPF_TOOLS_DIR:-$HOME/.local/share/cnibpf-tools}/$ebpf_toolchain"

if [ "$(id -u)" -ne 0 ]; then
    echo "bootstrap: run as root (installs packages, mounts bpffs, loads eBPF programs)" >&2
    exit 1
fi

# Debian packages: the tests' tools, the reference CNI plugins, what the nftables backend runs
# (nft, and conntrack to drop the connections of a hostPort that changed owner), and the real
# runtimes the tests drive — containerd's CRI (with runc; protoc builds the CRI client) and
# podman — with busybox-static for the images they run; python3-venv for the manifest validator;
# prometheus (server and promtool) for the metrics tests; the arm64 cross linker and C library
# for the node image's second architecture, and qemu-user-static to run that binary in a test.
packages=(iproute2 nftables conntrack iptables bpftool containernetworking-plugins jq iperf3 iputils-ping util-linux procps gcc libc6-dev fonts-dejavu-core containerd runc podman busybox-static protobuf-compiler python3-venv prometheus gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static)
missing=()
for package in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed'; then
        missing+=("$package")
    fi
done
if [ ${#missing[@]} -gt 0 ]; then
    step "installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
    step "Debian packages present"
fi

# Rust toolchains: rustup 1.29 (auto-install off) does not install what rust-toolchain.toml
# names by itself.
if ! command -v rustup >/dev/null 2>&1; then
    # shellcheck disable=SC1091
    [ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
fi
if ! command -v rustup >/dev/null 2>&1; then
    echo "bootstrap: rustup is required (the machine's Rust installation)" >&2
    exit 1
fi
installed_toolchains=$(rustup toolchain list)
ensure_toolchain() {
    local channel=$1
    shift
    local components=("$@")
    if ! grep -q "^$channel-" <<<"$installed_toolchains"; then
        step "installing Rust toolchain $channel"
        rustup toolchain install "$channel" --profile minimal "${components[@]/#/--component=}" >/dev/null
        return
    fi
    local have
    have=$(rustup component list --installed --toolchain "$channel" 2>/dev/null)
    for component in "${components[@]}"; do
        if ! grep -q "^$component" <<<"$have"; then
            step "adding $component to $channel"
            rustup component add --toolchain "$channel" "$component" >/dev/null
        fi
    done
}
ensure_toolchain "$userspace_toolchain" clippy rustfmt
ensure_toolchain "$ebpf_toolchain" rust-src llvm-tools clippy rustfmt
# The node image's arm64 binary is cross-compiled by the userspace toolchain.
if ! rustup target list --installed --toolchain "$userspace_toolchain" | grep -q '^aarch64-unknown-linux-gnu$'; then
    step "adding target aarch64-unknown-linux-gnu to $userspace_toolchain"
    rustup target add --toolchain "$userspace_toolchain" aarch64-unknown-linux-gnu >/dev/null
fi
step "toolchains $userspace_toolchain (userspace, x86_64 and aarch64) and $ebpf_toolchain (eBPF) present"

# bpf-linker must link the very libLLVM of the eBPF nightly; it is rebuilt when that changes.
nightly_lib="$(rustup run "$ebpf_toolchain" rustc --print sysroot)/lib"
llvm_so=$(cd "$nightly_lib" && ls libLLVM.so.* 2>/dev/null | head -n1 || true)
if [ -z "$llvm_so" ]; then
    echo "bootstrap: $ebpf_toolchain ships no libLLVM.so.* in $nightly_lib" >&2
    exit 1
fi
stamp="$tools_dir/llvm.stamp"
if [ ! -x "$tools_dir/bin/bpf-linker" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$llvm_so" ]; then
    step "building bpf-linker 0.13 against $llvm_so (about a minute)"
    mkdir -p "$tools_dir/llvm/lib"
    ln -sf "$nightly_lib/$llvm_so" "$tools_dir/llvm/lib/libLLVM.so"
    ln -sf "$nightly_lib/$llvm_so" "$tools_dir/llvm/lib/$llvm_so"
    LLVM_PREFIX="$tools_dir/llvm" cargo "+$userspace_toolchain" install --quiet --locked --force \
        bpf-linker --version 0.13.0 --root "$tools_dir" 2>&1 | grep -v '^warning' || true
    [ -x "$tools_dir/bin/bpf-linker" ] || { echo "bootstrap: bpf-linker build failed" >&2; exit 1; }
    echo "$llvm_so" >"$stamp"
else
    step "bpf-linker present for $llvm_so"
fi

# The Kubernetes manifests are validated offline against the API's schemas, which this PyPI
# package bundles (the version names the Kubernetes release it validates against).
validator_dir="${CNIBPF_TOOLS_DIR:-$HOME/.local/share/cnibpf-tools}/kubernetes-validate"
validator_version=1.37.0
if [ "$("$validator_dir/bin/kubernetes-validate" --version 2>/dev/null)" != "$validator_version" ]; then
    step "installing kubernetes-validate $validator_version (PyPI) in $validator_dir"
    python3 -m venv "$validator_dir"
    "$validator_dir/bin/pip" install --quiet --disable-pip-version-check "kubernetes-validate==$validator_version"
else
    step "kubernetes-validate $validator_version present"
fi

# The reference portmap with its own nftables backend (plugins >= 1.5): Debian 12 packages
# 1.1.1 (iptables only), so the tests unpack the binaries of Debian unstable's package into a
# directory of their own. Nothing is installed into the system: apt reads unstable's index
# into a state directory of its own.
unstable_plugins_dir="${CNIBPF_TOOLS_DIR:-$HOME/.local/share/cnibpf-tools}/cni-plugins-unstable"
if [ ! -x "$unstable_plugins_dir/usr/lib/cni/portmap" ]; then
    step "unpacking Debian unstable's containernetworking-plugins in $unstable_plugins_dir"
    apt_state=$(mktemp -d)
    mkdir -p "$apt_state/lists/partial" "$apt_state/cache/archives/partial"
    echo "deb http://deb.debian.org/debian sid main" >"$apt_state/sources.list"
    apt_options=(-o "Dir::Etc::sourcelist=$apt_state/sources.list" -o Dir::Etc::sourceparts=/dev/null
        -o "Dir::State::Lists=$apt_state/lists" -o "Dir::Cache=$apt_state/cache" -o Debug::NoLocking=1
        -o APT::Sandbox::User=root)
    apt-get "${apt_options[@]}" update -qq
    (cd "$apt_state" && apt-get "${apt_options[@]}" download -qq containernetworking-plugins)
    rm -rf "$unstable_plugins_dir.partial"
    dpkg-deb -x "$apt_state"/containernetworking-plugins_*.deb "$unstable_plugins_dir.partial"
    rm -rf "$unstable_plugins_dir" "$apt_state"
    mv "$unstable_plugins_dir.partial" "$unstable_plugins_dir"
else
    step "Debian unstable's portmap present in $unstable_plugins_dir"
fi

# bpffs: the plugin mounts it itself when missing; the tests and bpftool want it now.
if ! stat -f -c %T /sys/fs/bpf 2>/dev/null | grep -q bpf; then
    step "mounting bpffs on /sys/fs/bpf"
    mkdir -p /sys/fs/bpf
    mount -t bpf bpf /sys/fs/bpf
fi
step "ready"
