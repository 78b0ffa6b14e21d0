#!/usr/bin/env bash
# Installs every Debian package lossd needs (idempotent; run as root or with sudo available) and
# builds the project into build/. The CUDA backend module is built when nvcc is found; pass
# -DLOSSD_WITH_CUDA=OFF in LOSSD_CMAKE_ARGS to skip it.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  build-essential cmake ninja-build pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  prometheus-cpp-dev libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev libopenblas0-openmp
  nlohmann-json3-dev libssl-dev libgloo-dev clang-format
  python3-grpcio python3-protobuf python3-numpy python3-pytest python3-torch python3-yaml
  python3-venv python3-pip python3-setuptools python3-wheel prometheus
)

source scripts/ensure_packages.sh
ensure_packages "${packages[@]}"

cuda_args=()
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  cuda_args=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
fi
# shellcheck disable=SC2086
cmake -S . -B build -G Ninja "${cuda_args[@]}" ${LOSSD_CMAKE_ARGS:-}
cmake --build build --parallel "$(nproc)"
