"""Lets the examples run from a checkout as their docstrings say (/usr/bin/python3 EXAMPLE.py),
without installing lossd: when `import lossd` would fail, the package the build assembles in
<repository>/build/python (`cmake --build build --target lossd_python`, part of every build)
goes first on sys.path. An installed lossd is used as it is."""
import importlib.util
import os
import sys

BUILT_PACKAGE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                              "..", "..", "build", "python"))

if importlib.util.find_spec("lossd") is None:
    if not os.path.isfile(os.path.join(BUILT_PACKAGE, "lossd", "v1", "lossd_pb2_grpc.py")):
        raise ModuleNotFoundError(
            f"lossd is neither installed nor built in {BUILT_PACKAGE}: install it (pip install "
            f"./client/python) or build it (cmake --build build --target lossd_python)",
            name="lossd")
    sys.path.insert(0, BUILT_PACKAGE)
