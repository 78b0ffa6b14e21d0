"""Builds the lossd client package; its gRPC stubs are generated from proto/lossd/v1/lossd.proto.

Two files come from the repository around client/python: the proto and VERSION (the version's one
source, shared with the server and lossctl). An sdist carries copies of both at its top, so that a
wheel builds from the sdist alone (`python -m build` builds the wheel from the unpacked sdist);
$LOSSD_PROTO_ROOT overrides where the proto is read from.

Stubs come from protoc + grpc_python_plugin when both are on PATH, else from grpcio-tools' bundled
protoc (a build requirement). Stubs from grpcio-tools check at import time that the installed
protobuf and grpcio are at least the versions that generated them, so those become the floors.
"""
import importlib.metadata
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_NAME = os.path.join("lossd", "v1", "lossd.proto")
PROTOC = shutil.which("protoc")
GRPC_PYTHON_PLUGIN = shutil.which("grpc_python_plugin")
USE_GRPC_TOOLS = not (PROTOC and GRPC_PYTHON_PLUGIN)


def repository_file(relative):
    """The sdist's copy of a repository file (relative to the repository root) when there is one,
    else the file in the checkout around client/python."""
    for root in (HERE, os.path.join(HERE, "..", "..")):
        path = os.path.normpath(os.path.join(root, relative))
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"{relative}: neither in {HERE} (an sdist) nor in the repository "
                            f"around it; build from a lossd checkout or its sdist")


def proto_root():
    if "LOSSD_PROTO_ROOT" in os.environ:
        return os.environ["LOSSD_PROTO_ROOT"]
    return os.path.dirname(os.path.dirname(os.path.dirname(
        repository_file(os.path.join("proto", PROTO_NAME)))))


def read_version():
    with open(repository_file("VERSION"), encoding="utf-8") as f:
        return f.read().strip()


def runtime_requirements():
    if not USE_GRPC_TOOLS:
        return ["grpcio>=1.51", "protobuf>=4.21", "numpy"]
    return [f"grpcio>={importlib.metadata.version('grpcio-tools')}",
            f"protobuf>={importlib.metadata.version('protobuf')}", "numpy"]


def generate_stubs(out_dir):
    """Writes lossd/v1/lossd_pb2.py and lossd_pb2_grpc.py under out_dir."""
    root = proto_root()
    arguments = [f"-I{root}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}",
                 os.path.join(root, PROTO_NAME)]
    if not USE_GRPC_TOOLS:
        subprocess.run([PROTOC, f"--plugin=protoc-gen-grpc_python={GRPC_PYTHON_PLUGIN}",
                        *arguments], check=True)
        return
    from grpc_tools import protoc
    if protoc.main(["protoc", *arguments]) != 0:
        raise RuntimeError(f"grpc_tools.protoc failed on {os.path.join(root, PROTO_NAME)}")


class BuildPyWithGenerated(build_py):
    """The package plus its generated modules: the stubs and lossd/_version.py."""

    def run(self):
        super().run()
        generate_stubs(self.build_lib)
        with open(os.path.join(self.build_lib, "lossd", "_version.py"), "w",
                  encoding="utf-8") as f:
            f.write(f'__version__ = "{read_version()}"\n')


class SdistWithRepositoryFiles(sdist):
    """An sdist that also carries the proto and VERSION, at the paths repository_file() reads."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        for relative in (os.path.join("proto", PROTO_NAME), "VERSION"):
            target = os.path.join(base_dir, relative)
            os.makedirs(os.path.dirname(target) or base_dir, exist_ok=True)
            shutil.copyfile(repository_file(relative), target)


setup(version=read_version(), install_requires=runtime_requirements(),
      cmdclass={"build_py": BuildPyWithGenerated, "sdist": SdistWithRepositoryFiles})
