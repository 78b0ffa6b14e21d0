#!/usr/bin/env bash
# One GPU round, run on the GPU machine from the repository root after scripts/gpu_pack.sh packed
# .gpu/ here: the engine's whole test table on the CUDA backend against the float64 reference,
# compute-sanitizer memcheck and racecheck over a few cases, a module without code for this GPU
# refused at start-up, the peer benchmark (bench/gpu_peers.py: the engine against torch,
# Liger-Kernel and Cut Cross-Entropy), then the server on the GPU called over loopback at Llama 3
# 8B's head shape. About ten minutes. Writes logs to ${OUT:-.gpu/out}; LOSSD_GPU_PEERS_ARGS goes
# to gpu_peers.py (--shapes, --reps, --budget-mib, ...).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out="${OUT:-.gpu/out}"
mkdir -p "$out"
[ -d .gpu/bin ] || tar -C .gpu -xJf .gpu/lossd-gpu.tar.xz || exit 1
# cuBLAS 13 from the CUDA toolkit, or from the wheel that PyTorch's environment holds.
cublas_wheel="$(python3 -c 'import os, nvidia.cublas as c; print(os.path.join(list(c.__path__)[0], "lib"))' 2>/dev/null)"
export LD_LIBRARY_PATH="$PWD/.gpu/lib:/usr/local/cuda/lib64:${cublas_wheel}:${LD_LIBRARY_PATH:-}"
export LOSSD_CUDA_MODULE="$PWD/.gpu/bin/liblossd_cuda.so"
if compgen -G ".gpu/wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/lossd-site .gpu/wheels/*.whl &&
    export PYTHONPATH="/tmp/lossd-site:${PYTHONPATH:-}"
fi
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"

# 1. Correct: every engine test case on the CUDA backend, then memory and race checks.
.gpu/bin/engine_test --gtest_filter='*cuda*' 2>&1 | tee "$out/engine_test.log" || status=1
grep -q "SKIPPED" "$out/engine_test.log" && { echo "CUDA tests were skipped: no device?"; status=1; }
for tool in memcheck racecheck; do
  compute-sanitizer --tool "$tool" --error-exitcode 3 .gpu/bin/engine_test \
    --gtest_filter='*cuda_basic*:*cuda_vocab_tiled*:*cuda_bf16_inputs*' 2>&1 |
    tail -n 20 | tee "$out/sanitizer-$tool.log" || status=1
done
# A module without code for this GPU is refused when the backend is created, with a message that
# says how to rebuild it, rather than failing every call.
LOSSD_CUDA_MODULE="$PWD/.gpu/sm100/liblossd_cuda.so" timeout 60 .gpu/bin/lossd_server \
  --device=cuda --listen=127.0.0.1:0 --metrics_listen= >"$out/foreign-module.log" 2>&1 &&
  { echo "a module built for sm_100 only was accepted"; status=1; }
cat "$out/foreign-module.log"
grep -q "cannot run this CUDA module, built for architectures 100-real" "$out/foreign-module.log" ||
  status=1

# 2. Fast: the engine against its peers on the same GPU, bf16 inputs.
read -ra peers_args <<<"${LOSSD_GPU_PEERS_ARGS:-}"
python3 bench/gpu_peers.py --engine-bench .gpu/bin/engine_bench --out "$out/peers" \
  "${peers_args[@]}" 2>&1 | tee "$out/peers.log" || status=1

# 3. The service: the server on the GPU, called over loopback with 16384 tokens of bf16 rows in
# messages and in shared memory; its in-process counterpart is the engine row of step 2.
port=50151
.gpu/bin/lossd_server --listen="127.0.0.1:$port" --metrics_listen= --device=cuda \
  --head_dtype=bfloat16 --demo_vocab_size=128256 --demo_hidden_size=4096 \
  --workspace_budget_mib=1024 >"$out/server.log" 2>&1 &
server=$!
for _ in $(seq 120); do
  .gpu/bin/lossctl --server="127.0.0.1:$port" heads >/dev/null 2>&1 && break
  sleep 1
done
for transport in "" --shared_memory; do
  .gpu/bin/lossctl --server="127.0.0.1:$port" bench --head=demo --tokens=16384 --dtype=bfloat16 \
    --grad --accumulate --warmup=2 --calls=5 --json $transport 2>&1 |
    tee -a "$out/remote.log" || status=1
done
kill "$server"
wait "$server" 2>/dev/null
exit $status
