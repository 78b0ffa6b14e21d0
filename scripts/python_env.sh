#!/usr/bin/env bash
# The Python environment of the tests that need current PyPI packages (torch, transformers,
# safetensors, protobuf 7, ...) and of bench/peers.sh: a virtual environment in .venv/
# (git-ignored), created from Debian's python3 on first use and reused afterwards. Prints the path
# of its python on stdout.
#
#   scripts/python_env.sh            create .venv/ if needed, print .venv/bin/python
#   scripts/python_env.sh --upgrade  reinstall the newest releases of the packages
#   LOSSD_VENV=DIR scripts/python_env.sh   use DIR instead of .venv/
#
# The packages are the newest on PyPI when the environment is created, which is what
# `pip install lossd[torch]` gives a user; the versions installed are written to
# DIR/lossd-requirements.txt (pip freeze) for the record. torch from PyPI carries its CUDA
# libraries (about 5.7 GB, 100 s on a 2-core machine with a fast link); it runs on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${LOSSD_VENV:-.venv}"
# matplotlib: bench/peers.sh's plots, which run here too; ruff: the Python linter CI runs;
# liger-kernel: bench/rl_peers.py's peer.
packages=(torch transformers accelerate safetensors grpcio protobuf numpy pytest matplotlib ruff
          liger-kernel)
# What the environment was made with; a change of the list (or --upgrade) makes it anew.
stamp="$venv/lossd-packages"

upgrade=0
case "${1:-}" in
  --upgrade) upgrade=1 ;;
  "") ;;
  *) echo "usage: $0 [--upgrade]" >&2; exit 2 ;;
esac

if [ "$upgrade" = 0 ] && [ -x "$venv/bin/python" ] &&
    [ "$(cat "$stamp" 2>/dev/null)" = "${packages[*]}" ]; then
  echo "$(cd "$venv" && pwd)/bin/python"
  exit 0
fi

# Debian's python3 with its venv module (python3-venv, in scripts/setup.sh's list).
if ! /usr/bin/python3 -c "import ensurepip" 2>/dev/null; then
  source scripts/ensure_packages.sh
  ensure_packages python3-venv >&2
fi
start=$SECONDS
rm -f "$stamp"
/usr/bin/python3 -m venv "$venv"
# pip's own output goes to stderr: stdout carries only the path.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip >&2
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade "${packages[@]}" >&2
"$venv/bin/python" -m pip freeze --disable-pip-version-check > "$venv/lossd-requirements.txt"
echo "${packages[*]}" > "$stamp"
versions=$(grep -E -i '^(torch|transformers|protobuf|grpcio)==' "$venv/lossd-requirements.txt" ||
  true)
echo "python_env: $venv ready in $((SECONDS - start)) s ($(du -sh "$venv" | cut -f1)):" \
  $versions >&2
echo "$(cd "$venv" && pwd)/bin/python"
