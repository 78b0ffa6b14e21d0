#!/usr/bin/env python3
"""The transport of a remote Compute call against the floors of this machine, in one run.

A call whose compute is small (a [16, H] head) moves the hidden rows in and dL/dh out; its GB/s
each way is the transport's. Measured beside each other:
  tcp_one_way    raw TCP over loopback: one process sends 4 MiB buffers, another receives them
  tcp_both_ways  the same both ways at once (two connections), each direction's GB/s
  memcpy         single-thread copy bandwidth (numpy), the floor of shared memory
  grpc_echo      gRPC's own echo of the same bytes, C++ (bench/grpc_echo_bench), through protobuf
  grpc_echo_one_copy  the same as raw bytes copied once each way on each side, as lossd's Compute
                 moves them between the C++ client and the server (proto/wire)
  grpc_echo_one_copy_N_connections  with several callers: their calls spread over N connections
                 instead of sharing one, whether one large call would gain from several
  cpp_messages   lossd Compute from the C++ client (lossctl bench), rows and dL/dh in messages,
                 dL/dh lent by the client (ComputeRequest::lend_grad_hidden) as the Python
                 client's is by default
  cpp_socket     the same messages over the server's Compute socket (plain TCP beside gRPC)
  cpp_socket_into_buffer  the same with dL/dh written into a buffer of the caller's
                 (ComputeRequest::grad_hidden_out), only once the call has succeeded
  cpp_shm        the same through a memfd shared with the server, the rows copied into it as the
                 server says (before the start where it computes on the host's cores)
  cpp_shm_rows_follow  the same with the rows copied after the start, 32 MiB at a time, each piece
                 announced once in place (SharedMemory.rows_follow), whatever the server says
  cpp_shm_in_place  the rows in a SharedRegion and dL/dh lent where the server wrote it (lossctl
                 bench --in_place): no copy on either side
  python_messages, python_socket, python_shm, python_shm_rows_follow   the same from the
                 Python client (lossd.Client.compute)
  python_shm_shared_array       the Python client with its rows in a Client.shared_array
each for float32 and bfloat16 rows, from 1 and several concurrent callers; then GB/s against the
message size (rows per message) for both clients' messages, the plot gbps_vs_message_size.png;
and remote time over in-process engine time for the same call, where compute is small (the
transport-bound case) and at a CPU benchmark shape (V = 32000, H = 2048, N = 2048, training).

    bench/transport_bench.py [--build-dir build] [--tokens 16384] [--out DIR] [--quick]
    bench/transport_bench.py --floor-rounds R   only the floor against both clients' socket calls

The floor of loopback TCP moves between runs on a shared machine (1.8-2.8 GB/s each way on the
2-vCPU one) more than the paths do, so --floor-rounds R measures, R times in turn (the order
rotated each round), TCP both ways and one float32 call of each client over the Compute socket
(the C++ client's with dL/dh lent and into a buffer of the caller's), and reports each round's
ratio of path to floor and their medians.

Writes DIR (default bench/results/<machine>-<date>-transport/): results.jsonl, results.md,
gbps_vs_message_size.png. Run it with a Python that has numpy, grpcio and protobuf (Debian's
python3 does, or the .venv of scripts/python_env.sh) after building.
"""
import argparse
import datetime
import json
import multiprocessing
import os
import socket
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import peers  # noqa: E402  (its Runner, Server and machine description)

MIB = 1 << 20
HIDDEN = peers.TRANSPORT_HIDDEN
DTYPES = {"float32": 4, "bfloat16": 2}
CALLERS = (1, 4)
MESSAGE_MIB = (0.25, 1, 4, 16, 64)
TCP_BYTES = 1 << 30
TCP_BUFFER = 4 * MIB
TRAINING_SHAPE = (32000, 2048, 2048)  # V, H, N of the CPU benchmark's first shape
FOLLOWING_PIECE_BYTES = 32 * MIB  # the clients' pieces where the server says rows_follow pays


# --- raw TCP ---------------------------------------------------------------------------------------

def _receive(port, total, ready, out):
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(1)
        ready.set()
        connection, _ = listener.accept()
        buffer = bytearray(TCP_BUFFER)
        view = memoryview(buffer)
        received = 0
        start = None
        while received < total:
            n = connection.recv_into(view)
            if n == 0:
                break
            start = start or time.perf_counter()
            received += n
        out.put((received, time.perf_counter() - start))
        connection.close()


def _send(port, total):
    payload = memoryview(bytearray(os.urandom(TCP_BUFFER)))
    with socket.create_connection(("127.0.0.1", port)) as connection:
        sent = 0
        while sent < total:
            connection.sendall(payload)
            sent += len(payload)


def tcp_gbps(directions):
    """GB/s of each of `directions` concurrent one-way transfers of TCP_BYTES over loopback,
    each between two processes of its own (the kernel's copies, not Python, are the cost)."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    receivers, senders = [], []
    for _ in range(directions):
        port = peers.free_port()
        ready = context.Event()
        receiver = context.Process(target=_receive, args=(port, TCP_BYTES, ready, out))
        receiver.start()
        ready.wait(30)
        receivers.append(receiver)
        senders.append(context.Process(target=_send, args=(port, TCP_BYTES)))
    for sender in senders:
        sender.start()
    results = [out.get(timeout=300) for _ in range(directions)]
    for process in senders + receivers:
        process.join(60)
    return [received / seconds / 1e9 for received, seconds in results]


# --- the Python client ------------------------------------------------------------------------------

def python_compute(address, tokens, dtype, callers, shared_memory, rows_per_message=None,
                   calls=3, shared_array=False, rows_per_piece=None, compute_socket=False):
    """Seconds of the fastest of `calls` rounds, each `callers` concurrent compute() calls of
    tokens / callers rows with dL/dh, and the tensor bytes each way of a round. shared_array:
    each caller's rows lie in a Client.shared_array, read by the server where they are.
    rows_per_piece: rows copied into shared memory after the start, this many at a time."""
    import numpy as np

    import lossd

    rows = tokens // callers
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((rows, HIDDEN), dtype=np.float32)
    if dtype == "bfloat16":
        hidden = lossd.float32_to_bfloat16_bits(hidden)
    labels = rng.integers(0, peers.TRANSPORT_VOCAB, rows)
    clients = [lossd.Client(address, timeout=600) for _ in range(callers)]
    rows_of = {}
    for client in clients:
        rows_of[client] = hidden
        if shared_array:
            rows_of[client] = client.shared_array(hidden.shape, dtype)
            rows_of[client][:] = hidden

    def one(client):
        client.compute("wire", rows_of[client], labels, outputs=["grad_hidden"],
                       shared_memory=shared_memory, rows_per_message=rows_per_message,
                       shared_rows_per_piece=rows_per_piece, compute_socket=compute_socket)

    def round_seconds():
        threads = [threading.Thread(target=one, args=(client,)) for client in clients]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.perf_counter() - start

    round_seconds()  # warm: connections, handover, the server's call buffers
    best = min(round_seconds() for _ in range(calls))
    rows_of.clear()
    for client in clients:
        client.close()
    return best, rows * callers * HIDDEN * DTYPES[dtype]


# --- the run -----------------------------------------------------------------------------------

def entry(path, dtype, callers, seconds, bytes_each_way, **extra):
    return dict(path=path, dtype=dtype, callers=callers, seconds=seconds,
                gbps=bytes_each_way / seconds / 1e9, **extra)


def fastest_lossctl(runner, reps, *args, **kwargs):
    """lossctl bench's result of the fastest of `reps` runs (each after its own warm-up call), as
    the Python paths take the fastest of their rounds; an error as soon as one run fails."""
    best = None
    for _ in range(reps):
        result, _ = runner.lossctl_bench(*args, **kwargs)
        if "error" in result:
            return result
        if best is None or result["seconds"] < best["seconds"]:
            best = result
    return best


def measure(args, record):
    runner = peers.Runner(args)
    record(dict(path="memcpy", gbps=peers.memcpy_gbps()))
    one_way, = tcp_gbps(1)
    record(dict(path="tcp_one_way", gbps=one_way))
    both = tcp_gbps(2)
    record(dict(path="tcp_both_ways", gbps=min(both), gbps_each=both))

    tokens = args.tokens
    server = peers.Server(runner, peers.TRANSPORT_VOCAB, HIDDEN, compute_socket=True)
    try:
        for dtype in DTYPES:
            for callers in CALLERS:
                echoes = [("protobuf", 1), ("one", 1)] + ([("one", callers)] if callers > 1 else [])
                for copies, connections in echoes:
                    echo = peers.bench_echo(runner, tokens, dtype, callers, copies, connections)
                    if "error" not in echo:
                        record(entry(echo["method"], dtype, callers, echo["seconds"],
                                     echo["in_gbps"] * echo["seconds"] * 1e9))
                follow = FOLLOWING_PIECE_BYTES // (HIDDEN * DTYPES[dtype])
                for path, shared, in_place, piece in (("cpp_messages", False, False, 0),
                                                      ("cpp_socket", False, False, 0),
                                                      ("cpp_socket_into_buffer", False, False, 0),
                                                      ("cpp_shm", True, False, 0),
                                                      ("cpp_shm_rows_follow", True, False, follow),
                                                      ("cpp_shm_in_place", True, True, 0)):
                    result = fastest_lossctl(runner, args.reps, server.address, "wire", tokens,
                                             streams=callers, dtype=dtype, accumulate=False,
                                             warmup=1, warmup_tokens=0, shared_memory=shared,
                                             in_place=in_place, shared_rows_per_piece=piece,
                                             compute_socket=path.startswith("cpp_socket"),
                                             lend_grad_hidden=not path.endswith("_into_buffer"))
                    if "error" in result:
                        record(dict(path=path, dtype=dtype, callers=callers,
                                    error=result["error"]))
                        continue
                    record(entry(path, dtype, callers, result["seconds"],
                                 result["hidden_bytes"]))
                for path, shared, in_array, piece in (
                        ("python_messages", False, False, None),
                        ("python_socket", False, False, None),
                        ("python_shm", True, False, None),
                        ("python_shm_rows_follow", True, False, follow),
                        ("python_shm_shared_array", True, True, None)):
                    seconds, moved = python_compute(server.address, tokens, dtype, callers,
                                                    shared, calls=args.reps,
                                                    shared_array=in_array, rows_per_piece=piece,
                                                    compute_socket=path == "python_socket")
                    record(entry(path, dtype, callers, seconds, moved))
        for mib in MESSAGE_MIB:
            rows = max(1, int(mib * MIB) // (HIDDEN * 4))
            for socket_too in (False, True):
                suffix = "_socket" if socket_too else "_messages"
                result = fastest_lossctl(runner, args.reps, server.address, "wire", tokens,
                                         dtype="float32", accumulate=False, warmup=1,
                                         warmup_tokens=0, rows_per_message=rows,
                                         compute_socket=socket_too, lend_grad_hidden=True)
                if "error" not in result:
                    record(entry("cpp" + suffix, "float32", 1, result["seconds"],
                                 result["hidden_bytes"], message_mib=mib))
                seconds, moved = python_compute(server.address, tokens, "float32", 1, False,
                                                rows_per_message=rows, compute_socket=socket_too)
                record(entry("python" + suffix, "float32", 1, seconds, moved, message_mib=mib))
    finally:
        server.stop()
    # The same call in-process: dL/dh, no dL/dW, as the transport calls ask.
    engine, _ = runner.engine_bench("engine", tokens, HIDDEN, peers.TRANSPORT_VOCAB,
                                    passes="fwd_dh")
    if "error" not in engine:
        record(dict(path="engine_in_process", shape=[peers.TRANSPORT_VOCAB, HIDDEN, tokens],
                    seconds=engine["seconds"]))

    v, h, n = TRAINING_SHAPE
    server = peers.Server(runner, v, h)
    try:
        server.warm(n)
        remote, _ = runner.lossctl_bench(server.address, "demo", n)
        if "error" not in remote:
            record(dict(path="cpp_training_call", shape=[v, h, n], seconds=remote["seconds"]))
        remote_python, _ = runner.worker("remote_python", n, h, v, address=server.address)
        if "error" not in remote_python:
            record(dict(path="python_training_call", shape=[v, h, n],
                        seconds=remote_python["seconds"]))
    finally:
        server.stop()
    engine, _ = runner.engine_bench("engine", n, h, v)
    if "error" not in engine:
        record(dict(path="engine_training_call", shape=[v, h, n], seconds=engine["seconds"]))


def measure_against_floor(args, record):
    """R rounds of the TCP floor (both ways at once) and each client's socket call, in turn."""
    runner = peers.Runner(args)
    server = peers.Server(runner, peers.TRANSPORT_VOCAB, HIDDEN, compute_socket=True)
    tokens = args.tokens

    def floor():
        return "tcp_both_ways", min(tcp_gbps(2))

    def cpp_call(path, lend_grad_hidden):
        result = fastest_lossctl(runner, args.reps, server.address, "wire", tokens,
                                 accumulate=False, warmup=1, warmup_tokens=0,
                                 compute_socket=True, lend_grad_hidden=lend_grad_hidden)
        if "error" in result:
            raise RuntimeError(result["error"])
        return path, result["hidden_bytes"] / result["seconds"] / 1e9

    def cpp():
        return cpp_call("cpp_socket", True)

    def cpp_into_buffer():
        return cpp_call("cpp_socket_into_buffer", False)

    def python():
        seconds, moved = python_compute(server.address, tokens, "float32", 1, False,
                                        calls=args.reps, compute_socket=True)
        return "python_socket", moved / seconds / 1e9

    try:
        steps = [floor, cpp, cpp_into_buffer, python]
        for round_index in range(args.floor_rounds):
            shift = round_index % len(steps)
            for step in steps[shift:] + steps[:shift]:
                path, gbps = step()
                record(dict(path=path, round=round_index, dtype="float32", callers=1,
                            gbps=gbps))
    finally:
        server.stop()


def report_against_floor(out_dir, rows, machine, command):
    rounds = sorted({row["round"] for row in rows})
    gbps = {(row["path"], row["round"]): row["gbps"] for row in rows}
    paths = {"cpp_socket": "C++ socket, dL/dh lent",
             "cpp_socket_into_buffer": "C++ socket, dL/dh into the caller's buffer",
             "python_socket": "Python socket"}
    lines = [f"# Transport against the TCP floor, round by round, on {machine}", "",
             f"`{command}`", "",
             "| round | TCP both ways, GB/s each way | " +
             " | ".join(f"{label} | of the floor" for label in paths.values()) + " |",
             "| ---: | ---: |" + " ---: | ---: |" * len(paths)]
    ratios = {path: [] for path in paths}
    for r in rounds:
        floor = gbps[("tcp_both_ways", r)]
        cells = [f"{floor:.2f}"]
        for path in ratios:
            ratios[path].append(gbps[(path, r)] / floor)
            cells += [f"{gbps[(path, r)]:.2f}", f"{ratios[path][-1]:.2f}"]
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    lines += ["", "Medians over rounds: floor "
              f"{statistics.median(gbps[('tcp_both_ways', r)] for r in rounds):.2f} GB/s; " +
              "; ".join(f"{path} {statistics.median(values):.2f} of the floor"
                        for path, values in ratios.items())]
    with open(os.path.join(out_dir, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def report(out_dir, rows, machine, command):
    """results.md: the throughput table, the message-size sweep, the ratios; and the plot."""
    by = {}
    for row in rows:
        key = (row["path"], row.get("dtype"), row.get("callers"), row.get("message_mib"))
        by[key] = row
    floor = {row["path"]: row["gbps"] for row in rows if row["path"] in ("memcpy", "tcp_one_way",
                                                                          "tcp_both_ways")}
    lines = [f"# Transport on {machine}", "", f"`{command}`", "",
             f"memcpy {floor.get('memcpy', 0):.2f} GB/s; raw TCP loopback "
             f"{floor.get('tcp_one_way', 0):.2f} GB/s one way, "
             f"{floor.get('tcp_both_ways', 0):.2f} GB/s each way with both at once.", "",
             "| path | dtype | callers | seconds | GB/s each way | of its floor |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for row in rows:
        if "gbps" not in row or row.get("message_mib") or row["path"] in floor:
            if "error" in row:
                lines.append(f"| {row['path']} | {row['dtype']} | {row['callers']} | "
                             f"{row['error']} | | |")
            continue
        base = floor.get("memcpy" if "_shm" in row["path"] else "tcp_both_ways")
        share = f"{row['gbps'] / base:.2f}" if base else ""
        lines.append(f"| {row['path']} | {row['dtype']} | {row['callers']} | "
                     f"{row['seconds']:.3f} | {row['gbps']:.2f} | {share} |")
    lines += ["", "GB/s each way against the size of the chunk messages (float32, one caller):",
              "", "| MiB per message | C++, gRPC | C++, Compute socket | Python, gRPC | "
              "Python, Compute socket |", "| ---: | ---: | ---: | ---: | ---: |"]
    for mib in MESSAGE_MIB:
        cells = [by.get((path, "float32", 1, mib), {}).get("gbps") or 0
                 for path in ("cpp_messages", "cpp_socket", "python_messages", "python_socket")]
        lines.append(f"| {mib} | " + " | ".join(f"{cell:.2f}" for cell in cells) + " |")
    seconds = {row["path"]: row["seconds"] for row in rows if "shape" in row}
    lines.append("")
    for remote in ("cpp_messages", "cpp_socket", "python_messages", "python_socket", "cpp_shm",
                   "cpp_shm_rows_follow",
                   "cpp_shm_in_place", "python_shm", "python_shm_rows_follow",
                   "python_shm_shared_array"):
        row = by.get((remote, "float32", 1, None))
        if row and "engine_in_process" in seconds:
            lines.append(f"Remote over in-process (transport-bound, float32, one caller), "
                         f"{remote}: {row['seconds'] / seconds['engine_in_process']:.2f}")
    for remote in ("cpp_training_call", "python_training_call"):
        if remote in seconds and "engine_training_call" in seconds:
            lines.append(f"Remote over in-process at V, H, N = {TRAINING_SHAPE} "
                         f"({remote.split('_')[0]}): "
                         f"{seconds[remote] / seconds['engine_training_call']:.3f}")
    with open(os.path.join(out_dir, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axes = plt.subplots(figsize=(6, 4))
    for path, label in (("cpp_messages", "C++, gRPC"), ("cpp_socket", "C++, Compute socket"),
                        ("python_messages", "Python, gRPC"),
                        ("python_socket", "Python, Compute socket")):
        points = [(mib, by[(path, "float32", 1, mib)]["gbps"]) for mib in MESSAGE_MIB
                  if (path, "float32", 1, mib) in by]
        if points:
            axes.plot(*zip(*points), marker="o", label=label)
    for path, style in (("tcp_both_ways", "--"), ("memcpy", ":")):
        if path in floor:
            axes.axhline(floor[path], linestyle=style, color="gray", label=path.replace("_", " "))
    axes.set_xscale("log", base=2)
    axes.set_xlabel("MiB of rows per chunk message")
    axes.set_ylabel("GB/s each way")
    axes.set_title("lossd Compute transport, float32, one caller")
    axes.legend()
    figure.tight_layout()
    figure.savefig(os.path.join(out_dir, "gbps_vs_message_size.png"), dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-dir", default=os.path.join(peers.REPO, "build"))
    parser.add_argument("--tokens", type=int, default=peers.TRANSPORT_TOKENS)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--budget-mib", type=int, default=0)
    parser.add_argument("--memory-cap-gib", type=float, default=16.0)
    parser.add_argument("--out")
    parser.add_argument("--quick", action="store_true", help="4096 tokens")
    parser.add_argument("--floor-rounds", type=int, default=0,
                        help="only the TCP floor and both clients' socket calls, this many "
                             "rounds in turn")
    args = parser.parse_args()
    if args.quick:
        args.tokens = peers.QUICK_TRANSPORT_TOKENS
    args.build_dir = os.path.abspath(args.build_dir)
    sys.path.insert(0, os.path.join(args.build_dir, "python"))
    described = peers.describe_machine(args.threads)
    machine = "".join(c if c.isalnum() else "-" for c in described["cpu"].lower()).strip("-")
    date = datetime.date.today().isoformat()
    out_dir = args.out or os.path.join(peers.REPO, "bench", "results",
                                       f"{machine}-{args.threads}t-{date}-transport")
    os.makedirs(out_dir, exist_ok=True)
    rows = []

    def record(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(out_dir, "results.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    record(dict(path="machine", **described, date=date))
    where = f"{described['cpu']}, {args.threads} threads, {date}"
    command = "bench/transport_bench.py " + " ".join(sys.argv[1:])
    if args.floor_rounds:
        measure_against_floor(args, record)
        report_against_floor(out_dir, [row for row in rows if row["path"] != "machine"], where,
                             command)
    else:
        measure(args, record)
        report(out_dir, [row for row in rows if row["path"] != "machine"], where, command)
    print(f"wrote {out_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
