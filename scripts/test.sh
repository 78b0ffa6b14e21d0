#!/usr/bin/env bash
# Sets up and builds (scripts/setup.sh), then runs every test: the C++ suites through ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
ctest --test-dir build --output-on-failure --parallel "$(nproc)" --timeout 900
