#!/usr/bin/env bash
# Two and four concurrent callers against one CPU server: before (engine chunks of concurrent
# calls at once) and after (chunks take turns on the cores), alternating, three rounds.
set -u
cd /work/main
run() {  # binary, vocab, hidden, lossctl flags...
  local bin=$1 v=$2 h=$3; shift 3
  ($bin --listen=127.0.0.1:50999 --metrics_listen= --device=cpu --demo_vocab_size=$v --demo_hidden_size=$h > /dev/null 2>&1 &)
  sleep 2
  build/bin/lossctl --server=127.0.0.1:50999 bench --head=demo --warmup=1 --json --quiet "$@" 2>/dev/null | tail -1
  pkill -f "$bin --listen=127.0.0.1:50999"; sleep 1
}
for round in 1 2 3; do
  for which in before after; do
    bin=/tmp/tb/lossd_server_$which
    for streams in 1 2; do
      echo "{\"round\": $round, \"server\": \"$which\", \"case\": \"training V=32000 H=1024 N=1024, 6 calls\", \"streams\": $streams, \"result\": $(run $bin 32000 1024 --tokens=1024 --calls=6 --streams=$streams --grad --accumulate)}"
    done
    for streams in 1 4; do
      echo "{\"round\": $round, \"server\": \"$which\", \"case\": \"transport-bound V=16 H=2048 N=4096 shared memory in place, 16 calls\", \"streams\": $streams, \"result\": $(run $bin 16 2048 --tokens=4096 --calls=16 --streams=$streams --grad --shared_memory --in_place)}"
    done
  done
done
