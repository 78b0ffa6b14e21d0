#!/usr/bin/env bash
# The GPU round: lossd's CUDA backend checked, measured beside its peers, and served, on a GPU
# machine that has the driver, the CUDA toolkit, PyTorch and Triton but none of lossd's Debian
# packages and no network, runs one command of at most 10 minutes at a time over a copy of the
# repository's working tree, and returns only a few files written under $OUT.
#
# Runbook
#   1. Here (Debian 12 with the CUDA toolkit):  scripts/gpu_pack.sh
#      It builds for Hopper (sm_90) and fills .gpu/ (about 21 MiB; git ignores it).
#   2. On the GPU machine, from the repository root, three commands, each carrying the ignored
#      folder .gpu (the machine's tool: carry [".gpu"]; without it a step stops at once), each
#      under 8 minutes and complete on its own:
#        scripts/gpu_round.sh tests     # ~7 min: the CUDA engine's test table, the bf16 GEMM
#                                       #   probe, device faults, a foreign module refused, a
#                                       #   Llama 3 head against float64, compute-sanitizer
#        scripts/gpu_round.sh bench     # ~6 min: bench/gpu_peers.py, lossd beside torch,
#                                       #   torch.compile, Liger-Kernel and Cut Cross-Entropy
#        scripts/gpu_round.sh service   # ~3 min: bench/gpu_service.py, the server called by
#                                       #   lossctl and the Python client, messages and memfds
#      Each step writes one archive, $OUT/gpu-<step>.tar.gz (logs, results, JUnit XML), and prints
#      a short summary last. `scripts/gpu_round.sh tests memcheck initcheck` runs only the named
#      checks of a step (those a step ran out of time for, say); the names are in its summary.
#   3. Here: unpack the archives; bench/ and service/ hold results.md tables for bench/RESULTS.md.
#
# Environment: OUT (default .gpu/out), LOSSD_GPU_STEP_SECONDS (each step's time, default 450),
# LOSSD_GPU_PEERS_ARGS and LOSSD_GPU_SERVICE_ARGS (more flags for bench/gpu_peers.py and
# bench/gpu_service.py, which override the step's own, e.g. "--shapes=4096,4096,128256").
#
# Only lossd's own programs load the libraries packed from Debian: each runs through a wrapper
# that sets LD_LIBRARY_PATH for it alone, so python3, torch and compute-sanitizer keep the
# machine's own libstdc++, libgomp and OpenSSL.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

usage() {
  echo "usage: scripts/gpu_round.sh tests|bench|service [check ...]  (runbook: this file's header)" >&2
  exit 2
}
[ $# -ge 1 ] || usage
step="$1"
shift
case "$step" in
  tests | bench | service) ;;
  *) usage ;;
esac
only=("$@")

if [ ! -f .gpu/lossd-gpu.tar.xz ]; then
  echo "gpu_round: .gpu/lossd-gpu.tar.xz is missing. .gpu/ is ignored by git, so it reaches the" \
    "GPU machine only when the command carries it (the tool's carry: [\".gpu\"]); make it here" \
    "with scripts/gpu_pack.sh first." >&2
  exit 2
fi

step_seconds="${LOSSD_GPU_STEP_SECONDS:-450}"
out="${OUT:-.gpu/out}"
mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/lossd-gpu.XXXXXX")" || exit 2
logs="$work/$step"  # everything in here goes into the step's archive
pkg="$work/pkg"     # the unpacked .gpu/lossd-gpu.tar.xz
run="$work/run"     # wrappers of the packed programs
mkdir -p "$logs" "$pkg" "$run"
summary="$logs/summary.txt"
failures=0

say() { echo "$*" | tee -a "$summary"; }
seconds_left() { echo $((step_seconds - SECONDS)); }

# record NAME STATUS DETAIL: one line of the summary; any status but PASS fails the step.
record() {
  printf '%-4s %-11s %s\n' "$2" "$1" "$3" | tee -a "$summary"
  [ "$2" = PASS ] || failures=$((failures + 1))
}

# wanted NAME: whether the command line asked for this check (all of them when it named none).
wanted() {
  [ ${#only[@]} -eq 0 ] && return 0
  local name
  for name in "${only[@]}"; do [ "$name" = "$1" ] && return 0; done
  return 1
}

# timed NAME LIMIT COMMAND...: runs COMMAND, its output in $logs/NAME.log, for at most LIMIT
# seconds and no longer than the step has left; sets `status` (124: out of time) and `took`.
timed() {
  local name="$1" limit="$2"
  shift 2
  local left=$(($(seconds_left) - 20))
  [ "$left" -lt "$limit" ] && limit="$left"
  if [ "$limit" -lt 10 ]; then
    status=125
    took=0
    echo "not run: the step's ${step_seconds} s were spent" >"$logs/$name.log"
    return
  fi
  local start=$SECONDS
  timeout --kill-after=15 "$limit" "$@" >"$logs/$name.log" 2>&1
  status=$?
  took=$((SECONDS - start))
}

# A status of `timed` as a summary word.
verdict() {
  case "$status" in
    0) echo PASS ;;
    124 | 137) echo TIME ;;
    125) echo SKIP ;;
    *) echo FAIL ;;
  esac
}

finish() {
  # Logs cut to their last 4 MiB each, so the archive stays far under the 16 MiB that comes back.
  find "$logs" -type f -name '*.log' -size +4M -exec sh -c \
    'tail -c 4M "$1" >"$1.tail" && mv "$1.tail" "$1"' _ {} \;
  local archive="$out/gpu-$step.tar.gz"
  tar -C "$work" -czf "$archive" "$step"
  say "archive: $archive ($(du -h "$archive" | cut -f1))"
  if [ "$failures" -eq 0 ]; then
    say "RESULT: $step PASS ($SECONDS s)"
  else
    say "RESULT: $step FAIL: $failures check(s) did not pass ($SECONDS s)"
  fi
  rm -rf "$work"
  [ "$failures" -eq 0 ]
  exit
}

# ---- The machine ------------------------------------------------------------------------------

say "== gpu_round $step, $(date -u '+%Y-%m-%d %H:%M UTC')"
if ! nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  >"$logs/device.txt" 2>&1; then
  record device FAIL "nvidia-smi found no GPU: $(head -c 300 "$logs/device.txt")"
  finish
fi
say "device: $(head -n 1 "$logs/device.txt")"
{
  nvidia-smi
  uname -a
  ldd --version | head -n 1
  python3 --version
  command -v compute-sanitizer nvcc
} >"$logs/machine.txt" 2>&1
say "python: $(python3 --version 2>&1); $(ldd --version | head -n 1)"

if ! xz -dc .gpu/lossd-gpu.tar.xz | tar -C "$pkg" -xf -; then
  record unpack FAIL ".gpu/lossd-gpu.tar.xz did not unpack"
  finish
fi
cp "$pkg/MANIFEST.txt" "$logs/"
manifest() { awk -v key="$1" '$1 == key {$1 = ""; sub(/^ /, ""); print}' "$pkg/MANIFEST.txt"; }
say "pack: $(manifest commit); needs glibc $(manifest glibc_needed), $(manifest glibcxx_needed)"

# cuBLAS as the image has it: the toolkit's folders first, then the CUDA 13 wheels (which put
# it under nvidia/cu13/lib, not where `import nvidia.cublas` looks).
cublas_soname="$(manifest cublas_sonames | awk '{print $1}')"
wheel_dirs="$(python3 - <<'EOF' 2>/dev/null
import importlib.util, os
spec = importlib.util.find_spec("nvidia")
for base in (spec.submodule_search_locations if spec else []):
    for sub in ("cu13/lib", "cublas/lib"):
        print(os.path.join(base, sub))
EOF
)"
cublas_dir=""
for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda/lib \
  $wheel_dirs; do
  if [ -e "$dir/$cublas_soname" ]; then
    cublas_dir="$dir"
    break
  fi
done
if [ -z "$cublas_dir" ]; then
  record cublas FAIL "no $cublas_soname in /usr/local/cuda or the nvidia wheels ($wheel_dirs)"
  finish
fi
say "cuBLAS: $cublas_dir/$cublas_soname"

# The C++ runtime: the machine's own when it is new enough (compute-sanitizer's injected library
# needs it too), else the packed one.
library_path="$pkg/lib:$cublas_dir"
system_libstdcxx="$({ ldconfig -p || /sbin/ldconfig -p; } 2>/dev/null |
  awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')"
if [ -n "$system_libstdcxx" ] && grep -qa "$(manifest glibcxx_needed)" "$system_libstdcxx"; then
  say "C++ runtime: $system_libstdcxx"
else
  library_path="$library_path:$pkg/lib-fallback"
  say "C++ runtime: packed (the machine's ${system_libstdcxx:-none} lacks" \
    "$(manifest glibcxx_needed)); compute-sanitizer may not load into the programs"
fi

for program in "$pkg"/bin/*; do
  name="$(basename "$program")"
  [[ "$name" == *.so ]] && continue
  # shellcheck disable=SC2016  # ${LD_LIBRARY_PATH...} and $@ are the wrapper's, not this script's
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%q${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %q "$@"\n' \
    "$library_path" "$program" >"$run/$name"
  chmod +x "$run/$name"
done
if LD_LIBRARY_PATH="$library_path" ldd "$pkg"/bin/* >"$logs/ldd.txt" 2>&1 &&
  ! grep -q "not found" "$logs/ldd.txt"; then
  say "libraries: every packed program resolves all of its own ($step/ldd.txt in the archive)"
else
  record libraries FAIL "unresolved: $(grep "not found" "$logs/ldd.txt" | sort -u | tr -s ' \t\n' ' ')"
  finish
fi

# ---- tests: correct on the GPU ------------------------------------------------------------------

# gtest NAME LIMIT DESCRIPTION PROGRAM ARGS...: a GoogleTest run that must pass and skip nothing
# (a CUDA case skips only when it finds no GPU).
gtest() {
  local name="$1" limit="$2" description="$3"
  shift 3
  wanted "$name" || return
  timed "$name" "$limit" "$@" --gtest_output="xml:$logs/$name.xml"
  local result
  result="$(verdict)"
  local counts
  counts="$(awk '/^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ test/ {
      gsub(/[][]/, ""); printf "%s%s %s", sep, tolower($1), $2; sep = ", " }' "$logs/$name.log")"
  if [ "$result" = PASS ] && grep -q '^\[  SKIPPED \]' "$logs/$name.log"; then
    result=FAIL
    counts="$counts (a GPU test skipped: no GPU?)"
  fi
  record "$name" "$result" "$description: ${counts:-no test ran}; ${took} s"
}

# sanitize TOOL LIMIT FILTER [FLAG...]: engine_test's CUDA cases under compute-sanitizer's TOOL.
# Reports in kernels whose name holds "lossd" (every kernel of kernels/cuda/cuda_kernels.cu is
# lossd::cuda::...; cuBLAS's are not) and host API errors fail it; initcheck's reports inside
# cuBLAS's own kernels are counted and listed in the log, not failed.
sanitize() {
  local tool="$1" limit="$2" filter="$3"
  shift 3
  wanted "$tool" || return
  local sanitizer
  sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  if [ ! -x "$sanitizer" ]; then
    record "$tool" FAIL "compute-sanitizer is neither on PATH nor $sanitizer"
    return
  fi
  timed "$tool" "$limit" "$sanitizer" --tool "$tool" --error-exitcode 3 --target-processes all \
    "$@" "$run/engine_test" --gtest_filter="$filter"
  local result
  result="$(verdict)"
  local reports ours theirs
  reports="$(awk '
    /^========= [^ ]/ && !/ERROR SUMMARY|LEAK SUMMARY|COMPUTE-SANITIZER|Target application/ {
      pending = 1
      if ($0 ~ /Host API/) { ours++; pending = 0 }
      next
    }
    pending && /^=========     at / { if ($0 ~ /lossd/) ours++; else theirs++; pending = 0 }
    END { print ours + 0, theirs + 0 }' "$logs/$tool.log")"
  read -r ours theirs <<<"$reports"
  if [ "$tool" = initcheck ] && [ "$result" = FAIL ] && [ "$ours" -eq 0 ] && [ "$theirs" -gt 0 ] &&
    grep -q '^\[  PASSED  \]' "$logs/$tool.log" && ! grep -q '^\[  FAILED  \]' "$logs/$tool.log"; then
    result=PASS
  fi
  local summary_line
  summary_line="$(grep -m 1 'ERROR SUMMARY' "$logs/$tool.log" | sed 's/^========= //')"
  if grep -q "Device not supported" "$logs/$tool.log"; then
    summary_line="compute-sanitizer does not support this device (seen on gVisor machines)"
  fi
  record "$tool" "$result" "${summary_line:-no summary}; in lossd's kernels or host calls: $ours, in others: $theirs; ${took} s"
}

# The server must refuse, at start, a CUDA module without code for this GPU, naming the
# architectures it was built for; a server that accepts it keeps serving, so its startup line is
# watched for and the server stopped.
foreign_module() {
  wanted foreign || return
  local log="$logs/foreign.log"
  local start=$SECONDS
  LOSSD_CUDA_MODULE="$pkg/sm100/liblossd_cuda.so" "$run/lossd_server" --device=cuda \
    --listen=127.0.0.1:0 --metrics_listen= >"$log" 2>&1 &
  local server=$!
  local outcome="neither refused nor served within 90 s"
  for _ in $(seq 90); do
    if grep -q "serving gRPC on" "$log"; then
      outcome=accepted
      break
    fi
    if ! kill -0 "$server" 2>/dev/null; then
      outcome=exited
      break
    fi
    sleep 1
  done
  kill "$server" 2>/dev/null
  wait "$server" 2>/dev/null
  local exit_status=$?
  took=$((SECONDS - start))
  local expected="cannot run this CUDA module, built for architectures 100-real"
  if [ "$outcome" = exited ] && [ "$exit_status" -ne 0 ] && grep -q "$expected" "$log"; then
    record foreign PASS "a module for sm_100 only is refused at start: $(grep -o "$expected" "$log"), exit $exit_status; ${took} s"
  elif [ "$outcome" = accepted ]; then
    record foreign FAIL "a module built for sm_100 only was ACCEPTED: the server served with it; ${took} s"
  else
    record foreign FAIL "$outcome, exit $exit_status: $(tail -n 2 "$log" | tr '\n' ' ')"
  fi
}

tests_step() {
  say "-- every check of the step must pass; logs and JUnit XML in the archive"
  gtest table 240 "engine_test, each CUDA case of the table and the backend tests against float64" \
    "$run/engine_test" --gtest_filter='*cuda*:-*AtScale*'
  gtest probe 120 "cuBLAS bf16 GEMM error at K = 2048, 4096, 128256 against float64" \
    "$run/cuda_gemm_probe_test"
  grep -h '^bf16 GEMM' "$logs/probe.log" 2>/dev/null | sed 's/^/       /' | tee -a "$summary"
  gtest fault_fake 60 "the server's reaction to a faked device fault" \
    "$run/device_fault_test" --gtest_filter='*cpu_fake'
  # One process per real fault: it leaves the process's device unusable.
  gtest fault 60 "an illegal address: UNAVAILABLE, NOT_SERVING, refusals" \
    "$run/device_fault_test" --gtest_filter='*EveryCallAfterTheFault*/cuda_illegal_address'
  gtest fault_drain 60 "an illegal address during another call: both end, the server drains" \
    "$run/device_fault_test" --gtest_filter='*ACallInFlight*/cuda_illegal_address'
  foreign_module
  gtest scale 200 "N = 4096, H = 4096, V = 128256, bf16, against float64 (16 cores)" \
    "$run/engine_test" --gtest_filter='*AtScale*'
  grep -h '^N=4096' "$logs/scale.log" 2>/dev/null | sed 's/^/       /' | tee -a "$summary"
  # Every kernel and path, on the small cases: fp32 and bf16 products, fp16 hidden states, slabs
  # of a 16-bit head, vocabulary tiles, top-k up to its maximum over 128k columns, dL/dh in bf16,
  # scoring, a policy objective with the entropy bonus, buffer arithmetic and optimizer steps,
  # repeated calls.
  local cases='*cuda_basic:*cuda_vocab_tiled:*cuda_large_vocab:*cuda_bf16_inputs'
  cases+=':*cuda_bf16_head_in_slabs:*cuda_fp16_hidden_fp32_head:*cuda_top_k_max'
  cases+=':*cuda_everything_tiled:*cuda_bf16_scoring_tiled:*cuda_bf16_grad_hidden'
  cases+=':*cuda_ppo_entropy_tiled:*cuda_ppo_bf16'
  cases+=':*BufferArithmetic*/cuda:*IdenticalCalls*/cuda'
  sanitize memcheck 100 "$cases"
  # Shared memory and barriers: lossd's kernels only (--kernel-name kns=lossd), since cuBLAS's
  # Hopper kernels can report hazards that are not lossd's.
  sanitize racecheck 90 "$cases" --kernel-name kns=lossd
  sanitize synccheck 60 "$cases" --kernel-name kns=lossd
  # Unfiltered, so that every kernel's writes count as initializing (a filtered-out cuBLAS GEMM's
  # logits would read as uninitialized in lossd's kernels).
  sanitize initcheck 100 "$cases"
}

# ---- bench: measured beside the peers -----------------------------------------------------------

# Unpacks wheels into a folder for PYTHONPATH: a wheel is a zip of what goes into site-packages.
unpack_wheels() {
  local into="$1"
  shift
  mkdir -p "$into"
  local wheel
  for wheel in "$@"; do
    python3 -m zipfile -e "$wheel" "$into" || return 1
  done
}

bench_step() {
  wanted peers || return
  local site="$work/peers-site"
  if compgen -G ".gpu/wheels/peers/*.whl" >/dev/null &&
    unpack_wheels "$site" .gpu/wheels/peers/*.whl; then
    say "peers: $(find .gpu/wheels/peers -name '*.whl' -printf '%f ')"
  else
    say "peers: no wheels in .gpu/wheels/peers; Liger-Kernel and Cut Cross-Entropy will say so"
  fi
  read -ra extra <<<"${LOSSD_GPU_PEERS_ARGS:-}"
  # The peers stop starting 150 s before the step's end, leaving the engine rows their time.
  local deadline=$(($(seconds_left) - 170))
  timed peers 600 env PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
    python3 bench/gpu_peers.py --engine-bench "$run/engine_bench" --out "$logs/peers" \
    --deadline-seconds "$deadline" "${extra[@]}"
  local result
  result="$(verdict)"
  local failed=0
  if [ -f "$logs/peers/results.jsonl" ]; then
    failed="$(grep -c '"error": "failed' "$logs/peers/results.jsonl")"
  fi
  record peers "$result" "bench/gpu_peers.py: $(wc -l <"$logs/peers/results.jsonl" 2>/dev/null || echo 0) rows, $failed failed (bench/peers/results.md in the archive); ${took} s"
  [ -f "$logs/peers/results.md" ] && grep '^|' "$logs/peers/results.md" | cut -c1-150 | tee -a "$summary"
}

# ---- service: the server on the GPU -------------------------------------------------------------

service_step() {
  wanted service || return
  # The Python client with the machine's grpcio and protobuf, else with the packed wheels.
  local python_path="$pkg/python"
  if ! PYTHONPATH="$python_path" python3 -c 'import lossd' >"$logs/python-client.log" 2>&1; then
    local grpc_site="$work/grpc-site"
    if unpack_wheels "$grpc_site" .gpu/wheels/grpc/*.whl &&
      PYTHONPATH="$grpc_site:$python_path" python3 -c 'import lossd' >>"$logs/python-client.log" 2>&1; then
      python_path="$grpc_site:$python_path"
      say "Python client: with the packed grpcio and protobuf (the machine's did not import it)"
    else
      say "Python client: cannot import lossd with the machine's or the packed grpcio and" \
        "protobuf (wheels for CPython 3.12 only); its rows will be skipped, see python-client.log"
    fi
  else
    local versions
    versions="$(python3 -c 'import grpc, google.protobuf as p; print(grpc.__version__, p.__version__)')"
    say "Python client: the machine's grpcio and protobuf ($versions)"
  fi
  read -ra extra <<<"${LOSSD_GPU_SERVICE_ARGS:-}"
  timed service 600 env PYTHONUNBUFFERED=1 python3 bench/gpu_service.py --device=cuda \
    --server "$run/lossd_server" --lossctl "$run/lossctl" --engine-bench "$run/engine_bench" \
    --python-path "$python_path" --out "$logs/service" "${extra[@]}"
  local result
  result="$(verdict)"
  local failed=0
  if [ -f "$logs/service/results.jsonl" ]; then
    failed="$(grep -c '"error": "failed' "$logs/service/results.jsonl")"
    [ "$failed" -eq 0 ] || result=FAIL
  fi
  record service "$result" "bench/gpu_service.py: $failed failed (service/service/results.md in the archive); ${took} s"
  [ -f "$logs/service/results.md" ] && tee -a "$summary" <"$logs/service/results.md"
}

case "$step" in
  tests) tests_step ;;
  bench) bench_step ;;
  service) service_step ;;
esac
finish
