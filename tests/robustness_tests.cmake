# Robustness: malformed requests, abandoned and stalled streams, concurrent load, admission
# bounds, handler failures, authentication and TLS against an in-process server
# (robustness_test), what a server refuses to start on (startup_test), the gradient
# accumulator's guarantees (accumulator_test), shared memory (shared_memory_test, below), a taken
# port, crash safety of checkpoints and a handler failure under an address-space limit against
# the real binary (python/test_listen_ports.py, python/test_crash_safety.py,
# python/test_handler_failures.py). Figures: ROBUSTNESS.md.
include(GoogleTest)

# One file per suite in robustness/, one binary.
add_executable(robustness_test
  ${CMAKE_CURRENT_LIST_DIR}/robustness/bad_input_test.cc
  ${CMAKE_CURRENT_LIST_DIR}/robustness/cancellation_test.cc
  ${CMAKE_CURRENT_LIST_DIR}/robustness/load_test.cc
  ${CMAKE_CURRENT_LIST_DIR}/robustness/auth_test.cc
  ${CMAKE_CURRENT_LIST_DIR}/robustness/stall_test.cc
  ${CMAKE_CURRENT_LIST_DIR}/robustness/pending_memory_test.cc
  ${CMAKE_CURRENT_LIST_DIR}/robustness/handler_failure_test.cc
  ${CMAKE_CURRENT_LIST_DIR}/robustness/compute_budget_test.cc
)
target_link_libraries(robustness_test PRIVATE lossd_test_server_harness GTest::gtest_main)
# Compiled as one translation unit, as the suites were one file before: the build compiles every
# test three times (plain, ASan, TSan), and each suite file alone would parse the same gRPC,
# protobuf and GoogleTest headers again. The suites' names stay unique across the folder for it.
set_target_properties(robustness_test PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 0)
gtest_discover_tests(robustness_test
  DISCOVERY_TIMEOUT 300
  PROPERTIES TIMEOUT 600 ENVIRONMENT "OMP_NUM_THREADS=2")

add_executable(startup_test
  ${CMAKE_CURRENT_LIST_DIR}/startup_test.cc
)
target_link_libraries(startup_test PRIVATE lossd_test_server_harness GTest::gtest_main)
gtest_discover_tests(startup_test DISCOVERY_TIMEOUT 300 PROPERTIES TIMEOUT 300)

# The gradient accumulator: calls that would overflow it, and call ids against double counting.
add_executable(accumulator_test
  ${CMAKE_CURRENT_LIST_DIR}/accumulator_test.cc
)
target_link_libraries(accumulator_test PRIVATE lossd_test_server_harness GTest::gtest_main)
gtest_discover_tests(accumulator_test
  DISCOVERY_TIMEOUT 300
  PROPERTIES TIMEOUT 600 ENVIRONMENT "OMP_NUM_THREADS=2")

# A pytest file of python/ against the real lossd_server binary, as the test `name`.
function(add_server_pytest name file timeout)
  add_test(NAME ${name}
    COMMAND /usr/bin/python3 -m pytest -q -p no:cacheprovider
            ${CMAKE_CURRENT_LIST_DIR}/python/${file})
  set_tests_properties(${name} PROPERTIES
    ENVIRONMENT "LOSSD_SERVER_BIN=$<TARGET_FILE:lossd_server>;OMP_NUM_THREADS=2"
    TIMEOUT ${timeout})
endfunction()

add_server_pytest(checkpoint_crash_safety test_crash_safety.py 1200)
set_tests_properties(checkpoint_crash_safety PROPERTIES COST 36)  # seconds (python_client.cmake)
add_server_pytest(listen_ports test_listen_ports.py 600)
add_server_pytest(handler_failures test_handler_failures.py 600)
add_server_pytest(server_startup test_startup.py 1800)

# Shared memory against clients that misbehave on purpose: the handover socket, handles, layouts,
# rows rewritten during calls, sparse memfds (shared_memory_test, in-process server); clients of
# two other users than the server's (python/test_shared_memory_users.py, the real binary).
add_executable(shared_memory_test
  ${CMAKE_CURRENT_LIST_DIR}/shared_memory_test.cc
)
target_link_libraries(shared_memory_test PRIVATE
  lossd_test_server_harness
  lossd_client GTest::gtest_main)
gtest_discover_tests(shared_memory_test
  DISCOVERY_TIMEOUT 300
  PROPERTIES TIMEOUT 600 ENVIRONMENT "OMP_NUM_THREADS=2")
