#!/usr/bin/env bash
# Debian packages the project needs: Fashion-MNIST (the main job's data), a C++ compiler
# for the native core, the eBPF collector's toolchain and loader library (clang, llvm,
# libbpf-dev, bpftool, libbpf1) and what its tests use (nftables, iproute2, and the MPI launchers
# Horovod users start jobs with: Open MPI's mpirun, MPICH's mpiexec; Slurm and munge, whose daemons
# tests/slurm_cluster.py starts for a test: installing them starts none in a container).
# Uses sudo when not root; skips what is already installed.
set -euo pipefail
packages=(dataset-fashion-mnist g++ clang llvm libbpf-dev libbpf1 bpftool nftables iproute2)
# Without their recommended packages: mpich's would bring its development files and a Fortran compiler,
# slurm-wlm's the plugins for MySQL, HDF5, RRD, IPMI and others.
lean_packages=(openmpi-bin mpich slurm-wlm munge)
absent() { for p in "$@"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || echo "$p"; done; }
mapfile -t missing < <(absent "${packages[@]}")
mapfile -t missing_lean < <(absent "${lean_packages[@]}")
[ $((${#missing[@]} + ${#missing_lean[@]})) -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null; then
  echo "error: need the Debian packages ${missing[*]} ${missing_lean[*]} but apt-get is missing; install them (or point --data-dir at Fashion-MNIST)" >&2
  exit 1
fi
run() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
run apt-get update -qq
apt_install() { DEBIAN_FRONTEND=noninteractive run apt-get install -y -qq "$@"; }
[ ${#missing[@]} -eq 0 ] || apt_install "${missing[@]}"
[ ${#missing_lean[@]} -eq 0 ] || apt_install --no-install-recommends "${missing_lean[@]}"
