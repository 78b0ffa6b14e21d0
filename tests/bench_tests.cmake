# engine_bench exits 1 when the engine's loss or dL/dh disagrees with its naive baseline: small
# shapes in both input dtypes, with a budget that splits the batch into several token chunks.
foreach(dtype fp32 bf16)
  add_test(NAME engine_bench_agrees_with_naive_${dtype}
    # N = 1: a single row; V = 4097: not a multiple of any block; 1 MiB: several chunks at N = 300.
    COMMAND engine_bench --shapes "1,64,1000;300,64,1000;129,96,4097" --budget-mib 1 --reps 1
            --rep-seconds 0 --dtype ${dtype})
  set_tests_properties(engine_bench_agrees_with_naive_${dtype} PROPERTIES
    ENVIRONMENT "OMP_NUM_THREADS=2" TIMEOUT 300)
endforeach()

add_test(NAME engine_bench_names_a_bad_flag COMMAND engine_bench --dtype fp16)
set_tests_properties(engine_bench_names_a_bad_flag PROPERTIES
  PASS_REGULAR_EXPRESSION "--dtype: expected fp32 or bf16, got 'fp16'")

add_test(NAME engine_bench_reports
  COMMAND /usr/bin/python3 -m pytest -q -p no:cacheprovider ${CMAKE_CURRENT_LIST_DIR}/engine_bench_test.py)
set_tests_properties(engine_bench_reports PROPERTIES
  ENVIRONMENT "ENGINE_BENCH_BIN=$<TARGET_FILE:engine_bench>;OMP_NUM_THREADS=2" TIMEOUT 300)

# The GPU peer benchmark's own logic, on the CPU (its CUDA-only peers report why they did not run).
add_test(NAME gpu_peers_cpu
  COMMAND /usr/bin/python3 -m pytest -q -p no:cacheprovider ${CMAKE_CURRENT_LIST_DIR}/gpu_peers_test.py)
set_tests_properties(gpu_peers_cpu PROPERTIES
  ENVIRONMENT "ENGINE_BENCH_BIN=$<TARGET_FILE:engine_bench>;OMP_NUM_THREADS=2"
  TIMEOUT 600)

# peers.py's report: targets judged from a run's own figures, results.md rewritten from raw results.
add_test(NAME peers_report
  COMMAND /usr/bin/python3 -m pytest -q -p no:cacheprovider ${CMAKE_CURRENT_LIST_DIR}/peers_report_test.py)
set_tests_properties(peers_report PROPERTIES TIMEOUT 300)

# scripts/gpu_round.sh's usage, its message when .gpu/ was not carried to the GPU machine, and a
# dry run of both calls of its runbook on fakes of the GPU machine's tools and lossd's programs.
add_test(NAME gpu_round_dry_run
  COMMAND /usr/bin/python3 -m pytest -q -p no:cacheprovider ${CMAKE_CURRENT_LIST_DIR}/gpu_round_test.py)
set_tests_properties(gpu_round_dry_run PROPERTIES TIMEOUT 300)

# The distillation peer benchmark's own logic on the CPU, the engine's row from distill_bench on
# the same inputs as torch's.
add_test(NAME distill_peers_cpu
  COMMAND /usr/bin/python3 -m pytest -q -p no:cacheprovider
          ${CMAKE_CURRENT_LIST_DIR}/distill_peers_test.py)
set_tests_properties(distill_peers_cpu PROPERTIES
  ENVIRONMENT "DISTILL_BENCH_BIN=$<TARGET_FILE:distill_bench>;OMP_NUM_THREADS=2"
  TIMEOUT 600)

add_test(NAME distill_bench_names_a_bad_flag COMMAND distill_bench --passes=backward)
set_tests_properties(distill_bench_names_a_bad_flag PROPERTIES
  PASS_REGULAR_EXPRESSION "--passes: expected fwd and/or fwd_bwd, got 'backward'")
