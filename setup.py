"""Build of dynamix-byteps: the pybind11 extension ``dynamix_byteps._core`` and the gRPC modules.

Project metadata lives in pyproject.toml; this file only adds what needs code:

* ``_core`` is compiled from ``csrc/*.cpp`` (C++17, -O2). It does not link against torch.
* ``dynamix_byteps/control/dynamix_pb2{,_grpc}.py`` (and ``.pyi``) are generated from
  ``protos/*.proto`` with ``grpc_tools.protoc`` whenever ``build_py`` runs, which both
  ``pip install .`` and ``pip install -e .`` do. protoc writes ``import dynamix_pb2`` into the
  grpc module, which only works with the package directory on ``sys.path``; it is rewritten to
  a package-relative import. The files are gitignored; edit the .proto, never them.
* ``dynamix_byteps/agent/sockstat.bpf.o`` (the eBPF collector's CO-RE object) is compiled from
  ``ebpf/sockstat.bpf.c`` by ``build_py`` when clang, bpftool and the kernel's BTF are present;
  otherwise one line is printed and the package installs without it (the agent falls back).
* Runtime ``grpcio``/``protobuf`` lower bounds are taken from the grpcio-tools that generated
  the code: its generated modules refuse to import under an older runtime.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_DIR = ROOT / "protos"
PROTO_PACKAGE_DIR = ROOT / "dynamix_byteps" / "control"
BPF_SOURCE = ROOT / "ebpf" / "sockstat.bpf.c"
BPF_OBJECT = ROOT / "dynamix_byteps" / "agent" / "sockstat.bpf.o"
VMLINUX_BTF = Path("/sys/kernel/btf/vmlinux")


def generate_protos() -> None:
    """Run grpc_tools.protoc on every protos/*.proto into dynamix_byteps/control/."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    for proto in sorted(PROTO_DIR.glob("*.proto")):
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{well_known}",
            f"--python_out={PROTO_PACKAGE_DIR}",
            f"--pyi_out={PROTO_PACKAGE_DIR}",
            f"--grpc_python_out={PROTO_PACKAGE_DIR}",
            str(proto),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"grpc_tools.protoc failed on {proto}")
        stem = proto.stem
        grpc_module = PROTO_PACKAGE_DIR / f"{stem}_pb2_grpc.py"
        text = grpc_module.read_text()
        fixed, n = re.subn(rf"^import {stem}_pb2 as ", f"from . import {stem}_pb2 as ", text, flags=re.M)
        if n != 1:
            raise RuntimeError(f"expected one 'import {stem}_pb2' line in {grpc_module}, found {n}")
        grpc_module.write_text(fixed)


def build_bpf_object(build_temp: str) -> None:
    """Compile ebpf/sockstat.bpf.c into dynamix_byteps/agent/sockstat.bpf.o, if the toolchain is here.

    vmlinux.h is generated from the running kernel's BTF into ``build_temp``; the object is CO-RE,
    so it loads on other BTF kernels too. Without clang/bpftool/BTF the build goes on without it.
    """
    libbpf_include = Path(os.environ.get("LIBBPF_INCLUDE", "/usr/include"))  # bpf/bpf_helpers.h (libbpf-dev)
    missing = [t for t in ("clang", "bpftool") if shutil.which(t) is None]
    needed_files = (VMLINUX_BTF, libbpf_include / "bpf" / "bpf_helpers.h")
    missing += [str(p) for p in needed_files if not p.exists()]
    if missing:
        print(f"note: {', '.join(missing)} not found; the eBPF collector will be unavailable "
              "(scripts/install-system-packages.sh installs the toolchain)")
        return
    out_dir = Path(build_temp) / "ebpf"
    out_dir.mkdir(parents=True, exist_ok=True)
    vmlinux_h = out_dir / "vmlinux.h"
    try:
        with open(vmlinux_h, "w") as f:
            subprocess.run(["bpftool", "btf", "dump", "file", str(VMLINUX_BTF), "format", "c"], stdout=f, check=True)
        subprocess.run(["clang", "-g", "-O2", "-target", "bpf", "-D__TARGET_ARCH_x86", f"-I{out_dir}",
                        f"-I{libbpf_include}", "-c", str(BPF_SOURCE), "-o", str(BPF_OBJECT)], check=True)
        if shutil.which("llvm-strip"):  # drop DWARF (670 KB -> ~40 KB); BTF, which CO-RE needs, stays
            subprocess.run(["llvm-strip", "-g", str(BPF_OBJECT)], check=True)
    except subprocess.CalledProcessError as e:
        print(f"warning: building {BPF_OBJECT.name} failed ({e}); the eBPF collector will be unavailable")


class BuildPyWithProtos(build_py):
    """build_py that first regenerates the protobuf/gRPC modules and the eBPF object in the source tree."""

    def run(self) -> None:
        generate_protos()
        build_bpf_object(self.get_finalized_command("build").build_temp)
        super().run()


def grpc_runtime_requirements() -> list[str]:
    """grpcio/protobuf requirements matching the grpcio-tools used for code generation."""
    try:
        tools_version = importlib.metadata.version("grpcio-tools")
        tools_requires = importlib.metadata.requires("grpcio-tools") or []
    except importlib.metadata.PackageNotFoundError:
        return ["grpcio", "protobuf"]
    reqs = [f"grpcio>={tools_version}"]
    protobuf = [r for r in tools_requires if re.match(r"protobuf\b", r, re.I) and ";" not in r]
    reqs += protobuf or ["protobuf"]
    return reqs


ext_modules = [
    Pybind11Extension(
        "dynamix_byteps._core",
        sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp")),
        include_dirs=["csrc"],
        depends=sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.hpp")),
        cxx_std=17,
        extra_compile_args=["-O2"],
    )
]

setup(
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext, "build_py": BuildPyWithProtos},
    install_requires=[
        # CPU wheel on this project's machines; a CUDA build comes from the user's own index.
        "torch==2.13.0",
        "numpy",
        *grpc_runtime_requirements(),
        "psutil",
        "tqdm",
    ],
    zip_safe=False,
)
