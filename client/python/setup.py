"""Builds the lossd client package; its gRPC stubs are generated from proto/lossd/v1/lossd.proto.

Stubs come from protoc + grpc_python_plugin when both are on PATH, else from grpcio-tools' bundled
protoc (a build requirement). Stubs from grpcio-tools check at import time that the installed
protobuf and grpcio are at least the versions that generated them, so those become the floors.
The proto is read from ../../proto (the repository), or from $LOSSD_PROTO_ROOT.
"""
import importlib.metadata
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.environ.get("LOSSD_PROTO_ROOT", os.path.join(HERE, "..", "..", "proto"))
PROTO_FILE = os.path.join(PROTO_ROOT, "lossd", "v1", "lossd.proto")
PROTOC = shutil.which("protoc")
GRPC_PYTHON_PLUGIN = shutil.which("grpc_python_plugin")
USE_GRPC_TOOLS = not (PROTOC and GRPC_PYTHON_PLUGIN)


def runtime_requirements():
    if not USE_GRPC_TOOLS:
        return ["grpcio>=1.51", "protobuf>=4.21", "numpy"]
    return [f"grpcio>={importlib.metadata.version('grpcio-tools')}",
            f"protobuf>={importlib.metadata.version('protobuf')}", "numpy"]


def generate_stubs(out_dir):
    """Writes lossd/v1/lossd_pb2.py and lossd_pb2_grpc.py under out_dir."""
    arguments = [f"-I{PROTO_ROOT}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}",
                 PROTO_FILE]
    if not USE_GRPC_TOOLS:
        subprocess.run([PROTOC, f"--plugin=protoc-gen-grpc_python={GRPC_PYTHON_PLUGIN}",
                        *arguments], check=True)
        return
    from grpc_tools import protoc
    if protoc.main(["protoc", *arguments]) != 0:
        raise RuntimeError(f"grpc_tools.protoc failed on {PROTO_FILE}")


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        generate_stubs(self.build_lib)


setup(install_requires=runtime_requirements(), cmdclass={"build_py": BuildPyWithStubs})
