#!/usr/bin/env bash
# One GPU round, run on the GPU machine from the repository root after scripts/gpu_pack.sh carried
# .gpu/ there: the engine's whole test table on the CUDA backend against the float64 reference,
# compute-sanitizer memcheck and racecheck over a few cases, then the engine benchmark.
# Writes logs to ${OUT:-.gpu/out}.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.gpu/out}"
mkdir -p "$out"
export LD_LIBRARY_PATH="$PWD/.gpu/lib:${LD_LIBRARY_PATH:-}"
export LOSSD_CUDA_MODULE="$PWD/.gpu/bin/liblossd_cuda.so"
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
.gpu/bin/engine_test --gtest_filter='*cuda*' 2>&1 | tee "$out/engine_test.log" || status=1
grep -q "SKIPPED" "$out/engine_test.log" && { echo "CUDA tests were skipped: no device?"; status=1; }
for tool in memcheck racecheck; do
  compute-sanitizer --tool "$tool" --error-exitcode 3 .gpu/bin/engine_test \
    --gtest_filter='*cuda_basic*:*cuda_vocab_tiled*:*cuda_bf16_inputs*' 2>&1 |
    tail -n 20 | tee "$out/sanitizer-$tool.log" || status=1
done
.gpu/bin/engine_bench --device=cuda ${LOSSD_GPU_BENCH_ARGS:-} --json "$out/engine_bench.jsonl" 2>&1 |
  tee "$out/engine_bench.log" || status=1
exit $status
