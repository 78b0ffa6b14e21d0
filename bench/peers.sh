#!/usr/bin/env bash
# lossd against torch (naive and chunked) and the GEMM floor on this machine, in-process and over
# loopback gRPC, with transport figures and plots: see bench/peers.py. Installs what it needs,
# builds into build/ (scripts/setup.sh on a fresh clone), then runs; arguments go to peers.py
# (--quick for a 2-minute look, --help for the rest). About 20 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ensure_packages.sh
ensure_packages python3-matplotlib python3-torch
[ -f build/CMakeCache.txt ] || scripts/setup.sh
cmake --build build --target engine_bench grpc_echo_bench lossd_server lossctl lossd_python
exec /usr/bin/python3 bench/peers.py "$@"
