#!/usr/bin/env bash
# Debian packages the project needs: Fashion-MNIST (the main job's data), a C++ compiler
# for the native core, the eBPF collector's toolchain and loader library (clang, llvm,
# libbpf-dev, bpftool, libbpf1) and what its tests use (nftables, iproute2).
# Uses sudo when not root; skips what is already installed.
set -euo pipefail
packages=(dataset-fashion-mnist g++ clang llvm libbpf-dev libbpf1 bpftool nftables iproute2)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null; then
  echo "error: need the Debian packages ${missing[*]} but apt-get is missing; install them (or point --data-dir at Fashion-MNIST)" >&2
  exit 1
fi
run() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
run apt-get update -qq
DEBIAN_FRONTEND=noninteractive run apt-get install -y -qq "${missing[@]}"
