# The Python client's tests: the real lossd_server binary on loopback, the lossd package as the
# lossd_python target assembles it (client/python/CMakeLists.txt), Debian's python3 with
# python3-grpcio, python3-protobuf, python3-numpy, python3-pytest and python3-torch.
if(NOT TARGET lossd_python)
  add_subdirectory(${CMAKE_CURRENT_LIST_DIR}/../../client/python ${CMAKE_BINARY_DIR}/client/python)
endif()

set(LOSSD_PYTHON_TEST_ENVIRONMENT
  "LOSSD_SERVER_BIN=$<TARGET_FILE:lossd_server>"
  "LOSSCTL_BIN=$<TARGET_FILE:lossctl>"
  "PYTHONPATH=${LOSSD_PYTHON_DIR}"
  "OMP_NUM_THREADS=2")
set(LOSSD_PYTHON_ENV "" CACHE FILEPATH
    "python of a venv with current PyPI torch and transformers (scripts/python_env.sh)")
# A pytest suite, `file` relative to this folder, run by `python`: Debian's or LOSSD_PYTHON_ENV.
function(lossd_add_pytest name python file)
  add_test(NAME ${name}
    COMMAND "${python}" -m pytest -q -p no:cacheprovider ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/${file})
endfunction()
# COST (below): seconds on a quiet 2-core machine. ctest starts the costliest tests first, and
# without the history of an earlier run (a fresh clone) it has only these: the long suites would
# otherwise start last, in the order they are registered, and run alone while the other core idles.

# Loss, dL/dh and dL/dW against torch's float64 F.cross_entropy; scoring, errors, upload, steps.
lossd_add_pytest(python_client /usr/bin/python3 test_client.py)
# The call's options and outputs as Python objects derived from lossd.proto's descriptors.
lossd_add_pytest(python_options /usr/bin/python3 test_options.py)
# Compute over the Compute socket: the same bits and errors as over gRPC; hostile and silent peers.
lossd_add_pytest(python_compute_socket /usr/bin/python3 test_compute_socket.py)
# These two suites run once: under current PyPI torch where its environment is given (below), else
# under Debian's. They exercise servers and a training loop, not the torch version, and are slow.
if(NOT LOSSD_PYTHON_ENV)
  # Scoring over three lossd_server replicas of one head: spread, failover, pinned W; training
  # refuses a target that lists several servers.
  lossd_add_pytest(python_replicas /usr/bin/python3 test_replicas.py)
  # A tiny transformer LM trained with a local head and with a RemoteHead: the loss curves agree.
  lossd_add_pytest(python_training_example /usr/bin/python3 test_training_example.py)
  set_tests_properties(python_replicas python_training_example PROPERTIES
    ENVIRONMENT "${LOSSD_PYTHON_TEST_ENVIRONMENT}"
    TIMEOUT 2400)
  set_tests_properties(python_training_example PROPERTIES COST 70)
endif()
# The RL objectives and RemoteLogprobs against torch's float64 autograd of the same formulas.
lossd_add_pytest(python_objectives /usr/bin/python3 test_objectives.py)
# Distillation (RemoteDistill, score_kl) against torch's float64 autograd of the naive
# two-logits formula, dense and sparse teachers.
lossd_add_pytest(python_distill /usr/bin/python3 test_distill.py)
# A toy policy trained with PPO against a frozen reference head: its reward rises; a toy student
# distilled on-policy from a teacher head: its reverse KL falls (about 25 s).
lossd_add_pytest(python_rl_example /usr/bin/python3 test_rl_example.py)
# Shared memory between users: clients of two users created for the test (as root; skipped
# otherwise) against a server run as root.
lossd_add_pytest(shared_memory_users /usr/bin/python3 test_shared_memory_users.py)
# The package built as an sdist and a wheel from it, installed into a fresh venv (PyPI's `build`
# and the wheel's dependencies when PyPI can be reached).
lossd_add_pytest(python_packaging /usr/bin/python3 test_packaging.py)
set_tests_properties(python_packaging PROPERTIES
  ENVIRONMENT "LOSSD_SERVER_BIN=$<TARGET_FILE:lossd_server>;OMP_NUM_THREADS=2"
  TIMEOUT 2400)
set_tests_properties(python_client python_options python_compute_socket python_objectives
  python_distill python_rl_example shared_memory_users PROPERTIES
  ENVIRONMENT "${LOSSD_PYTHON_TEST_ENVIRONMENT}"
  TIMEOUT 1200)
set_tests_properties(python_packaging PROPERTIES COST 40)

# The GPU round's service step (bench/gpu_service.py) on the CPU: the server, lossctl and the
# Python client over messages and shared memory beside the engine in-process.
lossd_add_pytest(gpu_service_cpu /usr/bin/python3 ../gpu_service_test.py)
set_tests_properties(gpu_service_cpu PROPERTIES
  ENVIRONMENT "LOSSD_SERVER_BIN=$<TARGET_FILE:lossd_server>;LOSSCTL_BIN=$<TARGET_FILE:lossctl>;ENGINE_BENCH_BIN=$<TARGET_FILE:engine_bench>;LOSSD_PYTHON_DIR=${LOSSD_PYTHON_DIR};OMP_NUM_THREADS=2"
  TIMEOUT 600)

# The replica-group benchmark end to end on a tiny head: one and two servers, W checked the same
# on both after every step, its table printed.
add_test(NAME replicas_bench_runs
  COMMAND /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/../../bench/replicas_bench.py
          --replicas 1,2 --vocab 300 --hidden 16 --steps 2 --rounds 1 --rows 8)
set_tests_properties(replicas_bench_runs PROPERTIES
  ENVIRONMENT "LOSSD_SERVER_BIN=$<TARGET_FILE:lossd_server>;PYTHONPATH=${LOSSD_PYTHON_DIR};OMP_NUM_THREADS=2"
  PASS_REGULAR_EXPRESSION "\\| 2 \\| 300 x 16 \\| 0 \\|"
  TIMEOUT 120)

# The benchmark of calls whose row count varies, end to end on a tiny head.
add_test(NAME varying_rows_bench_runs
  COMMAND /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/../../bench/varying_rows_bench.py
          --server $<TARGET_FILE:lossd_server> --python-dir ${LOSSD_PYTHON_DIR} --hidden 16
          --min-rows 100 --max-rows 300 --calls 2 --rounds 1)
set_tests_properties(varying_rows_bench_runs PROPERTIES
  ENVIRONMENT "OMP_NUM_THREADS=2"
  PASS_REGULAR_EXPRESSION "medians: one row count [0-9.]+ s, [0-9]+ faults per call; varying"
  TIMEOUT 120)

# The benchmark of one call over several connections, end to end on a tiny head.
add_test(NAME lanes_bench_runs
  COMMAND /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/../../bench/lanes_bench.py
          --server $<TARGET_FILE:lossd_server> --python-dir ${LOSSD_PYTHON_DIR} --quick)
set_tests_properties(lanes_bench_runs PROPERTIES
  ENVIRONMENT "OMP_NUM_THREADS=2"
  PASS_REGULAR_EXPRESSION "no cap: .*median, 3 lanes: [0-9.]+ s"
  TIMEOUT 120)

# The transport benchmark's rounds against the TCP floor, end to end and small.
add_test(NAME transport_floor_bench_runs
  COMMAND /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/../../bench/transport_bench.py
          --build-dir ${CMAKE_BINARY_DIR} --quick --floor-rounds 1 --reps 1
          --out ${CMAKE_CURRENT_BINARY_DIR}/transport_floor_bench)
set_tests_properties(transport_floor_bench_runs PROPERTIES
  ENVIRONMENT "OMP_NUM_THREADS=2"
  PASS_REGULAR_EXPRESSION "Medians over rounds: floor [0-9.]+ GB/s; cpp_socket [0-9.]+ of the floor; python_socket [0-9.]+ of the floor"
  TIMEOUT 300)

# The client suites and examples again (the slowest two only here), and lossd.hf and torch.compile,
# under the current
# torch, transformers and protobuf from PyPI: the environment scripts/python_env.sh makes in .venv/
# (scripts/test.sh builds it and passes its python here). Without LOSSD_PYTHON_ENV none of these
# is registered.
if(LOSSD_PYTHON_ENV)
  set(current_tests)
  foreach(suite client options replicas objectives distill rl_example training_example)
    lossd_add_pytest(python_${suite}_current_torch "${LOSSD_PYTHON_ENV}" test_${suite}.py)
    list(APPEND current_tests python_${suite}_current_torch)
  endforeach()
  # Tiny Llama, Mistral, Qwen2, Qwen3, Gemma and Gemma 2 models, saved in shards by transformers
  # and served from their directories: lossd.hf against the unpatched models.
  lossd_add_pytest(python_hf "${LOSSD_PYTHON_ENV}" test_hf.py)
  lossd_add_pytest(python_torch_compile "${LOSSD_PYTHON_ENV}" test_torch_compile.py)
  # transformers.Trainer on 2 and 4 processes (torch.distributed, gloo) with a local head and
  # with lossd.hf.Trainer and a server killed halfway: the same parameters at the end; and the
  # wrong-W cases refused (about 4 minutes on two cores, most of it starting processes).
  lossd_add_pytest(python_trainer "${LOSSD_PYTHON_ENV}" test_trainer.py)
  # Three servers training one head as a replica group for six Trainer ranks, one replica killed
  # mid-step and the group restarted from its checkpoint: the parameters of one server's run and
  # one W on every replica after every step (about 4 minutes on two cores).
  lossd_add_pytest(python_training_replicas "${LOSSD_PYTHON_ENV}" test_training_replicas.py)
  # Every Python file of the tree against ruff.toml (pyflakes, pycodestyle, bugbear).
  add_test(NAME python_lint
    COMMAND "${LOSSD_PYTHON_ENV}" -m ruff check --no-cache ${PROJECT_SOURCE_DIR})
  set_tests_properties(${current_tests} python_hf python_torch_compile python_trainer
    python_training_replicas PROPERTIES
    ENVIRONMENT "${LOSSD_PYTHON_TEST_ENVIRONMENT}"
    TIMEOUT 1800)
  set_tests_properties(python_trainer PROPERTIES TIMEOUT 2400)
  set_tests_properties(python_training_replicas PROPERTIES TIMEOUT 2400)
  set_tests_properties(python_training_example_current_torch PROPERTIES TIMEOUT 2400)
  set_tests_properties(python_trainer PROPERTIES COST 180)
  set_tests_properties(python_training_example_current_torch PROPERTIES COST 160)
  set_tests_properties(python_training_replicas PROPERTIES COST 120)
  set_tests_properties(python_torch_compile PROPERTIES COST 70)
  set_tests_properties(python_hf python_replicas_current_torch PROPERTIES COST 30)
else()
  message(STATUS "lossd: LOSSD_PYTHON_ENV not set: the Python suites under current PyPI torch and "
                 "transformers are not registered (scripts/python_env.sh makes the environment)")
endif()
