#!/usr/bin/env bash
# lossd against the torch users install (naive, hand-chunked, torch.compile'd chunks, torch's own
# F.linear_cross_entropy) and the GEMM floors on this machine, in-process and over loopback gRPC,
# with transport figures and plots: see bench/peers.py. Installs what it needs, builds into build/
# (scripts/setup.sh on a fresh clone), runs in the virtual environment with the current torch from
# the package registry that the tests use (scripts/python_env.sh: $LOSSD_VENV, default .venv; CPU
# use only); arguments go to peers.py (--quick for a short look, --help for the rest). About 30
# minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f build/CMakeCache.txt ] || scripts/setup.sh
cmake --build build --target engine_bench grpc_echo_bench lossd_server lossctl lossd_python
python=$(scripts/python_env.sh)
exec "$python" bench/peers.py "$@"
