#!/usr/bin/env bash
# Packs the GPU round (scripts/gpu_round.sh, whose header is the runbook) into .gpu/, on a Debian 12
# machine with the CUDA toolkit: builds the engine tests, the GEMM probe, the device-fault test, the
# engine benchmark, gRPC's echo benchmark, the server, lossctl and the Python client with the CUDA
# backend for Hopper (sm_90), and a second CUDA module for sm_100 only, which Hopper must refuse;
# then
#   .gpu/lossd-gpu.tar.xz  bin/ (the programs and liblossd_cuda.so), lib/ (every shared library
#                          they load that the GPU machine lacks: all but the C library's, the C++
#                          runtime's and CUDA's), lib-fallback/ (this machine's libstdc++ and
#                          libgcc_s, for a GPU machine whose own are older than the programs
#                          need), sm100/, python/ (the lossd package with its gRPC stubs) and
#                          MANIFEST.txt (commit, glibc and GLIBCXX needed, cuBLAS sonames);
#   .gpu/wheels/peers/     Liger-Kernel 0.8.5 and Cut Cross-Entropy 25.1.1 (pure Python; torch and
#                          Triton, their only needs, are on the GPU machine), for call 1's peers;
#   .gpu/wheels/grpc/      grpcio and protobuf for CPython 3.12 (the GPU machine's), for call 2's
#                          Python client should the machine's own not import it.
# The archive is xz's (gzip's would take about a third more of the 64 MiB that travel); on a GPU
# machine without xz, gpu_round.sh unpacks it with python3's lzma.
# .gpu/ is git-ignored: the GPU machine gets it only when its tool is told to carry it. Everything
# sent there (working tree and .gpu/) must stay under 64 MiB; this script fails above
# LOSSD_GPU_PACK_LIMIT_MIB (default 40). LOSSD_GPU_BUILD_DIR picks the build folder (build-gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${LOSSD_GPU_BUILD_DIR:-build-gpu}"
limit_mib="${LOSSD_GPU_PACK_LIMIT_MIB:-40}"
nvcc=/usr/local/cuda/bin/nvcc
[ -x "$nvcc" ] || { echo "gpu_pack: $nvcc not found: the CUDA toolkit is needed" >&2; exit 1; }
programs=(engine_test cuda_gemm_probe_test device_fault_test engine_bench distill_bench lossd_server
  lossctl grpc_echo_bench)

cmake -S . -B "$build" -G Ninja -DCMAKE_CUDA_COMPILER="$nvcc" -DLOSSD_CUDA_ARCHITECTURES=90 \
  >/dev/null
cmake --build "$build" --target "${programs[@]}" lossd_cuda lossd_python
# A module with machine code for sm_100 only and no PTX, which a Hopper GPU cannot run:
# gpu_round.sh checks that the backend refuses it at creation, naming the architectures.
cmake -S . -B "$build-sm100" -G Ninja -DCMAKE_CUDA_COMPILER="$nvcc" \
  -DLOSSD_CUDA_ARCHITECTURES=100-real >/dev/null
cmake --build "$build-sm100" --target lossd_cuda

staging="$(mktemp -d)"
trap 'rm -rf "$staging"' EXIT
mkdir -p "$staging/bin" "$staging/lib" "$staging/lib-fallback" "$staging/sm100"
for program in "${programs[@]}" liblossd_cuda.so; do
  cp "$build/bin/$program" "$staging/bin/"
done
cp "$build-sm100/bin/liblossd_cuda.so" "$staging/sm100/"
cp -r "$build/python" "$staging/python"
find "$staging/python" -name __pycache__ -prune -exec rm -rf {} +

# Every library ldd resolves, but the C library's own (the GPU machine's glibc serves them) and
# CUDA's (its driver and toolkit serve them; cuBLAS must match the toolkit it was built with).
# The C++ runtime goes to lib-fallback/: loaded into our programs, an older one than the GPU
# machine's would also serve compute-sanitizer's library injected into them, which may need more.
system_or_cuda='/(libc|libm|libdl|libpthread|librt|libresolv|ld-linux-x86-64|libcuda|libcudart|libcublas|libcublasLt)\.so'
cxx_runtime='/(libstdc\+\+|libgcc_s)\.so'
if ldd "$staging"/bin/* "$staging"/sm100/* | grep -q "not found"; then
  ldd "$staging"/bin/* | grep "not found" >&2
  echo "gpu_pack: a library is missing here" >&2
  exit 1
fi
ldd "$staging"/bin/* | awk '/=> \// {print $3}' | sort -u | grep -v -E "$system_or_cuda" |
  while read -r library; do
    if [[ "$library" =~ $cxx_runtime ]]; then
      cp -L "$library" "$staging/lib-fallback/"
    else
      cp -L "$library" "$staging/lib/"
    fi
  done
strip --strip-unneeded "$staging"/bin/* "$staging"/lib/* "$staging"/lib-fallback/* \
  "$staging"/sm100/*

# The newest symbol version of each runtime that anything packed asks for.
newest() { objdump -T "$staging"/bin/* "$staging"/lib/* | grep -o "$1" | sort -V -u | tail -n 1; }
glibc_needed="$(newest 'GLIBC_2\.[0-9]*')"
glibcxx_needed="$(newest 'GLIBCXX_3\.4\.[0-9]*')"
cublas_sonames="$(readelf -d "$staging/bin/liblossd_cuda.so" | grep -o 'libcublas[A-Za-z]*\.so\.[0-9]*' |
  sort -u | tr '\n' ' ')"
{
  echo "commit $(git rev-parse HEAD)$(git diff --quiet HEAD || echo ' (with uncommitted changes)')"
  echo "packed $(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -n)"
  echo "glibc_needed ${glibc_needed#GLIBC_}"
  echo "glibcxx_needed $glibcxx_needed"
  echo "cublas_sonames $cublas_sonames"
  echo "cuda_architectures 90 (sm100/: 100-real)"
  echo "libraries $(find "$staging/lib" -type f -printf '%f\n' | sort | tr '\n' ' ')"
} >"$staging/MANIFEST.txt"

rm -rf .gpu && mkdir -p .gpu/wheels/peers .gpu/wheels/grpc
tar -C "$staging" -cf - MANIFEST.txt bin lib lib-fallback sm100 python | xz -T0 -6 \
  >.gpu/lossd-gpu.tar.xz

# Pure-Python wheels: one file each, whatever the platform.
python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu/wheels/peers \
  liger-kernel==0.8.5 cut-cross-entropy==25.1.1
# The versions whose runtime was checked against stubs from Debian's protoc (see the service step).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/wheels/grpc \
  grpcio==1.85.1 protobuf==7.36.2

size_mib=$(($(du -sb .gpu | cut -f1) >> 20))
echo "gpu_pack: .gpu/ holds $(du -sh .gpu | cut -f1) (lossd-gpu.tar.xz $(du -h .gpu/lossd-gpu.tar.xz |
  cut -f1), wheels $(du -sh .gpu/wheels | cut -f1)); glibc ${glibc_needed#GLIBC_} or later needed"
if [ "$size_mib" -ge "$limit_mib" ]; then
  echo "gpu_pack: .gpu/ is ${size_mib} MiB, over the ${limit_mib} MiB it may take of the 64 MiB" \
    "that travel to the GPU machine" >&2
  exit 1
fi
