#!/usr/bin/env python3
"""One Compute call spread over several connections (lanes, ComputeSocketLanes in lossd.proto)
against the same call on one, where each TCP flow is capped and where none is.

A link that one flow cannot fill (flows paced or capped one by one, a long path with a small
window) is stood in for on loopback by capping every connection's sending rate in both
directions: the server's with --compute_socket_max_flow_mb_per_second, the client's with the
same kernel pacing (SO_MAX_PACING_RATE) set on its Compute socket connections here. Each call sends
N float32 rows of --hidden over the Compute socket with dL/dh back, on a zero [16, --hidden] head
(compute is small: the transport decides). Per round, each lane count in turn (the order reversed
every other round) makes --calls calls after a warm-up, the fastest kept; printed per round, then
the medians over rounds and their ratios to one lane.

  OMP_NUM_THREADS=2 .venv/bin/python bench/lanes_bench.py [--cap-mb 200] [--quick]
"""
import argparse
import os
import socket
import statistics
import sys
import time

import demo_server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # Linux's number


def pace_client_connections(cap_mb):
    """Caps the sending rate of every Compute socket connection this process opens from now on
    (0: no cap), as the server caps its own."""
    from lossd import _compute_socket
    connection = _compute_socket._Connection
    if not hasattr(connection, "_unpaced_init"):
        connection._unpaced_init = connection.__init__

    def paced_init(self, *args, **kwargs):
        connection._unpaced_init(self, *args, **kwargs)
        if cap_mb:
            self.sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, int(cap_mb * 1e6))

    connection.__init__ = paced_init


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default=os.path.join(REPO, "build", "bin", "lossd_server"))
    parser.add_argument("--python-dir", default=os.path.join(REPO, "build", "python"))
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--rows-per-message", type=int, default=None,
                        help="rows per message (default: the client's, cut for the lanes)")
    parser.add_argument("--lanes", default="1,2,4,8")
    parser.add_argument("--cap-mb", type=float, default=200,
                        help="MB/s each flow carries at most in the capped run")
    parser.add_argument("--calls", type=int, default=3, help="calls per lane count per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a smoke run: small and short")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.hidden, args.rounds, args.calls, args.lanes = 512, 256, 1, 1, "1,3"
        args.rows_per_message = 64
    lane_counts = [int(n) for n in args.lanes.split(",")]
    sys.path.insert(0, args.python_dir)
    import numpy as np

    import lossd

    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((args.rows, args.hidden), dtype=np.float32)
    labels = rng.integers(0, 16, args.rows)
    for cap_mb in (args.cap_mb, 0):
        pace_client_connections(cap_mb)
        flags = [f"--compute_socket_max_flow_mb_per_second={cap_mb}"] if cap_mb else []
        with demo_server.running(args.server, args.hidden, *flags) as (_, address):
            with lossd.Client(address, compute_socket=False) as setup:
                setup.upload_head("wire", np.zeros((16, args.hidden), np.float32))
            clients = {n: lossd.Client(address, compute_socket=True, compute_socket_lanes=n)
                       for n in lane_counts}
            where = f"each flow capped at {cap_mb:g} MB/s" if cap_mb else "no cap"
            print(f"{where}: {args.rows} float32 rows of {args.hidden} each way per call "
                  f"({hidden.nbytes / 1e6:.1f} MB)", flush=True)
            fastest = {n: [] for n in lane_counts}
            for round_index in range(args.rounds):
                order = lane_counts if round_index % 2 == 0 else lane_counts[::-1]
                for n in order:
                    times = []
                    for call in range(args.calls + 1):  # the first warms the connections
                        start = time.perf_counter()
                        result = clients[n].compute("wire", hidden, labels,
                                                    outputs=["grad_hidden"], shared_memory=False,
                                                    rows_per_message=args.rows_per_message)
                        if call:
                            times.append(time.perf_counter() - start)
                        assert result.transport == "compute_socket", result.transport
                    fastest[n].append(min(times))
                print(f"  round {round_index}: " + ", ".join(
                    f"{n} lane{'s' if n > 1 else ''} {fastest[n][-1]:.3f} s" for n in lane_counts),
                    flush=True)
            one = statistics.median(fastest[lane_counts[0]])
            for n in lane_counts:
                median = statistics.median(fastest[n])
                print(f"  median, {n} lane{'s' if n > 1 else ''}: {median:.3f} s, "
                      f"{hidden.nbytes / median / 1e9:.2f} GB/s each way, "
                      f"{one / median:.2f}x of {lane_counts[0]}", flush=True)
            for client in clients.values():
                client.close()


if __name__ == "__main__":
    main()
