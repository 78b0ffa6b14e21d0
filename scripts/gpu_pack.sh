#!/usr/bin/env bash
# Builds the engine tests and benchmark with the CUDA backend (for Hopper, sm_90) and packs them,
# with the non-system shared libraries they need, into .gpu/ so they can run on a GPU machine that
# has the CUDA driver and cuBLAS but none of this project's Debian packages. scripts/gpu_round.sh
# runs them there.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build-gpu -G Ninja -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc \
  -DLOSSD_CUDA_ARCHITECTURES=90 >/dev/null
cmake --build build-gpu --target engine_test engine_bench lossd_cuda
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib
cp build-gpu/bin/engine_test build-gpu/bin/engine_bench build-gpu/bin/liblossd_cuda.so .gpu/bin/
# Everything ldd resolves outside the C library and cuBLAS (which the GPU machine has).
for binary in .gpu/bin/*; do
  ldd "$binary" | awk '/=> \// {print $3}'
done | sort -u | grep -v -E '/(libc|libm|libdl|libpthread|librt|libcublas|libcublasLt)\.so' |
  while read -r library; do cp -L "$library" .gpu/lib/; done
strip --strip-unneeded .gpu/bin/* .gpu/lib/* 2>/dev/null || true
du -sh .gpu
