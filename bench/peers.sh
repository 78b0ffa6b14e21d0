#!/usr/bin/env bash
# lossd against the torch users install (naive, hand-chunked, torch.compile'd chunks, torch's own
# F.linear_cross_entropy) and the GEMM floors on this machine, in-process and over loopback gRPC,
# with transport figures and plots: see bench/peers.py. Installs what it needs, builds into build/
# (scripts/setup.sh on a fresh clone), makes a virtual environment with the current torch from the
# package registry ($LOSSD_VENV, default .venv; CPU use only), then runs; arguments go to peers.py
# (--quick for a short look, --help for the rest). About 30 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ensure_packages.sh
ensure_packages python3-venv
[ -f build/CMakeCache.txt ] || scripts/setup.sh
cmake --build build --target engine_bench grpc_echo_bench lossd_server lossctl lossd_python
venv="${LOSSD_VENV:-$PWD/.venv}"
[ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check torch numpy matplotlib grpcio protobuf
exec "$venv/bin/python" bench/peers.py "$@"
