#!/usr/bin/env bash
# Sets up and builds (scripts/setup.sh), then runs every test: the ctest suites (GoogleTest,
# loopback end-to-end, Prometheus, Python client and deploy checks), the unit and end-to-end suites
# again under AddressSanitizer + UndefinedBehaviorSanitizer and ThreadSanitizer, and a bounded
# libFuzzer run of each fuzz target.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
ctest --test-dir build --output-on-failure --parallel "$(nproc)" --timeout 900
scripts/sanitize.sh
scripts/fuzz.sh 10
echo "all suites passed"
