#!/usr/bin/env bash
# Runs the C++ tests under sanitizers, built with clang-14 without CUDA:
#   build-asan  AddressSanitizer + UndefinedBehaviorSanitizer (+ LeakSanitizer): every GoogleTest
#               binary of the project (the build targets named *_test).
#   build-tsan  ThreadSanitizer: the engine's OpenMP paths, the Compute call's row reader and result
#               writer, the scheduler, the whole server end-to-end suite (concurrent streams,
#               cancellation, scheduler limits, steps racing calls), shared memory (the handover
#               socket's thread, a writer racing calls over a client's rows), replicas failing
#               over mid-call, a device fault and, where robustness_test exists, its
#               abandoned-stream, 32-client load, stalled-stream, pending-memory and
#               handler-failure tests.
# Exits non-zero on any test failure or sanitizer report. Run after scripts/setup.sh, which installs
# the project's libraries. Needs network access to Debian's archive for the TSan abseil (below).
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/ensure_packages.sh
ensure_packages clang-14 libclang-rt-14-dev libomp-14-dev dpkg-dev

configure() {  # build dir, LOSSD_SANITIZE value
  CC=clang-14 CXX=clang++-14 cmake -S . -B "$1" -G Ninja -DLOSSD_WITH_CUDA=OFF -DLOSSD_SANITIZE="$2" \
    -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g" >/dev/null
}

test_targets() {  # build dir; prints its build targets named *_test
  cmake --build "$1" --target help | sed -n 's/^\([A-Za-z0-9_]*_test\): phony$/\1/p'
}

run_test() {  # binary, arguments...
  echo "== $*"
  local start=$SECONDS
  "$@" --gtest_brief=1
  echo "   passed in $((SECONDS - start)) s"
}

# Debian builds abseil without TSan, and absl::Mutex (lossd's locks, and gRPC's inside) orders
# threads in that uninstrumented code: TSan would see none of it and report every guarded access
# as a race. So abseil's synchronization library and its dependencies are rebuilt with TSan from
# Debian's source of the installed version (same options, ABI and sonames) and put first on
# LD_LIBRARY_PATH; the rest of abseil, gRPC and protobuf stay Debian's. Kept between runs.
build_tsan_abseil() {  # output folder; the libraries land in its lib/
  local root version
  root="$(realpath -m "$1")"  # apt-get source runs in a subfolder
  version="$(dpkg-query -W -f='${source:Version}' libabsl-dev)"
  if [ "$(cat "$root/version" 2>/dev/null)" != "$version" ]; then
    rm -rf "$root"
    mkdir -p "$root/apt/lists/partial" "$root/apt/cache" "$root/src"
    echo "deb-src http://deb.debian.org/debian bookworm main" >"$root/apt/sources.list"
    # A private source list and state: the system's apt configuration stays as it is.
    local apt=(apt-get -qq -o Dir::Etc::SourceList="$root/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
               -o Dir::State::Lists="$root/apt/lists" -o Dir::Cache="$root/apt/cache")
    "${apt[@]}" update
    (cd "$root/src" && "${apt[@]}" source "abseil=$version")
    CC=clang-14 CXX=clang++-14 cmake -S "$root"/src/abseil-*/ -B "$root/build" -G Ninja \
      -DCMAKE_CXX_STANDARD=17 -DABSL_PROPAGATE_CXX_STD=ON -DBUILD_SHARED_LIBS=ON \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS=-fsanitize=thread >/dev/null
    cmake --build "$root/build" --target synchronization
    mkdir -p "$root/lib"
    find "$root/build" -name 'libabsl_*.so.*' -exec cp -P {} "$root/lib/" \;
    echo "$version" >"$root/version"
  fi
}

# ---- ASan + UBSan: every GoogleTest binary ----
configure build-asan address
mapfile -t asan_tests < <(test_targets build-asan)
cmake --build build-asan --target "${asan_tests[@]}"
(
  # A failed allocation is an outcome the code handles (Backend::Allocate returns
  # RESOURCE_EXHAUSTED, which tests provoke): ASan returns null for it as glibc does, not abort.
  export ASAN_OPTIONS=detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1:allocator_may_return_null=1
  export UBSAN_OPTIONS=print_stacktrace=1
  for test in "${asan_tests[@]}"; do
    run_test "build-asan/bin/$test"
  done
)

# ---- TSan ----
configure build-tsan thread
tsan_tests=(engine_test row_reader_test result_writer_test lane_registry_test scheduler_test
            server_e2e_test client_test accumulator_test shared_memory_test replicas_test device_fault_test)
with_robustness_test=0
if [[ " $(test_targets build-tsan | tr '\n' ' ') " == *" robustness_test "* ]]; then
  with_robustness_test=1
  tsan_tests+=(robustness_test)
fi
cmake --build build-tsan --target "${tsan_tests[@]}"
build_tsan_abseil build-tsan/abseil-tsan
(
  tsan_abseil="$PWD/build-tsan/abseil-tsan/lib"
  export LD_LIBRARY_PATH="$tsan_abseil${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # Inline templates such as absl::call_once's CallOnceImpl are weak symbols that every abseil
  # library defines, and the loader binds all uses to the first library that defines one: without
  # preloading, that is an uninstrumented Debian library (libabsl_random_internal_pool_urbg), so
  # the once-initialization of abseil's allocator arena was invisible to TSan and its first use from
  # a second thread was reported as a race. Preloading puts the instrumented copies first.
  # Only the test binaries get it: the libraries need the TSan runtime linked into them.
  preload="LD_PRELOAD=$(find "$tsan_abseil" -name 'libabsl_*.so.*' -type l | sort | paste -sd:)"
  # TSan's symbolizer inherits that preload and cannot start with it: this one drops it (its name
  # must be llvm-symbolizer for TSan to speak that tool's protocol to it).
  mkdir -p build-tsan/symbolizer
  cc -static -O1 -o build-tsan/symbolizer/llvm-symbolizer scripts/tsan_symbolizer.c
  # libomp's own synchronization is invisible to TSan, so every parallel region would look like a
  # race. LLVM's Archer (an OpenMP tool shipped with libomp) tells TSan about it instead, so the
  # engine's OpenMP loops are checked with two threads.
  export OMP_TOOL_LIBRARIES=/usr/lib/llvm-14/lib/libarcher.so OMP_NUM_THREADS=2
  # OpenBLAS runs its GEMMs on the calling thread: its threading is outside this check.
  export OPENBLAS_NUM_THREADS=1
  # ignore_noninstrumented_modules: Archer's requirement; accesses inside Debian's libraries are
  # not checked, calls into them still synchronize.
  # tsan_suppressions.txt: gRPC's callback API hands ops from the thread that starts them to gRPC's
  # threads through libgrpc's uninstrumented queues; it names the gRPC code on either side.
  export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ignore_noninstrumented_modules=1 suppressions=$PWD/scripts/tsan_suppressions.txt external_symbolizer_path=$PWD/build-tsan/symbolizer/llvm-symbolizer"
  run_test env "$preload" build-tsan/bin/engine_test --gtest_filter='*/cpu_basic:*/cpu_vocab_tiled:*/cpu_everything_tiled:*/cpu_bf16_grad_hidden:*/cpu_top_k_max:*IdenticalCalls*/cpu:*GradWeightAccumulates*/cpu'
  run_test env "$preload" build-tsan/bin/row_reader_test
  run_test env "$preload" build-tsan/bin/result_writer_test
  run_test env "$preload" build-tsan/bin/lane_registry_test
  run_test env "$preload" build-tsan/bin/scheduler_test
  run_test env "$preload" build-tsan/bin/server_e2e_test
  # Shared memory: the handover socket's thread registering and revoking handles against calls
  # mapping and releasing ranges; a writer thread racing the engine over a client's rows; calls
  # on several threads sharing the client's scoring connections.
  run_test env "$preload" build-tsan/bin/client_test --gtest_filter='*SharedMemory*:*GradHiddenOut*:*LostAnswer*:*ConcurrentScoring*:*ComputeSocket*'
  run_test env "$preload" build-tsan/bin/shared_memory_test
  run_test env "$preload" build-tsan/bin/accumulator_test --gtest_filter='CallIdTest.*'
  # Compute calls failing over between replicas killed mid-call; a device fault met on a call's
  # thread turning the service and its health away while other calls run.
  run_test env "$preload" build-tsan/bin/replicas_test
  run_test env "$preload" build-tsan/bin/device_fault_test
  if ((with_robustness_test)); then
    run_test env "$preload" build-tsan/bin/robustness_test \
      --gtest_filter='CancellationTest.*:LoadTest.*:StallTest.*:*StalledStreamTest.*:PendingMemoryTest.*:HandlerFailureTest.*'
  fi
)
