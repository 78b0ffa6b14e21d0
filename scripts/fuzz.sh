#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, into build-fuzz: clang-14 with ASan and UBSan) and fuzzes
# each one for a bounded time, starting from its committed seed corpus (fuzz/corpus/<target>/)
# copied to a temporary folder, so the repository stays clean. Exits non-zero when a target crashes,
# leaks, trips a sanitizer or an invariant, or hangs; the reproducer is kept in build-fuzz/artifacts/
# (replay it with build-fuzz/bin/<target> <file>).
#
# Usage: scripts/fuzz.sh [seconds per target, default 30]
# Run after scripts/setup.sh, which installs the project's libraries.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-30}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || ((seconds < 1)); then
  echo "usage: $0 [seconds per target]" >&2
  exit 2
fi
targets=(fuzz_safetensors fuzz_compute_stream fuzz_compute_socket)

source scripts/ensure_packages.sh
ensure_packages clang-14 libclang-rt-14-dev libomp-14-dev

CC=clang-14 CXX=clang++-14 cmake -S . -B build-fuzz -G Ninja -DLOSSD_WITH_CUDA=OFF \
  -DLOSSD_SANITIZE=address -DLOSSD_FUZZ=ON -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g" >/dev/null
cmake --build build-fuzz --target "${targets[@]}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p build-fuzz/artifacts
# One input at a time gains nothing from thread pools, and their scheduling would make coverage
# less repeatable; single-threaded targets also let both run side by side on two cores.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export UBSAN_OPTIONS=print_stacktrace=1

pids=()
for target in "${targets[@]}"; do
  cp -r "fuzz/corpus/$target" "$work/$target"
  # -timeout: an input running this long is a hang worth reporting (the default is 20 minutes).
  build-fuzz/bin/"$target" "$work/$target" -max_total_time="$seconds" -timeout=10 \
    -print_final_stats=1 -artifact_prefix="build-fuzz/artifacts/$target-" >"$work/$target.log" 2>&1 &
  pids+=($!)
done

failed=0
for i in "${!targets[@]}"; do
  target="${targets[$i]}"
  if wait "${pids[$i]}"; then
    done_line="$(grep -E '^#[0-9]+[[:space:]]+DONE' "$work/$target.log" | tail -n 1)"
    echo "$target: ok: ${done_line:-no summary line}"
  else
    failed=1
    echo "$target: FAILED; the end of its log:" >&2
    tail -n 60 "$work/$target.log" >&2
  fi
done
exit "$failed"
