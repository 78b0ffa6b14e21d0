#!/usr/bin/env bash
# Builds the engine tests, the engine benchmark, the server and lossctl with the CUDA backend (for
# Hopper, sm_90) and packs them, with the non-system shared libraries they need, into
# .gpu/lossd-gpu.tar.xz (about 13 MB; unpacked, 64 MB), so that they run on a GPU machine that has
# the CUDA driver and cuBLAS but none of this project's Debian packages. Liger-Kernel's and Cut
# Cross-Entropy's wheels go to .gpu/wheels when pip can fetch them. scripts/gpu_round.sh runs
# everything there. LOSSD_GPU_BUILD_DIR picks the build folder (default build-gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${LOSSD_GPU_BUILD_DIR:-build-gpu}"
cmake -S . -B "$build" -G Ninja -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc \
  -DLOSSD_CUDA_ARCHITECTURES=90 >/dev/null
cmake --build "$build" --target engine_test engine_bench lossd_server lossctl lossd_cuda
# A module with machine code for sm_100 only and no PTX, which a Hopper GPU cannot run:
# gpu_round.sh checks that the backend refuses it at creation, naming the architectures.
cmake -S . -B "$build-sm100" -G Ninja -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc \
  -DLOSSD_CUDA_ARCHITECTURES=100-real >/dev/null
cmake --build "$build-sm100" --target lossd_cuda
staging="$(mktemp -d)"
trap 'rm -rf "$staging"' EXIT
mkdir -p "$staging/bin" "$staging/lib" "$staging/sm100"
for binary in engine_test engine_bench lossd_server lossctl liblossd_cuda.so; do
  cp "$build/bin/$binary" "$staging/bin/"
done
cp "$build-sm100/bin/liblossd_cuda.so" "$staging/sm100/"
# Everything ldd resolves outside the C library and cuBLAS (which the GPU machine has).
for binary in "$staging"/bin/*; do
  ldd "$binary" | awk '/=> \// {print $3}'
done | sort -u | grep -v -E '/(libc|libm|libdl|libpthread|librt|libcublas|libcublasLt)\.so' |
  while read -r library; do cp -L "$library" "$staging/lib/"; done
strip --strip-unneeded "$staging"/bin/* "$staging"/lib/* "$staging"/sm100/* 2>/dev/null || true
rm -rf .gpu && mkdir -p .gpu
tar -C "$staging" -cf - bin lib sm100 | xz -T0 -6 >.gpu/lossd-gpu.tar.xz
# The GPU machine's Python (3.12) has torch and Triton but not these two fused-kernel peers.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .gpu/wheels liger-kernel cut-cross-entropy ||
  echo "gpu_pack: no wheels for liger-kernel and cut-cross-entropy; gpu_round.sh will skip them"
du -sh .gpu
