#!/usr/bin/env python3
"""Calls whose row count varies from call to call, as packed batches and RL rollouts make them,
against calls of one row count, on one lossd_server: seconds per call and the server's minor page
faults per call (fresh buffer pages), medians over each round's calls.

Each call sends N float32 rows of --hidden over the Compute socket with dL/dh back, on a zero
[16, --hidden] head (compute is small: the server's buffers and the transport decide). The varying
calls draw N uniformly from [--min-rows, --max-rows]; the steady ones take --max-rows. Prints one
line per round and the medians of all rounds.

  OMP_NUM_THREADS=2 .venv/bin/python bench/varying_rows_bench.py --server build/bin/lossd_server
"""
import argparse
import os
import statistics
import sys
import time

import demo_server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def minor_faults(pid):
    """The process's minor page faults so far (/proc/PID/stat, field 10)."""
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[7])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default=os.path.join(REPO, "build", "bin", "lossd_server"))
    parser.add_argument("--python-dir", default=os.path.join(REPO, "build", "python"))
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--min-rows", type=int, default=15000)
    parser.add_argument("--max-rows", type=int, default=16384)
    parser.add_argument("--calls", type=int, default=8, help="calls of each kind per round")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    sys.path.insert(0, args.python_dir)
    import numpy as np

    import lossd

    with demo_server.running(args.server, args.hidden) as (server, address):
        client = lossd.Client(address, compute_socket=True)
        client.upload_head("wire", np.zeros((16, args.hidden), np.float32))
        rng = np.random.default_rng(0)
        hidden = rng.standard_normal((args.max_rows, args.hidden), dtype=np.float32)
        labels = rng.integers(0, 16, args.max_rows)

        def run(row_counts):
            seconds, faults = [], []
            for n in row_counts:
                before = minor_faults(server.pid)
                start = time.perf_counter()
                client.compute("wire", hidden[:n], labels[:n], outputs=["grad_hidden"],
                               shared_memory=False)
                seconds.append(time.perf_counter() - start)
                faults.append(minor_faults(server.pid) - before)
            return statistics.median(seconds), statistics.median(faults)

        run([args.max_rows, args.min_rows])  # warm: threads, connections, the first buffers
        steady, varying = [], []
        for round_index in range(args.rounds):
            steady.append(run([args.max_rows] * args.calls))
            varying.append(run([int(n) for n in rng.integers(args.min_rows, args.max_rows + 1,
                                                             args.calls)]))
            print(f"round {round_index}: one row count {steady[-1][0]:.3f} s, "
                  f"{steady[-1][1]:.0f} faults; varying {varying[-1][0]:.3f} s, "
                  f"{varying[-1][1]:.0f} faults", flush=True)
        print(f"medians: one row count {statistics.median(s for s, _ in steady):.3f} s, "
              f"{statistics.median(f for _, f in steady):.0f} faults per call; varying "
              f"{statistics.median(s for s, _ in varying):.3f} s, "
              f"{statistics.median(f for _, f in varying):.0f} faults per call")
        client.close()


if __name__ == "__main__":
    main()
