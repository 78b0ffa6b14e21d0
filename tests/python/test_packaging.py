"""The Python client as a package: an sdist and a wheel built from it, installed into a fresh venv.

`python -m build client/python` builds the sdist, then the wheel from the unpacked sdist alone, so
the sdist must carry the proto the stubs are generated from and the VERSION file. The wheel,
installed into a fresh venv, imports lossd and its stubs from outside the repository, reports the
repository's version and talks to a real server.

The build runs from a copy of the repository's files that the package needs, so nothing is written
into the checkout. `build` and the wheel's dependencies come from PyPI; without PyPI the sdist is
made with setup.py and the wheel with `pip wheel` from the unpacked sdist, both on Debian's
setuptools, and the wheel is installed into a venv that sees Debian's grpcio, protobuf and numpy.
"""
import glob
import os
import shutil
import subprocess
import tarfile
import venv
import zipfile

import pytest

from server_process import ServerProcess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
with open(os.path.join(REPO, "VERSION"), encoding="utf-8") as version_file:
    VERSION = version_file.read().strip()
PIP_NETWORK = ["--retries", "1", "--timeout", "20"]


def run(*command, cwd=None, timeout=600):
    done = subprocess.run([str(part) for part in command], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, \
        f"{command} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def make_venv(path, system_site_packages=False):
    venv.EnvBuilder(with_pip=True, system_site_packages=system_site_packages).create(path)
    return os.path.join(path, "bin", "python")


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """What building the package reads from a checkout: client/python, the proto and VERSION."""
    root = tmp_path_factory.mktemp("checkout")
    shutil.copytree(os.path.join(REPO, "client", "python"), root / "client" / "python",
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__",
                                                  "lossd_pb2*.py", "_version.py"))
    shutil.copytree(os.path.join(REPO, "proto"), root / "proto")
    shutil.copy(os.path.join(REPO, "VERSION"), root / "VERSION")
    return root


@pytest.fixture(scope="module")
def pypi(tmp_path_factory):
    """A venv with PyPI's `build` in it, or None where PyPI cannot be reached."""
    python = make_venv(tmp_path_factory.mktemp("build-venv"))
    installed = subprocess.run([python, "-m", "pip", "install", "-q", *PIP_NETWORK, "build"],
                               capture_output=True, text=True, timeout=600)
    return python if installed.returncode == 0 else None


@pytest.fixture(scope="module")
def dist(checkout, pypi, tmp_path_factory):
    """(sdist, wheel): the wheel built from the unpacked sdist."""
    out = tmp_path_factory.mktemp("dist")
    package = checkout / "client" / "python"
    if pypi:
        run(pypi, "-m", "build", "--outdir", out, package)
    else:
        print("PyPI unreachable: setup.py sdist and pip wheel with Debian's setuptools")
        run("/usr/bin/python3", "setup.py", "-q", "sdist", "--dist-dir", out, cwd=package)
        (sdist,) = glob.glob(str(out / "*.tar.gz"))
        unpacked = tmp_path_factory.mktemp("unpacked")
        with tarfile.open(sdist) as archive:
            archive.extractall(unpacked)
        (source,) = unpacked.iterdir()
        run("/usr/bin/python3", "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
            "--wheel-dir", out, source)
    (sdist,) = glob.glob(str(out / "lossd-*.tar.gz"))
    (wheel,) = glob.glob(str(out / "lossd-*.whl"))
    return sdist, wheel


def test_sdist_carries_the_proto_and_the_version(dist):
    sdist, _ = dist
    assert os.path.basename(sdist) == f"lossd-{VERSION}.tar.gz"
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
        proto = archive.extractfile(f"lossd-{VERSION}/proto/lossd/v1/lossd.proto").read()
        version = archive.extractfile(f"lossd-{VERSION}/VERSION").read().decode().strip()
    assert {"setup.py", "pyproject.toml", "README.md", "lossd/client.py", "lossd/torch.py"} <= names
    with open(os.path.join(REPO, "proto", "lossd", "v1", "lossd.proto"), "rb") as f:
        assert proto == f.read()
    assert version == VERSION


def test_wheel_holds_the_stubs_and_the_version(dist):
    _, wheel = dist
    assert os.path.basename(wheel) == f"lossd-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        version_module = archive.read("lossd/_version.py").decode()
        metadata = archive.read(f"lossd-{VERSION}.dist-info/METADATA").decode()
    assert {"lossd/v1/lossd_pb2.py", "lossd/v1/lossd_pb2_grpc.py", "lossd/torch.py"} <= names
    assert version_module == f'__version__ = "{VERSION}"\n'
    assert f"\nVersion: {VERSION}\n" in metadata
    assert "Requires-Dist: grpcio" in metadata and "Requires-Dist: protobuf" in metadata


def test_installed_wheel_imports_and_calls_a_server(dist, pypi, tmp_path):
    _, wheel = dist
    python = make_venv(tmp_path / "venv", system_site_packages=not pypi)
    run(python, "-m", "pip", "install", "-q", *(PIP_NETWORK if pypi else ["--no-index"]), wheel)
    script = (
        "import importlib.metadata, sys\n"
        "import lossd, lossd.v1.lossd_pb2, lossd.v1.lossd_pb2_grpc\n"
        "assert lossd.__file__.startswith(sys.prefix), lossd.__file__\n"
        "print(lossd.__version__, importlib.metadata.version('lossd'))\n"
        "with lossd.Client(sys.argv[1], timeout=600) as client:\n"
        "    print(' '.join(head.name for head in client.list_heads()))\n")
    with ServerProcess("--device=cpu", "--demo_vocab_size=64", "--demo_hidden_size=8",
                       metrics=False) as server:
        # From a folder outside the checkout, with nothing of the build tree on the path.
        out = subprocess.run([python, "-c", script, server.address], cwd=tmp_path,
                             capture_output=True, text=True, timeout=600,
                             env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split("\n")[:2] == [f"{VERSION} {VERSION}", "demo"], out.stdout
