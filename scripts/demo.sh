#!/usr/bin/env bash
# Sets up and builds (scripts/setup.sh), starts lossd_server with its embedded demo head (a seeded
# random W of [32000, 512]) and runs the demo client against it: a few training steps whose loss
# goes down, a scoring call, and the metrics endpoint. The server is stopped at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
log=$(mktemp)
build/bin/lossd_server --listen=127.0.0.1:50051 --metrics_listen=127.0.0.1:9464 >"$log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 100); do
  grep -q "serving gRPC" "$log" && break
  kill -0 $server 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.1
done
cat "$log"
PYTHONPATH=build/python OMP_NUM_THREADS=$(nproc) /usr/bin/python3 scripts/demo_client.py \
  --server=127.0.0.1:50051 --metrics=http://127.0.0.1:9464/metrics
