#!/usr/bin/env python3
"""The lossd service on one machine: lossd_server on --device, called over loopback by the C++
client (lossctl bench) and the Python client (lossd.Client.compute), with the rows and dL/dh in
messages (over gRPC and over the server's Compute socket) and in shared memory, next to the engine
in-process (engine_bench) on the same shape, dtype and workspace budget.

Every call is a training call: N rows of hidden states in --dtype, dL/dh returned in the same
dtype, dL/dW accumulated on the server. For each way of calling: the median seconds per call, that
over the engine's in-process median, and the tensors' GB/s each way (rows in, dL/dh out, however
they travelled). The engine's in-process time moves the rows between host and device as the
server does, but no bytes between processes; it returns dL/dh in fp32 (engine_bench's), where the
calls get it in --dtype, so with bf16 it copies twice the dL/dh bytes back from the device.

Writes results.jsonl, results.md and the server's log to --out. scripts/gpu_round.sh call2 runs
it on the GPU machine; `--device cpu` with a small --shape runs the same code anywhere, for
testing. The Python client needs grpcio and protobuf: when lossd cannot be imported from
--python-path, its rows say why and the rest still runs.
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

SERVER_START_SECONDS = 300  # a random demo head of 128256 x 4096 takes a while to make
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


def parse_shape(text):
    parts = text.split(",")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"--shape: expected a positive N,H,V triple, got '{text}'")
    return tuple(int(p) for p in parts)


class Server:
    """lossd_server with a demo head of the benchmark's shape, on a port of its choosing."""

    def __init__(self, args, n, h, v):
        self.log_path = os.path.join(args.out, "server.log")
        self.log = open(self.log_path, "w")
        argv = [args.server, "--listen=127.0.0.1:0", "--metrics_listen=", f"--device={args.device}",
                f"--head_dtype={args.dtype}", f"--demo_vocab_size={v}", f"--demo_hidden_size={h}",
                f"--workspace_budget_mib={args.budget_mib}", "--max_running_calls=1",
                "--compute_socket_listen=127.0.0.1:0"]
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        self.port = None
        deadline = time.monotonic() + SERVER_START_SECONDS
        while self.port is None:
            with open(self.log_path) as log:
                found = re.search(r"serving gRPC on \S+ \(port (\d+)\)", log.read())
            if found:
                self.port = int(found.group(1))
            elif self.process.poll() is not None:
                raise RuntimeError(f"lossd_server exited with status {self.process.returncode} "
                                   f"before serving: {self.tail()}")
            elif time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"lossd_server did not serve within {SERVER_START_SECONDS} s")
            else:
                time.sleep(0.2)
        self.address = f"127.0.0.1:{self.port}"

    def tail(self, lines=5):
        with open(self.log_path) as log:
            return " | ".join(log.read().strip().splitlines()[-lines:])

    def stop(self):
        """SIGTERM, then the exit status (0 after a clean drain)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        return self.process.returncode


def engine_in_process(args, n, h, v):
    dtype = {"bfloat16": "bf16", "float32": "fp32"}[args.dtype]
    argv = [args.engine_bench, f"--device={args.device}", f"--dtype={dtype}", "--methods=engine",
            "--passes=fwd_bwd", f"--shapes={n},{h},{v}", f"--budget-mib={args.budget_mib}",
            f"--reps={args.calls}", "--rep-seconds=600", "--warmup-tokens=0"]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"error": f"failed: {last}"}
    row = json.loads(done.stdout.strip().splitlines()[-1])
    return {"seconds": row["seconds"], "calls": row["reps"], "backend": row["machine"]["device"]}


# How a call's rows and dL/dh travel: (the table's name, shared memory, the Compute socket).
TRANSPORTS = (("gRPC messages", False, False), ("socket messages", False, True),
              ("shared memory", True, False))


def lossctl_bench(args, server, n, shared_memory, compute_socket):
    argv = [args.lossctl, f"--server={server.address}",
            f"--compute_socket={'true' if compute_socket else 'false'}", "bench", "--head=demo",
            f"--tokens={n}",
            f"--dtype={args.dtype}", "--grad", "--accumulate", f"--warmup={args.warmup}",
            f"--calls={args.calls}", "--json"]
    if shared_memory:
        argv.append("--shared_memory")
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"error": f"failed: {last}"}
    row = json.loads(done.stdout.strip().splitlines()[-1])
    # One stream: calls follow one another, so the median latency is the time per call.
    return {"seconds": row["latency_p50"], "calls": row["calls"],
            "hidden_bytes_per_call": row["hidden_bytes"] // row["calls"],
            "grad_hidden_bytes_per_call": row["grad_hidden_bytes"] // row["calls"],
            "server_compute_seconds": row["server_compute_seconds"] / row["calls"]}


def python_client(args, server, n, h, v, shared_memory, compute_socket):
    """The Python client's calls, in a process of its own whose PYTHONPATH holds lossd."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [args.python_path, os.environ.get("PYTHONPATH")])))
    argv = [sys.executable, os.path.abspath(__file__), "--python-worker", f"--shape={n},{h},{v}",
            f"--dtype={args.dtype}", f"--calls={args.calls}", f"--warmup={args.warmup}",
            f"--address={server.address}", f"--out={args.out}"]
    if shared_memory:
        argv.append("--shared-memory")
    if compute_socket:
        argv.append("--compute-socket")
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"error": f"failed: {last}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def python_worker(args):
    """Runs in the Python client's process: one JSON line on stdout."""
    n, h, v = parse_shape(args.shape)
    try:
        import numpy as np
        import lossd
    except ImportError as error:
        print(json.dumps({"error": f"skipped: the Python client cannot be imported ({error})"}))
        return
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((n, h), dtype=np.float32)
    if args.dtype == "bfloat16":
        hidden = lossd.float32_to_bfloat16_bits(hidden)
    labels = rng.integers(0, v, n)
    with lossd.Client(args.address) as client:
        def call():
            begin = time.perf_counter()
            result = client.compute("demo", hidden, labels, outputs=["grad_hidden"],
                                    accumulate_grad_weight=True, shared_memory=args.shared_memory,
                                    compute_socket=args.compute_socket)
            return time.perf_counter() - begin, result

        for _ in range(args.warmup):
            call()
        timed = [call() for _ in range(args.calls)]
    seconds = [s for s, _ in timed]
    print(json.dumps({
        "seconds": statistics.median(seconds), "calls": len(seconds),
        "hidden_bytes_per_call": hidden.nbytes,
        "grad_hidden_bytes_per_call": timed[-1][1].grad_hidden.nbytes,
        "travelled": timed[-1][1].transport,
        "server_compute_seconds": statistics.median(r.compute_seconds for _, r in timed)}))


def markdown(args, shape, engine, rows, server_exit):
    n, h, v = shape
    lines = [f"Service at N, H, V = {n}, {h}, {v} in {args.dtype} on {args.device} "
             f"({engine.get('backend', 'engine unavailable')}), workspace budget "
             f"{args.budget_mib} MiB, one stream, {args.calls} timed calls after {args.warmup}; "
             f"the server exited with status {server_exit} after SIGTERM. The engine in-process "
             "returns dL/dh in fp32, the calls in their rows' dtype.",
             "",
             "| client | transport | s per call | x in-process | rows in GB/s | dL/dh out GB/s "
             "| server compute s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    if "seconds" in engine:
        lines.append(f"| engine in-process | none | {engine['seconds']:.4f} | 1.00 | | | |")
    else:
        lines.append(f"| engine in-process | none | {engine['error']} | | | | |")
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['client']} | {row['transport']} | {row['error']} | | | | |")
            continue
        ratio = f"{row['ratio_to_in_process']:.2f}" if "ratio_to_in_process" in row else "-"
        lines.append(f"| {row['client']} | {row['transport']} | {row['seconds']:.4f} | {ratio} | "
                     f"{row['rows_gbps']:.2f} | {row['grad_hidden_gbps']:.2f} | "
                     f"{row['server_compute_seconds']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="16384,4096,128256", help="N,H,V (Llama 3 8B's head)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    parser.add_argument("--budget-mib", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--server", help="lossd_server")
    parser.add_argument("--lossctl", help="lossctl")
    parser.add_argument("--engine-bench", help="engine_bench")
    parser.add_argument("--python-path", default="",
                        help="where `import lossd` (and grpc, if the machine lacks it) is found")
    parser.add_argument("--out", required=True, help="folder for the results and the server's log")
    parser.add_argument("--python-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--shared-memory", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compute-socket", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.python_worker:
        python_worker(args)
        return
    shape = parse_shape(args.shape)
    if args.calls < 1 or args.warmup < 0 or args.budget_mib < 1:
        raise SystemExit("--calls and --budget-mib: expected >= 1; --warmup: >= 0")
    missing = [flag for flag in ("server", "lossctl", "engine_bench") if not getattr(args, flag)]
    if missing:
        raise SystemExit(f"--{missing[0].replace('_', '-')}: expected the program's path")
    os.makedirs(args.out, exist_ok=True)
    n, h, v = shape

    # The engine first, alone on the device; then the server, which holds its own head.
    print("gpu_service: engine in-process", file=sys.stderr, flush=True)
    engine = engine_in_process(args, n, h, v)
    print("gpu_service: starting lossd_server", file=sys.stderr, flush=True)
    server = Server(args, n, h, v)
    rows = []
    try:
        for client in ("lossctl", "python"):
            for transport, shared_memory, compute_socket in TRANSPORTS:
                print(f"gpu_service: {client} over {transport}", file=sys.stderr, flush=True)
                if client == "lossctl":
                    row = lossctl_bench(args, server, n, shared_memory, compute_socket)
                else:
                    row = python_client(args, server, n, h, v, shared_memory, compute_socket)
                row.update(client=client, transport=transport)
                if "seconds" in row:
                    row["rows_gbps"] = row["hidden_bytes_per_call"] / row["seconds"] / 1e9
                    row["grad_hidden_gbps"] = row["grad_hidden_bytes_per_call"] / row["seconds"] / 1e9
                    if "seconds" in engine:
                        row["ratio_to_in_process"] = row["seconds"] / engine["seconds"]
                rows.append(row)
    finally:
        server_exit = server.stop()
    with open(os.path.join(args.out, "results.jsonl"), "w") as jsonl:
        common = {"n": n, "h": h, "v": v, "dtype": args.dtype, "device": args.device,
                  "budget_mib": args.budget_mib}
        jsonl.write(json.dumps(dict(common, client="engine in-process", **engine)) + "\n")
        for row in rows:
            jsonl.write(json.dumps(dict(common, **row)) + "\n")
        jsonl.write(json.dumps(dict(common, server_exit_status=server_exit)) + "\n")
    report = markdown(args, shape, engine, rows, server_exit)
    with open(os.path.join(args.out, "results.md"), "w") as md:
        md.write(report)
    sys.stdout.write(report)


if __name__ == "__main__":
    main()
