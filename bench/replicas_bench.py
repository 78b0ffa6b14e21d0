#!/usr/bin/env python3
"""Collective steps on a replica group of R lossd_server processes on this machine, against one
server (R = 1): the time of a step and the rate at which the replicas all-reduce the gradient.

    bench/replicas_bench.py [--replicas 1,2,3] [--vocab 32000] [--hidden 2048] [--steps 8]
                            [--rows 64] [--rounds 2] [--json FILE]

In each of --rounds rounds, for each R in turn (so that a shared machine's slow spells fall on
every R alike), it starts R servers with the same seeded demo head (V x H, float32; --replicas=R, TCP
over loopback), then, each step: one training call per replica (rows hidden states, dL/dW
accumulated), then every replica's rank calls GradWeightNorm and Step with AdamW, as
lossd.hf.Trainer does, all at once from threads. It reports, per R, medians over the steps of all rounds of:
the step (the Step call from its last rank's request to all answers), the norm (which carries the
all-reduce: the step takes the sum it kept), and from replica 0's metrics the all-reduce time and
its rate, the gradient's bytes (V x H x 4) over the all-reduce's seconds (algorithm bandwidth; a
ring moves 2 (R - 1) / R of that per replica). W is checked bitwise the same on every replica
after every step.

Needs the build (build/bin/lossd_server and the Python package in build/python, or PYTHONPATH)
and Debian's python3 with python3-grpcio and python3-numpy.
"""
import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "build", "python"))
import numpy as np  # noqa: E402

import lossd  # noqa: E402

SERVER_BIN = os.environ.get("LOSSD_SERVER_BIN", os.path.join(REPO, "build", "bin", "lossd_server"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replicas:
    """R lossd_server processes of one group (alone when R = 1), with metrics on replica 0."""

    def __init__(self, count, vocab, hidden):
        self.ports = [free_port() for _ in range(count)]
        self.metrics_port = free_port()
        self.logs = [tempfile.NamedTemporaryFile(prefix=f"replica{r}-", suffix=".log", delete=False)
                     for r in range(count)]
        self.processes = []
        for rank in range(count):
            flags = [f"--listen=127.0.0.1:{self.ports[rank]}", "--device=cpu",
                     f"--demo_vocab_size={vocab}", f"--demo_hidden_size={hidden}",
                     "--metrics_listen=" + (f"127.0.0.1:{self.metrics_port}" if rank == 0 else ""),
                     "--shared_memory=false", "--drain_seconds=2"]
            if count > 1:
                flags += [f"--replicas={count}", f"--replica_rank={rank}",
                          f"--replica_store=127.0.0.1:{self.ports[0]}"]
            self.processes.append(subprocess.Popen([SERVER_BIN, *flags], stdout=self.logs[rank],
                                                   stderr=subprocess.STDOUT))
        for rank in range(count):
            self._wait_serving(rank)

    def _wait_serving(self, rank, timeout=300):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self.logs[rank].name, encoding="utf-8", errors="replace") as f:
                text = f.read()
            if "serving gRPC" in text:
                return
            if self.processes[rank].poll() is not None:
                raise RuntimeError(f"replica {rank} exited:\n{text}")
            time.sleep(0.1)
        raise TimeoutError(f"replica {rank} did not start")

    def metric(self, name):
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                      timeout=30).read().decode()
        found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    def close(self):
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
        for log in self.logs:
            os.unlink(log.name)


def on_every_replica(clients, call):
    """call(rank, client) on a thread per replica, started together: (seconds from the start to
    the last answer, the answers)."""
    answers = [None] * len(clients)
    start = threading.Barrier(len(clients) + 1)

    def run(rank):
        start.wait()
        answers[rank] = call(rank, clients[rank])

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(clients))]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return time.perf_counter() - began, answers


def bench(count, vocab, hidden, steps, rows):
    """One round at R = count: per step, (step seconds, norm seconds, all-reduce seconds)."""
    replicas = Replicas(count, vocab, hidden)
    try:
        clients = [lossd.Client(f"127.0.0.1:{port}", timeout=600) for port in replicas.ports]
        replicated = count > 1
        rng = np.random.default_rng(0)
        samples = []
        for _ in range(steps):
            version = clients[0].get_head("demo").version
            for client in clients:
                hidden_rows = rng.standard_normal((rows, hidden), dtype=np.float32)
                labels = rng.integers(0, vocab, rows)
                client.compute("demo", hidden_rows, labels, accumulate_grad_weight=True)
            reduced_before = replicas.metric("lossd_replica_allreduce_seconds_sum")
            norm_seconds, _ = on_every_replica(clients, lambda rank, client, version=version: client.grad_weight_norm(
                "demo", head_version=version, replicated=replicated))
            allreduce_seconds = replicas.metric("lossd_replica_allreduce_seconds_sum") - reduced_before
            step_seconds, answers = on_every_replica(clients, lambda rank, client, version=version: client.step(
                "demo", "adamw", lr=1e-4, max_grad_norm=1.0, head_version=version,
                replicated=replicated))
            assert len({answer.head_version for answer in answers}) == 1
            digests = {client.get_head("demo").weight_sha256 for client in clients}
            assert len(digests) == 1, f"the replicas' W differ after a step: {digests}"
            samples.append((step_seconds, norm_seconds, allreduce_seconds))
        return samples
    finally:
        replicas.close()


def summary(count, vocab, hidden, rows, samples):
    gradient_bytes = vocab * hidden * 4
    replicated = count > 1
    allreduce = statistics.median(s[2] for s in samples) if replicated else None
    return {
        "replicas": count, "vocab": vocab, "hidden": hidden, "rows": rows, "steps": len(samples),
        "gradient_bytes": gradient_bytes,
        "step_s": statistics.median(s[0] for s in samples),
        "norm_s": statistics.median(s[1] for s in samples),
        "allreduce_s": allreduce,
        "allreduce_gb_s": gradient_bytes / allreduce / 1e9 if allreduce else None,
        "bus_gb_s": (gradient_bytes * 2 * (count - 1) / count / allreduce / 1e9
                     if allreduce else None),
        "samples": samples,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="1,2,3")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8, help="steps per round")
    parser.add_argument("--rows", type=int, default=64, help="rows of each training call")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="append one JSON line per R to this file")
    args = parser.parse_args()
    counts = [int(count) for count in args.replicas.split(",")]
    samples = {count: [] for count in counts}
    for _ in range(args.rounds):
        for count in counts:
            samples[count] += bench(count, args.vocab, args.hidden, args.steps, args.rows)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    print("| R | V x H | gradient MiB | step s | norm s (with the all-reduce) | all-reduce s | "
          "all-reduce GB/s | bus GB/s |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for count in counts:
        result = summary(count, args.vocab, args.hidden, args.rows, samples[count])
        if args.json:
            with open(args.json, "a", encoding="utf-8") as f:
                f.write(json.dumps(result) + "\n")

        def show(value, digits=3):
            return "-" if value is None else f"{value:.{digits}f}"

        print(f"| {count} | {args.vocab} x {args.hidden} | {result['gradient_bytes'] / 2**20:.0f} "
              f"| {show(result['step_s'])} | {show(result['norm_s'])} "
              f"| {show(result['allreduce_s'])} | {show(result['allreduce_gb_s'], 2)} "
              f"| {show(result['bus_gb_s'], 2)} |", flush=True)


if __name__ == "__main__":
    main()
