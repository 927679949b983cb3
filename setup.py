"""Build of dynamix-byteps: the pybind11 extension ``dynamix_byteps._core`` and the gRPC modules.

Project metadata lives in pyproject.toml; this file only adds what needs code:

* ``_core`` is compiled from ``csrc/*.cpp`` (C++17, -O2). It does not link against torch.
* ``dynamix_byteps/control/dynamix_pb2{,_grpc}.py`` (and ``.pyi``) are generated from
  ``protos/*.proto`` with ``grpc_tools.protoc`` whenever ``build_py`` runs, which both
  ``pip install .`` and ``pip install -e .`` do. protoc writes ``import dynamix_pb2`` into the
  grpc module, which only works with the package directory on ``sys.path``; it is rewritten to
  a package-relative import. The files are gitignored; edit the .proto, never them.
* Runtime ``grpcio``/``protobuf`` lower bounds are taken from the grpcio-tools that generated
  the code: its generated modules refuse to import under an older runtime.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_DIR = ROOT / "protos"
PROTO_PACKAGE_DIR = ROOT / "dynamix_byteps" / "control"


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


class BuildPyWithProtos(build_py):
    """build_py that first regenerates the protobuf/gRPC modules into the source tree."""

    def run(self) -> None:
        generate_protos()
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
        "prometheus-client",
        "tqdm",
    ],
    zip_safe=False,
)
