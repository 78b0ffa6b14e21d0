#!/usr/bin/env bash
# Sets up and builds (scripts/setup.sh), then runs every test: the ctest suites (GoogleTest,
# loopback end-to-end, Prometheus, Python client and deploy checks, the Python client, its examples,
# lossd.hf and torch.compile again under current PyPI torch and transformers), the unit and
# end-to-end suites again under AddressSanitizer + UndefinedBehaviorSanitizer and
# ThreadSanitizer, and a bounded libFuzzer run of each fuzz target.
set -euo pipefail
cd "$(dirname "$0")/.."

# The PyPI environment (scripts/python_env.sh: .venv/, made once and reused) downloads while the
# project builds; its package, python3-venv, goes first so that the two never run apt at once.
source scripts/ensure_packages.sh
ensure_packages python3-venv
python_env_log=$(mktemp)
scripts/python_env.sh > /dev/null 2> "$python_env_log" &
python_env_pid=$!
LOSSD_CMAKE_ARGS="${LOSSD_CMAKE_ARGS:-} -DLOSSD_PYTHON_ENV=$PWD/.venv/bin/python" scripts/setup.sh
if ! wait "$python_env_pid"; then
  cat "$python_env_log" >&2
  echo "scripts/python_env.sh failed" >&2
  exit 1
fi
cat "$python_env_log" >&2
rm -f "$python_env_log"

ctest --test-dir build --output-on-failure --parallel "$(nproc)" --timeout 900
scripts/sanitize.sh
scripts/fuzz.sh 10
echo "all suites passed"
