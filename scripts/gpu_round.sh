#!/usr/bin/env bash
# The GPU round: lossd's CUDA backend checked against float64, measured beside its peers, and
# served, on a GPU machine that has the driver, the CUDA toolkit, PyTorch and Triton but none of
# lossd's Debian packages and no network. The machine is lent for 15 minutes of device time in all
# (its start of 1-2 minutes and every idle wait counted), runs one command of at most 10 minutes
# at a time over a copy of the repository's working tree, and returns at most 8 files written
# under $OUT, no more than two folders down.
#
# Runbook
#   0. Here (Debian 12 with the CUDA toolkit), once per commit to be measured:
#        scripts/gpu_pack.sh          # 6-11 min on 2 cores; fills the git-ignored .gpu/ (~22 MiB)
#   1. Call 1, the decisive facts, at most 9 minutes (the device tool's `run`):
#        command:   scripts/gpu_round.sh call1
#        carry:     [".gpu"]
#        timeout_s: 540
#      the CUDA engine's test table against float64 (fp32 and 16-bit, V >= 128k, N not a multiple
#      of the chunk, every objective), the cuBLAS GEMM probe at the engine's real K, a module built
#      for another GPU refused, the Llama 3 8B head at N = 4096 against float64 in both gradient
#      modes, bench/gpu_peers.py at the Llama 3 8B shape (lossd first, in the default and exact
#      modes and with pageable rows, then the floor and the peers while time lasts),
#      compute-sanitizer memcheck, and each kernel's device time in one forward + backward at that
#      shape and in one forward at N = 8192 (Nsight Compute). Files come back as
#      $OUT/call1/summary.txt and $OUT/call1/call1.tar.gz. On an H100 (2026-11-27) the checks took
#      7, 8, 1, 78, 57, 5 and 6 s (165 s with the unpacking), the Llama check almost all in its
#      float64 reference; call 2's took 55 s in all, and bench's 100 s; the machine's start
#      about 30 s before each call.
#   2. Call 2, only if the device tool's `status` still gives budget_left_s >= 315 (else skip it,
#      or give it timeout_s = budget_left_s - 15 and LOSSD_GPU_CALL_SECONDS = timeout_s - 25 in
#      front of the command: its checks run in this order until its time is spent):
#        command:   scripts/gpu_round.sh call2
#        carry:     [".gpu"]
#        timeout_s: 300
#      a provoked device fault (UNAVAILABLE, NOT_SERVING, the server drains), compute-sanitizer
#      racecheck, synccheck and initcheck, a short service check (lossd_server on the GPU called
#      by lossctl and the Python client over gRPC, the Compute socket and shared memory, 16384
#      bf16 rows of 2048 each way, against the engine in-process), and the transport benchmark on
#      the machine's cores: first bench/transport_bench.py --floor-rounds 3 (the TCP floor and
#      both clients' Compute socket calls of 16384 float32 rows in turn, the C++ client's with
#      dL/dh lent and into the caller's buffer, each round's ratio; 14 s on 2 cores), then
#      --quick as far as its time goes (both clients' messages over gRPC and over the Compute
#      socket, and shared memory, beside gRPC's echo and the TCP and memcpy floors; 83 s on 2
#      cores, its rows in transport/results.jsonl as they come). Files:
#      $OUT/call2/summary.txt and $OUT/call2/call2.tar.gz.
#      Then give the machine back (`give_back`).
#   3. Here: unpack the archives; peers/results.md and service/results.md hold tables for
#      bench/RESULTS.md, *.xml the JUnit results with the recorded errors against float64.
#   4. The peers at every shape, in the same round when call 1 took at most 5 minutes and status
#      still gives budget_left_s >= 420 after call 2 (else the next round): Llama 3 8B at N = 8192
#      and 16384 and Gemma 2 2B at N = 8192, lossd (rows page-locked, as the server holds them) at
#      its default budget (8 GiB on an H100), 1024 and 2048 MiB, each planned with windows of rows
#      and without them (LOSSD_CUDA_WINDOWS=0, the rows _chunks; 256 MiB, where both plans are
#      chunks, was measured on 2026-11-27), beside the floor, torch naive, torch's
#      F.linear_cross_entropy, Liger-Kernel and Cut Cross-Entropy:
#        command:   scripts/gpu_round.sh bench
#        carry:     [".gpu"]
#        timeout_s: 400
#      (LOSSD_GPU_CALL_SECONDS = timeout_s - 25 in front of the command when it must be shorter.)
#      Calls 2 and 4 can share one run, which saves a machine start: command
#      `scripts/gpu_round.sh call2; LOSSD_GPU_CALL_SECONDS=300 scripts/gpu_round.sh bench`,
#      timeout_s 600 (on an H100 the two took 55 s and 100 s before call 2's transport check).
# `scripts/gpu_round.sh call1 table scale` runs only the named checks of a call (those a call ran
# out of time for, say); the names are in its summary. Each call prints its plan (its checks and
# their time limits) first and its summary last.
#
# Environment: OUT (default .gpu/out), LOSSD_GPU_CALL_SECONDS (the call's time; default 515 for
# call 1, 275 for call 2, 375 for bench), LOSSD_GPU_PEERS_ARGS and LOSSD_GPU_SERVICE_ARGS (more flags for
# bench/gpu_peers.py and bench/gpu_service.py, which override the call's own),
# LOSSD_GPU_SANITIZER_CASES (the gtest filter of the compute-sanitizer checks),
# LOSSD_GPU_SANITIZER_KERNELS (the kernel-name substring racecheck and synccheck watch; lossd's
# kernels by default: one kernel family's name narrows a fault down to it),
# LOSSD_GPU_SANITIZER_ARGS (more compute-sanitizer options, for every sanitizer check),
# LOSSD_GPU_LIBRARY_DIRS (folders searched for cuBLAS before the toolkit's and the wheels').
#
# Only lossd's own programs load the libraries packed from Debian: each runs through a wrapper
# that sets LD_LIBRARY_PATH for it alone, so python3, torch and compute-sanitizer keep the
# machine's own libstdc++, libgomp and OpenSSL.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

usage() {
  echo "usage: scripts/gpu_round.sh call1|call2|bench [check ...]  (runbook: this file's header)" >&2
  exit 2
}
[ $# -ge 1 ] || usage
call="$1"
shift
case "$call" in
  call1) default_seconds=515 ;;
  call2) default_seconds=275 ;;
  bench) default_seconds=375 ;;
  *) usage ;;
esac
only=("$@")

archive_in=.gpu/lossd-gpu.tar.xz
if [ ! -f "$archive_in" ]; then
  echo "gpu_round: $archive_in is missing. .gpu/ is ignored by git, so it reaches the GPU" \
    "machine only when the command carries it (the tool's carry: [\".gpu\"]); make it here with" \
    "scripts/gpu_pack.sh first." >&2
  exit 2
fi

call_seconds="${LOSSD_GPU_CALL_SECONDS:-$default_seconds}"
out="${OUT:-.gpu/out}/$call"
mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/lossd-gpu.XXXXXX")" || exit 2
logs="$work/$call"  # everything in here goes into the call's archive
pkg="$work/pkg"     # the unpacked .gpu/lossd-gpu.tar.xz
run="$work/run"     # wrappers of the packed programs
mkdir -p "$logs" "$pkg" "$run"
summary="$logs/summary.txt"
failures=0

say() { echo "$*" | tee -a "$summary"; }
seconds_left() { echo $((call_seconds - SECONDS)); }

# record NAME STATUS DETAIL: one line of the summary; any status but PASS fails the call.
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
# seconds and no longer than the call has left; sets `status` (124: out of time) and `took`.
timed() {
  local name="$1" limit="$2"
  shift 2
  local left=$(($(seconds_left) - 15))
  [ "$left" -lt "$limit" ] && limit="$left"
  if [ "$limit" -lt 10 ]; then
    status=125
    took=0
    echo "not run: the call's ${call_seconds} s were spent" >"$logs/$name.log"
    return
  fi
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$logs/$name.log" 2>&1
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
  if [ "$failures" -eq 0 ]; then
    say "RESULT: $call PASS ($SECONDS s)"
  else
    say "RESULT: $call FAIL: $failures check(s) did not pass ($SECONDS s)"
  fi
  local archive="$out/$call.tar.gz"
  tar -C "$work" -czf "$archive" "$call"
  cp "$summary" "$out/summary.txt"
  echo "archive: $archive ($(du -h "$archive" | cut -f1)); summary: $out/summary.txt"
  rm -rf "$work"
  [ "$failures" -eq 0 ]
  exit
}

# ---- The plan: each check's time limit, in the order they run ----------------------------------

case "$call" in
  call1) plan=(table:45 probe:25 foreign:15 scale:170 peers:110 memcheck:50 profile:40
    profile_fwd:30) ;;
  call2) plan=(fault:20 fault_drain:20 racecheck:45 synccheck:25 initcheck:35 service:40
    transport_floor:30 transport:30) ;;
  bench) plan=(peers:340) ;;
esac
# limit NAME: the planned seconds of a check.
limit() {
  local entry
  for entry in "${plan[@]}"; do [ "${entry%%:*}" = "$1" ] && echo "${entry#*:}"; done
}
planned=0
for entry in "${plan[@]}"; do
  wanted "${entry%%:*}" && planned=$((planned + ${entry#*:}))
done

# ---- The machine ------------------------------------------------------------------------------

say "== gpu_round $call, $(date -u '+%Y-%m-%d %H:%M UTC')"
say "plan: ${plan[*]} (check:seconds); ${planned} s of checks within the call's ${call_seconds} s"
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
  command -v compute-sanitizer nvcc xz
} >"$logs/machine.txt" 2>&1
say "python: $(python3 --version 2>&1); $(ldd --version | head -n 1)"
# The GPU machine is a virtual machine whose CPUID OpenBLAS's DYNAMIC_ARCH reads as a Prescott
# (seen on an H100 machine, 2026-11-26): SSE3 kernels, which made the float64 reference of the
# Llama-sized test take 112 s. Its kernels are chosen from the instructions the CPU reports.
if [ -z "${OPENBLAS_CORETYPE:-}" ]; then
  if grep -qw avx512f /proc/cpuinfo; then
    export OPENBLAS_CORETYPE=SkylakeX
  elif grep -qw avx2 /proc/cpuinfo; then
    export OPENBLAS_CORETYPE=Haswell
  fi
fi
say "OpenBLAS kernels: ${OPENBLAS_CORETYPE:-as OpenBLAS detects them}"

# xz may be missing from the GPU machine's image: python3's lzma reads the archive then.
if command -v xz >/dev/null 2>&1 && xz -dc "$archive_in" 2>>"$logs/unpack.log" |
  tar -C "$pkg" -xf - 2>>"$logs/unpack.log"; then
  say "unpack: xz"
elif python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' \
  "$archive_in" "$pkg" 2>>"$logs/unpack.log"; then
  say "unpack: python3's lzma (xz $(command -v xz >/dev/null 2>&1 && echo failed || echo is absent))"
else
  record unpack FAIL "$archive_in did not unpack: $(tail -n 2 "$logs/unpack.log" | tr '\n' ' ')"
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
# shellcheck disable=SC2086  # the lists split on whitespace
for dir in ${LOSSD_GPU_LIBRARY_DIRS:-} /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
  /usr/local/cuda/lib $wheel_dirs; do
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

elf_programs=()
for program in "$pkg"/bin/*; do
  name="$(basename "$program")"
  [ "$(head -c 4 "$program" | tr -d '\000')" = $'\x7fELF' ] && elf_programs+=("$program")
  [[ "$name" == *.so ]] && continue
  # shellcheck disable=SC2016  # ${LD_LIBRARY_PATH...} and $@ are the wrapper's, not this script's
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%q${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %q "$@"\n' \
    "$library_path" "$program" >"$run/$name"
  chmod +x "$run/$name"
done
if [ ${#elf_programs[@]} -eq 0 ] ||
  { LD_LIBRARY_PATH="$library_path" ldd "${elf_programs[@]}" >"$logs/ldd.txt" 2>&1 &&
    ! grep -q "not found" "$logs/ldd.txt"; }; then
  say "libraries: every packed program resolves all of its own ($call/ldd.txt in the archive)"
else
  record libraries FAIL "unresolved: $(grep "not found" "$logs/ldd.txt" | sort -u | tr -s ' \t\n' ' ')"
  finish
fi

# ---- Correct on the GPU -------------------------------------------------------------------------

# gtest NAME DESCRIPTION PROGRAM ARGS...: a GoogleTest run within the check's planned time that
# must pass and skip nothing (a CUDA case skips only when the backend cannot be made; the first
# skip's message, which carries CreateBackend's status, goes into the summary).
gtest() {
  local name="$1" description="$2"
  shift 2
  wanted "$name" || return
  timed "$name" "$(limit "$name")" "$@" --gtest_output="xml:$logs/$name.xml"
  local result
  result="$(verdict)"
  local counts
  counts="$(awk '/^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ test/ {
      gsub(/[][]/, ""); printf "%s%s %s", sep, tolower($1), $2; sep = ", " }' "$logs/$name.log")"
  if [ "$result" = PASS ] && grep -q '^\[  SKIPPED \]' "$logs/$name.log"; then
    result=FAIL
    local why
    why="$(awk '/: Skipped$/ { getline; print; exit }' "$logs/$name.log" | cut -c1-300)"
    counts="$counts (a GPU test skipped: ${why:-no reason given})"
  fi
  record "$name" "$result" "$description: ${counts:-no test ran}; ${took} s"
}

# sanitize TOOL FILTER [FLAG...]: engine_test's CUDA cases under compute-sanitizer's TOOL.
# Reports in kernels whose name holds "lossd" (every kernel of kernels/cuda/ is lossd::cuda::...;
# cuBLAS's are not) and host API errors fail it; initcheck's reports inside cuBLAS's own kernels
# are counted and listed in the log, not failed. A test that leaves the device faulted (a real
# fault, or the sanitizer's own "failed to handle a hardware exception") makes every later CUDA
# test of its process skip: those run again in a process of their own, round after round, so
# that one fault hides no other case; the faulting tests are named in the summary. racecheck
# fails to handle a hardware exception in some bf16 cases, also when it watches none of lossd's
# kernels (seen on an H100, 2026-11-27: it comes with cuBLAS's tensor-core kernels under the
# tool): the tests it failed on run once more, watching no kernel at all, and where they fail
# the same way and nothing else was found, the fault is the tool's and the check passes, saying
# so.
sanitize() {
  local tool="$1" filter="$2"
  shift 2
  wanted "$tool" || return
  local sanitizer
  sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  if [ ! -x "$sanitizer" ]; then
    record "$tool" FAIL "compute-sanitizer is neither on PATH nor $sanitizer"
    return
  fi
  local log="$logs/$tool.log" started=$SECONDS round=1 worst=0 skipped
  : >"$log"
  while :; do
    local left=$(($(limit "$tool") - (SECONDS - started)))
    # shellcheck disable=SC2086  # more options, split on whitespace
    timed "$tool.$round" "$left" "$sanitizer" --tool "$tool" --error-exitcode 3 \
      --target-processes all "$@" ${LOSSD_GPU_SANITIZER_ARGS:-} "$run/engine_test" \
      --gtest_filter="$filter"
    { echo "---- round $round: $filter"; cat "$logs/$tool.$round.log"; } >>"$log"
    rm -f "$logs/$tool.$round.log"
    [ "$status" -ne 0 ] && [ "$worst" -eq 0 ] && worst=$status
    [ "$status" -eq 124 ] || [ "$status" -eq 137 ] || [ "$status" -eq 125 ] && worst=$status
    # Only this round's skips count: the earlier rounds' ran again already.
    skipped="$(sed -n "/^---- round $round: /,\$p" "$log" |
      awk '/^\[  SKIPPED \] [A-Za-z]/ {print $4}' | sort -u | paste -sd: -)"
    [ -z "$skipped" ] || [ "$skipped" = "$filter" ] || [ "$worst" -ge 124 ] && break
    filter="$skipped"
    round=$((round + 1))
  done
  status=$worst
  took=$((SECONDS - started))
  local result
  result="$(verdict)"
  local reports ours theirs
  reports="$(awk '
    /^========= [^ ]/ && !/ERROR SUMMARY|LEAK SUMMARY|SUMMARY:|COMPUTE-SANITIZER|Target application|Internal Sanitizer Error/ {
      pending = 1
      if ($0 ~ /Host API/) { ours++; pending = 0 }
      next
    }
    pending && /^=========     at / { if ($0 ~ /lossd/) ours++; else theirs++; pending = 0 }
    END { print ours + 0, theirs + 0 }' "$log")"
  read -r ours theirs <<<"$reports"
  if [ "$tool" = initcheck ] && [ "$result" = FAIL ] && [ "$ours" -eq 0 ] && [ "$theirs" -gt 0 ] &&
    grep -q '^\[  PASSED  \]' "$log" && ! grep -q '^\[  FAILED  \]' "$log"; then
    result=PASS
  fi
  local tools_own=""
  if [ "$tool" = racecheck ] && [ "$result" = FAIL ] && [ "$ours" -eq 0 ]; then
    tools_own="$(tool_faults_watching_nothing "$sanitizer" "$log")" && result=PASS
  fi
  local summary_line faulted
  summary_line="$(grep 'ERROR SUMMARY\|RACECHECK SUMMARY' "$log" | sed 's/^========= //' |
    sort | uniq -c | sed 's/^ *\([0-9]*\) /\1x /' | paste -sd';' -)"
  if grep -q "Device not supported" "$log"; then
    summary_line="compute-sanitizer does not support this device (seen on gVisor machines)"
  fi
  # The tests a device fault ended, with the sanitizer's own failure where it said so.
  faulted="$(awk '
    /^\[ RUN      \]/ { test = $4 }
    /Internal Sanitizer Error/ { internal[test] = 1 }
    /device fault:/ && !/backend not available/ { fault[test] = 1 }
    END {
      for (t in fault) {
        printf "%s%s%s", sep, t, (t in internal ? " (the sanitizer failed to handle a hardware exception)" : "")
        sep = ", "
      }
    }' "$log")"
  record "$tool" "$result" "${summary_line:-no summary}; in lossd's kernels or host calls: $ours, in others: $theirs; $round round(s)${faulted:+; device fault in: $faulted}${tools_own:+; $tools_own}; ${took} s"
}

# tool_faults_watching_nothing SANITIZER LOG: for a racecheck log whose only failures are tests
# the sanitizer failed to handle a hardware exception in, reruns those tests with racecheck
# watching no kernel (a kernel-name filter that matches none); prints what it found and succeeds
# when every one of them fails the same way there, so that the fault is the tool's.
tool_faults_watching_nothing() {
  local sanitizer="$1" log="$2"
  local internal failed
  internal="$(awk '/^\[ RUN      \]/ { test = $4 } /Internal Sanitizer Error/ { print test }' "$log" |
    sort -u | paste -sd: -)"
  failed="$(awk '/^\[  FAILED  \] [A-Za-z][^ ]*,? / { sub(/,$/, "", $4); print $4 }' "$log" |
    sort -u | paste -sd: -)"
  [ -n "$internal" ] || return 1
  # Nothing failed but the tests the sanitizer itself failed in.
  local test
  for test in ${failed//:/ }; do
    [[ ":$internal:" == *":$test:"* ]] || return 1
  done
  # One process each: a fault would make the later tests of its process skip.
  local control="$logs/racecheck.watching-nothing.log" again=()
  for test in ${internal//:/ }; do
    # shellcheck disable=SC2086  # more options, split on whitespace
    timed racecheck.watching-nothing 60 "$sanitizer" --tool racecheck --error-exitcode 3 \
      --target-processes all --kernel-name kns=NoKernelIsNamedThis ${LOSSD_GPU_SANITIZER_ARGS:-} \
      "$run/engine_test" --gtest_filter="$test"
    grep -q "Internal Sanitizer Error" "$control" && again+=("$test")
    { echo "---- watching no kernel: $test"; cat "$control"; } >>"$log"
    rm -f "$control"
  done
  if [ "$(printf '%s\n' "${again[@]}" | paste -sd: -)" = "$internal" ]; then
    echo "the sanitizer's own fault: it fails in the same tests watching no kernel"
    return 0
  fi
  echo "watching no kernel it failed in ${#again[@]} of those tests"
  return 1
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
  local outcome="neither refused nor served within $(limit foreign) s"
  for _ in $(seq "$(limit foreign)"); do
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

# Every kernel and path on the small cases: fp32 and 16-bit products in both gradient modes, fp16
# rows, a 16-bit head widened in slabs for fp32 products, vocabulary tiles, top-k up to its
# maximum, dL/dh in bf16, scoring, a policy objective with the entropy bonus, distillation with a
# dense teacher and with a sparse one (renormalized, and spread over tiles), buffer arithmetic and
# optimizer steps, repeated calls, rows and dL/dh in page-locked memory over several chunks.
sanitizer_cases='*cuda_basic:*cuda_vocab_tiled:*cuda_large_vocab:*cuda_bf16_inputs*'
sanitizer_cases+=':*cuda_fp32_hidden_bf16_head_slabs:*cuda_fp32_hidden_fp16_head_slabs_tiled'
sanitizer_cases+=':*cuda_fp16_hidden_fp32_head:*cuda_top_k_max:*cuda_everything_tiled'
sanitizer_cases+=':*cuda_bf16_scoring_tiled:*cuda_bf16_grad_hidden:*cuda_ppo_entropy_tiled'
sanitizer_cases+=':*cuda_ppo_bf16:*cuda_distill_bf16:*cuda_distill_sparse_renormalize'
sanitizer_cases+=':*cuda_distill_sparse_spread_reverse_tiled'
sanitizer_cases+=':*BufferArithmetic*/cuda:*IdenticalCalls*/cuda:*HostBuffers*/cuda'
sanitizer_cases="${LOSSD_GPU_SANITIZER_CASES:-$sanitizer_cases}"

# ---- Measured beside the peers ------------------------------------------------------------------

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

# lossd at the Llama 3 8B shape first (its default budget, default and exact gradients: two
# engine_bench processes of about 10 s each), then the cuBLAS floor, torch and the fused peers,
# each peer with its own deadline (Triton compiles Liger-Kernel's and Cut Cross-Entropy's kernels
# at their first call), while the check's time lasts. Other budgets and shapes are the next
# run's (LOSSD_GPU_PEERS_ARGS overrides these flags).
peers() {
  wanted peers || return
  local site="$work/peers-site"
  if compgen -G ".gpu/wheels/peers/*.whl" >/dev/null &&
    unpack_wheels "$site" .gpu/wheels/peers/*.whl; then
    say "peers: $(find .gpu/wheels/peers -name '*.whl' -printf '%f ')"
  else
    say "peers: no wheels in .gpu/wheels/peers; Liger-Kernel and Cut Cross-Entropy will say so"
  fi
  read -ra extra <<<"${LOSSD_GPU_PEERS_ARGS:-}"
  local scope=(--shapes=16384,4096,128256 --budgets-mib=default
    --methods=lossd,floor,torch_naive,liger,cce --lossd-modes=default,exact,pageable
    --peer-seconds=30)
  if [ "$call" = bench ]; then
    scope=(--shapes="8192,4096,128256;16384,4096,128256;8192,2304,256000"
      --budgets-mib=default,1024,2048 --methods=lossd,floor,torch_naive,torch_lce,liger,cce
      --lossd-modes=default,chunks --peer-seconds=45)
  fi
  # The peers stop starting 30 s before the check's end (the call's, when that comes first).
  local limit left
  limit="$(limit peers)"
  left=$(($(seconds_left) - 15))
  [ "$left" -lt "$limit" ] && limit="$left"
  timed peers "$limit" env PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
    python3 bench/gpu_peers.py --engine-bench "$run/engine_bench" --out "$logs/peers" \
    "${scope[@]}" --reps=5 --warmup=1 --engine-timeout=60 \
    --deadline-seconds="$((limit > 30 ? limit - 30 : 0))" "${extra[@]}"
  local result
  result="$(verdict)"
  local failed=0 rows=0
  if [ -f "$logs/peers/results.jsonl" ]; then
    failed="$(grep -c '"error": "failed' "$logs/peers/results.jsonl")"
    rows="$(wc -l <"$logs/peers/results.jsonl")"
  fi
  record peers "$result" "bench/gpu_peers.py ${scope[0]#--shapes=}: $rows rows, $failed failed (peers/results.md in the archive); ${took} s"
  [ -f "$logs/peers/results.md" ] && grep '^|' "$logs/peers/results.md" | cut -c1-150 | tee -a "$summary"
}

# profile NAME SHAPE PASS: where lossd's device time goes: one call of the engine (PASS: fwd_bwd
# or fwd) at SHAPE (N,H,V) in bf16 under Nsight Compute with a single metric (each kernel's
# duration), the kernels summed by name, warm-up included. Their sum against the same call's
# device time in the peers' table is the time the GPU waits (copies, the host).
profile() {
  local name="$1" shape="$2" pass="$3"
  wanted "$name" || return
  local ncu
  ncu="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
  if [ ! -x "$ncu" ]; then
    record profile FAIL "Nsight Compute is neither on PATH nor $ncu"
    return
  fi
  timed "$name" "$(limit "$name")" "$ncu" --clock-control none --target-processes all \
    --metrics gpu__time_duration.sum --csv --page raw --log-file "$logs/$name.csv" \
    "$run/engine_bench" --device=cuda --dtype=bf16 --shapes="$shape" --methods=engine \
    --passes="$pass" --reps=1 --warmup-tokens=64
  local result
  result="$(verdict)"
  python3 - "$logs/$name.csv" >"$logs/$name.txt" 2>&1 <<'EOF_PY'
import collections, csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
header = next((r for r in rows if "Kernel Name" in r), None)
if header is None:
    sys.exit("no kernel rows in " + sys.argv[1])
name_at, time_at = header.index("Kernel Name"), header.index("gpu__time_duration.sum")
first = rows.index(header) + 1
unit = rows[first][time_at] if first < len(rows) else ""
if unit.replace(",", "").replace(".", "").isdigit():
    unit = "nsecond"  # no row of units: ncu's default unit
else:
    first += 1
total, count = collections.Counter(), collections.Counter()
for r in rows[first:]:
    try:
        value = float(r[time_at].replace(",", ""))
    except (ValueError, IndexError):
        continue
    name = r[name_at].split("(")[0][:90]
    total[name] += value
    count[name] += 1
scale = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}.get(unit, float("nan"))
print(f"kernels: {sum(count.values())}, sum {sum(total.values()) * scale:.1f} ms (warm-up included)")
for name, value in total.most_common(14):
    print(f"{value * scale:9.2f} ms {count[name]:5d}x  {name}")
EOF_PY
  [ -s "$logs/$name.txt" ] || result=FAIL
  record "$name" "$result" "Nsight Compute, kernel durations of one $pass call at $shape bf16; ${took} s"
  sed 's/^/       /' "$logs/$name.txt" | tee -a "$summary"
}

# ---- The server on the GPU ----------------------------------------------------------------------

# python_client: sets python_path, where the Python client imports from: the packed lossd with the
# machine's grpcio and protobuf, else with the packed wheels (once per call).
python_path=""
python_client() {
  [ -n "$python_path" ] && return
  python_path="$pkg/python"
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
}

service() {
  wanted service || return
  python_client
  read -ra extra <<<"${LOSSD_GPU_SERVICE_ARGS:-}"
  timed service "$(limit service)" env PYTHONUNBUFFERED=1 python3 bench/gpu_service.py \
    --device=cuda --shape=16384,2048,32000 --calls=2 --warmup=1 --server "$run/lossd_server" \
    --lossctl "$run/lossctl" --engine-bench "$run/engine_bench" --python-path "$python_path" \
    --out "$logs/service" "${extra[@]}"
  local result
  result="$(verdict)"
  local failed=0
  if [ -f "$logs/service/results.jsonl" ]; then
    failed="$(grep -c '"error": "failed' "$logs/service/results.jsonl")"
    [ "$failed" -eq 0 ] || result=FAIL
  fi
  record service "$result" "bench/gpu_service.py: $failed failed (service/results.md in the archive); ${took} s"
  [ -f "$logs/service/results.md" ] && tee -a "$summary" <"$logs/service/results.md"
}

# The transport benchmark (CPU engine, a tiny vocabulary: the transport's own speed) on this
# machine's cores, through the packed programs: a build folder of their wrappers and the client.
# transport_bench NAME LABEL ARGS...: runs it with ARGS as check NAME, its files in $logs/NAME.
transport_bench() {
  local name="$1" label="$2"
  shift 2
  python_client
  local build="$work/transport-build"
  mkdir -p "$build"
  ln -sfn "$run" "$build/bin"
  ln -sfn "$pkg/python" "$build/python"
  timed "$name" "$(limit "$name")" env PYTHONPATH="$python_path" PYTHONUNBUFFERED=1 \
    python3 bench/transport_bench.py "$@" --build-dir "$build" --out "$logs/$name"
  record "$name" "$(verdict)" "bench/transport_bench.py $label ($name/results.md in the archive); ${took} s"
}

transport() {
  wanted transport || return
  transport_bench transport --quick --quick
  [ -f "$logs/transport/results.md" ] && grep '^|\|^memcpy' "$logs/transport/results.md" |
    head -n 25 | tee -a "$summary"
}

# Both clients' Compute socket calls against the TCP floor measured beside them, round by round
# (the floor moves between runs more than the paths do).
transport_floor() {
  wanted transport_floor || return
  transport_bench transport_floor "--floor-rounds 3 --reps 2" --floor-rounds 3 --reps 2
  [ -f "$logs/transport_floor/results.md" ] &&
    grep '^|\|^Medians' "$logs/transport_floor/results.md" | tee -a "$summary"
}

# ---- The calls ----------------------------------------------------------------------------------

call1() {
  say "-- every check must pass; logs and JUnit XML in the archive"
  gtest table "engine_test, every CUDA case of the table and the backend tests against float64" \
    "$run/engine_test" --gtest_filter='*cuda*:-*AtScale*'
  gtest probe "cuBLAS bf16 GEMMs as the engine runs them, against float64, K up to 128256" \
    "$run/cuda_gemm_probe_test"
  grep -h '^bf16 GEMM' "$logs/probe.log" 2>/dev/null | sed 's/^/       /' | tee -a "$summary"
  foreign_module
  gtest scale "N = 4096, H = 4096, V = 128256, bf16, both gradient modes, against float64" \
    "$run/engine_test" --gtest_filter='*AtScale*'
  grep -h '^N=4096' "$logs/scale.log" 2>/dev/null | sed 's/^/       /' | tee -a "$summary"
  peers
  sanitize memcheck "$sanitizer_cases"
  profile profile 16384,4096,128256 fwd_bwd
  profile profile_fwd 8192,4096,128256 fwd
}

bench() {
  say "-- lossd beside the floor and the peers at every shape; logs in the archive"
  peers
}

call2() {
  say "-- every check must pass; logs and JUnit XML in the archive"
  # One process per real fault: it leaves the process's device unusable.
  gtest fault "an illegal address: UNAVAILABLE, NOT_SERVING, refusals" \
    "$run/device_fault_test" --gtest_filter='*EveryCallAfterTheFault*/cuda_illegal_address'
  gtest fault_drain "an illegal address during another call: both end, the server drains" \
    "$run/device_fault_test" --gtest_filter='*ACallInFlight*/cuda_illegal_address'
  # Shared memory and barriers: lossd's kernels only (--kernel-name kns=lossd), since cuBLAS's
  # Hopper kernels can report hazards that are not lossd's.
  local watched="kns=${LOSSD_GPU_SANITIZER_KERNELS:-lossd}"
  sanitize racecheck "$sanitizer_cases" --kernel-name "$watched"
  sanitize synccheck "$sanitizer_cases" --kernel-name "$watched"
  # Unfiltered, so that every kernel's writes count as initializing (a filtered-out cuBLAS GEMM's
  # logits would read as uninitialized in lossd's kernels).
  sanitize initcheck "$sanitizer_cases"
  service
  transport_floor
  transport
}

"$call"
finish
