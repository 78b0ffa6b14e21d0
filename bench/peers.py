#!/usr/bin/env python3
"""lossd against what its users would otherwise run, side by side on this machine.

Methods, each measured in a process of its own (so that its peak resident memory is its own), all
doing a forward and backward pass of fp32 cross-entropy over hidden [N, H] and W [V, H] (loss,
dL/dh and dL/dW). The torch methods run the torch that users install from the package registry
(bench/peers.sh runs this script in a virtual environment that holds it):
  torch_naive    F.cross_entropy(hidden @ W.T, labels), backward: where training scripts start.
  torch_chunked  the usual hand-written fix: token chunks of F.linear + F.cross_entropy, each
                 chunk's backward run before the next (W.grad accumulates), as many rows per chunk
                 as lossd's workspace budget gives the engine.
  torch_compiled the same loop with each chunk's loss a torch.compile'd function (compiled in the
                 untimed warm-up).
  torch_native   torch's own F.linear_cross_entropy with its chunked path
                 (options=torch.nn.LinearCrossEntropyOptions(), chunking chosen by torch).
  torch_floor    the three products alone (logits, dL/dh, dL/dW), 6NHV flops, on torch's BLAS.
  engine         the lossd engine in-process (bench/engine_bench --methods engine).
  floor          the three products alone on lossd's BLAS, OpenBLAS (engine_bench --methods floor).
  remote_cpp     a Compute call to lossd_server over loopback gRPC from the C++ client (lossctl
                 bench), dL/dh returned and dL/dW accumulated on the server; the server is a
                 process of its own, its peak memory reported separately.
  remote_python  the same call from the Python client (lossd.Client.compute).
Every process gets the same thread count (OMP_NUM_THREADS, torch.set_num_threads) and a cap on
its data segment (--memory-cap-gib: heap and anonymous mappings, what a method allocates; the
address space that current torch's libraries map without touching does not count): a method that
cannot fit is recorded as out of memory.

Transport: Compute calls on a 16-row head, where compute is small, give the wire throughput
(hidden rows in, dL/dh out; fp32 and bf16; one stream and the batch split over several), with the
rows in gRPC messages and in shared memory (lossctl bench --shared_memory: a memfd the server
maps), next to the engine alone on the same rows in-process (fp32, dL/dh without dL/dW as the
calls ask; no transfer at all, the bound of any transport), the ceiling gRPC itself reaches here
(grpc_echo: bench/grpc_echo_bench echoing the same bytes each way, in messages of the client's
4 MiB, over as many concurrent calls, between two processes over loopback, nothing else done) and
this machine's single-thread memcpy bandwidth. Remote/in-process
ratios are measured two ways: rows streamed in messages of about 4 MiB, each token chunk computed
as soon as its rows are in, and the whole batch sent as one message, so that the server computes
nothing before all of it arrived (C++ client only, to keep the run under 20 minutes on 2 cores).

Writes bench/results/<machine>-<date>/ (or --out): results.jsonl (one object per measurement),
results.md (tables, then each target judged met or not from the run's own figures) and the plots
time_vs_n.png, memory_vs_n.png, shape_bars.png (every method at one shape) and transport.png. Run
it through bench/peers.sh, which makes its virtual environment, installs what it needs and builds
the binaries first; --report DIR writes DIR's results.md and plots anew from its results.jsonl.
"""
import argparse
import datetime
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1 << 30
MIB = 1 << 20

# (V, H, N values): sweeps over N at H=2048 for Llama 2's and Llama 3's vocabularies, and Qwen 2's
# head shape (V=152064, H=2048, N=2048 on a GPU) scaled to 512 tokens for 2 CPU cores.
# The largest N of each sweep is the first at which torch naive no longer fits under the cap.
FULL_SHAPES = [(32000, 2048, [1024, 2048, 16384]),
               (128256, 2048, [512, 1024, 4096]),
               (152064, 2048, [512])]
QUICK_SHAPES = [(32000, 1024, [256, 1024]), (128256, 1024, [256])]
TRANSPORT_TOKENS, QUICK_TRANSPORT_TOKENS = 16384, 4096
TRANSPORT_HIDDEN = 2048
TRANSPORT_VOCAB = 16
TRANSPORT_STREAMS = [1, 4]
# Engine seconds per shape that the paired rounds of engine and remote runs may take by default
# (--round-seconds; see rounds_for): 3 rounds below 4.3 s, 2 below 6.5 s.
ROUND_SECONDS = 13.0
# Every method's process runs this many tokens through its own path, untimed, before its timed
# run (engine_bench's warm-up likewise): a call right after an idle spell runs up to 10% slower
# on this machine, which would otherwise fall on whichever method skipped its warm-up.
WARM_UP_TOKENS = 64
TRANSPORT_MESSAGE_BYTES = 4 * MIB  # what the lossd client puts in a chunk message
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
OUT_OF_MEMORY = "out of memory"


# --------------------------------------------------------------------------------------------
# Workers: one method in this process, one JSON object on stdout.

def synthetic_problem(n, h, v, seed=0):
    """Hidden states and labels like engine_bench's: N(0, 1) rows and logits of std ~3."""
    import torch
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * (3.0 / h ** 0.5)
    labels = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, labels


TORCH_METHODS = ("torch_naive", "torch_chunked", "torch_compiled", "torch_native", "torch_floor")
# What the engine is judged against: every way torch computes the loss and its gradients.
TORCH_PEERS = TORCH_METHODS[:-1]
# Rows per block of the floors: the whole batch when its logits fit 1 GiB (engine_bench's
# kFloorBlockBytes and FloorBlockRows, so that both floors run the same products).
FLOOR_BLOCK_BYTES = 1 << 30


def floor_block_rows(n, v):
    fitting = max(1, FLOOR_BLOCK_BYTES // (v * 4))
    return n if fitting >= n else max(fitting // 64 * 64, min(fitting, 64))


def chunk_loss(rows, weight, labels):
    """One chunk's summed cross-entropy: what torch_chunked runs eagerly and torch_compiled
    compiles."""
    import torch.nn.functional as F
    return F.cross_entropy(F.linear(rows, weight), labels, reduction="sum")


class TorchMethod:
    """One forward+backward over all of hidden (a leaf) by `method`: __call__ returns the loss and
    dL/dh, with W.grad holding dL/dW (the floor: its products' outputs, no loss)."""

    def __init__(self, method, n, v, chunk_rows):
        import torch
        import torch.nn.functional as F
        self.method, self.chunk_rows = method, chunk_rows
        self.chunk_loss = chunk_loss
        if method == "torch_compiled":
            self.chunk_loss = torch.compile(chunk_loss)
        if method == "torch_native":
            if not hasattr(F, "linear_cross_entropy") or not hasattr(torch.nn,
                                                                     "LinearCrossEntropyOptions"):
                raise NotAvailable(f"torch {torch.__version__} has no F.linear_cross_entropy "
                                   "with LinearCrossEntropyOptions")
            self.options = torch.nn.LinearCrossEntropyOptions()
        if method == "torch_floor":
            self.block_rows = floor_block_rows(n, v)

    def __call__(self, hidden, weight, labels):
        import torch
        import torch.nn.functional as F
        weight.grad = None
        n = hidden.shape[0]
        if self.method == "torch_floor":
            return self.floor(hidden, weight)
        if self.method in ("torch_naive", "torch_native"):
            hidden = hidden.detach().requires_grad_()
            if self.method == "torch_naive":
                loss = F.cross_entropy(hidden @ weight.T, labels)
            else:
                loss = F.linear_cross_entropy(hidden, weight, labels, options=self.options)
            loss.backward()
            return float(loss), hidden.grad
        total = 0.0
        grad_hidden = torch.empty_like(hidden)
        for r0 in range(0, n, self.chunk_rows):
            rows = hidden[r0:r0 + self.chunk_rows].detach().requires_grad_()
            loss = self.chunk_loss(rows, weight, labels[r0:r0 + self.chunk_rows]) / n
            loss.backward()
            grad_hidden[r0:r0 + self.chunk_rows] = rows.grad
            total += float(loss)
        return total, grad_hidden

    def floor(self, hidden, weight):
        """logits = h W^T, dL/dh = logits W, dL/dW += logits^T h, block by block; the logits
        stand in for dL/dz (the same shapes, no elementwise work)."""
        import torch
        n, v = hidden.shape[0], weight.shape[0]
        with torch.no_grad():
            logits = torch.empty(min(n, self.block_rows), v)
            grad_hidden = torch.empty_like(hidden)
            grad_weight = torch.zeros_like(weight)
            for r0 in range(0, n, self.block_rows):
                rows = hidden[r0:r0 + self.block_rows]
                block = logits[:rows.shape[0]]
                torch.mm(rows, weight.T, out=block)
                torch.mm(block, weight, out=grad_hidden[r0:r0 + rows.shape[0]])
                grad_weight.addmm_(block.T, rows)
        weight.grad = grad_weight
        return 0.0, grad_hidden


class NotAvailable(Exception):
    """The method does not exist in this torch."""


def median_seconds(call, reps):
    """Median wall time of `reps` calls of call(); returns it and the last call's result."""
    times, result = [], None
    for _ in range(reps):
        start = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def resident_bytes():
    """This process's resident set now: a torch process holds its libraries before any tensor."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def run_worker(args):
    n, h, v = args.shape
    warm_up_rows = min(n, WARM_UP_TOKENS)
    try:
        if args.worker in TORCH_METHODS:
            import torch
            torch.set_num_threads(args.threads)
            start_rss = resident_bytes()
            hidden, weight, labels = synthetic_problem(n, h, v)
            weight.requires_grad_()
            method = TorchMethod(args.worker, n, v, args.chunk_rows)
            # Compiles torch_compiled's chunk (for a short first chunk and, recompiling, a full
            # one), so that the timed runs see compiled code only.
            method(hidden[:warm_up_rows], weight, labels[:warm_up_rows])
            if args.worker == "torch_compiled" and n > warm_up_rows:
                method(hidden[:min(n, args.chunk_rows)], weight, labels[:min(n, args.chunk_rows)])
            seconds, (loss, _) = median_seconds(lambda: method(hidden, weight, labels), args.reps)
            result = {"seconds": seconds, "loss": loss, "torch": torch.__version__,
                      "start_rss_bytes": start_rss}
        elif args.worker == "remote_python":
            import numpy as np
            from lossd import Client
            rng = np.random.default_rng(0)
            hidden = rng.standard_normal((n, h), dtype=np.float32)
            labels = rng.integers(0, v, n)
            with Client(args.address) as client:
                def call(rows):
                    return client.compute("demo", hidden[:rows], labels[:rows],
                                          outputs=["grad_hidden"], accumulate_grad_weight=True)
                call(warm_up_rows)
                seconds, summary = median_seconds(lambda: call(n), args.reps)
            result = {"seconds": seconds, "loss": summary.loss,
                      "server_compute_seconds": summary.compute_seconds}
        else:
            raise ValueError(f"unknown worker {args.worker}")
    except NotAvailable as error:
        result = {"error": f"not available: {error}"}
    except MemoryError as error:
        result = {"error": OUT_OF_MEMORY, "detail": str(error)[:200]}
    except RuntimeError as error:  # torch's allocator failing under the cap
        if "alloc" not in str(error):
            raise
        result = {"error": OUT_OF_MEMORY, "detail": str(error).splitlines()[0][:200]}
    print(json.dumps(result), flush=True)


# --------------------------------------------------------------------------------------------
# The driver.

class Runner:
    def __init__(self, args):
        self.args = args
        self.bin = os.path.join(args.build_dir, "bin")
        self.env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
                        OPENBLAS_NUM_THREADS=str(args.threads),
                        PYTHONPATH=os.pathsep.join(filter(None, [
                            os.path.join(args.build_dir, "python"),
                            os.environ.get("PYTHONPATH")])))
        self.cap_bytes = int(args.memory_cap_gib * GIB)

    def limit_memory(self):
        resource.setrlimit(resource.RLIMIT_DATA, (self.cap_bytes, self.cap_bytes))

    def launch(self, argv):
        """Runs argv under the cap; returns (exit code, stdout, stderr, peak RSS bytes)."""
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            process = subprocess.Popen(argv, stdout=out, stderr=err, env=self.env,
                                       preexec_fn=self.limit_memory)
            _, status, usage = os.wait4(process.pid, 0)
            process.returncode = os.waitstatus_to_exitcode(status)
            out.seek(0)
            err.seek(0)
            return (process.returncode, out.read().decode(), err.read().decode(),
                    usage.ru_maxrss * 1024)

    def worker(self, method, n, h, v, chunk_rows=0, address=""):
        argv = [sys.executable, os.path.abspath(__file__), "--worker", method,
                "--shape", str(n), str(h), str(v), "--threads", str(self.args.threads),
                "--reps", str(self.args.reps), "--chunk-rows", str(chunk_rows or n),
                "--address", address]
        code, out, err, rss = self.launch(argv)
        if code != 0:
            return {"error": failure(err, code)}, rss
        return json.loads(out.strip().splitlines()[-1]), rss

    def engine_bench(self, method, n, h, v, passes="fwd_bwd"):
        argv = [os.path.join(self.bin, "engine_bench"), "--methods", method, "--passes", passes,
                "--shapes", f"{n},{h},{v}", "--reps", str(self.args.reps)]
        if self.args.budget_mib:
            argv += ["--budget-mib", str(self.args.budget_mib)]
        code, out, err, rss = self.launch(argv)
        if code != 0:
            return {"error": failure(err, code)}, rss
        row = json.loads(out.strip().splitlines()[-1])
        return {"seconds": row["seconds"], "chunk": row.get("chunk")}, rss

    def lossctl_bench(self, address, head, tokens, streams=1, dtype="float32", accumulate=True,
                      warmup=1, warmup_tokens=WARM_UP_TOKENS, rows_per_message=0,
                      shared_memory=False, in_place=False, shared_rows_per_piece=0,
                      compute_socket=False, lend_grad_hidden=False):
        """One batch of `tokens` rows, split over `streams` concurrent calls, after `warmup` calls
        of `warmup_tokens` rows (0: the whole batch); over the server's Compute socket when
        compute_socket, else over gRPC. dL/dh goes into a buffer of each stream's, or with
        lend_grad_hidden is lent by the client (ComputeRequest::lend_grad_hidden)."""
        argv = [os.path.join(self.bin, "lossctl"), f"--server={address}",
                f"--compute_socket={'true' if compute_socket else 'false'}", "bench",
                f"--head={head}", f"--tokens={tokens // streams}", f"--calls={streams}",
                f"--streams={streams}", f"--warmup={warmup}",
                f"--warmup_tokens={min(warmup_tokens, tokens // streams)}", f"--dtype={dtype}", "--grad",
                f"--rows_per_message={rows_per_message}", "--json"]
        if accumulate:
            argv.append("--accumulate")
        if shared_memory:
            argv.append("--shared_memory")
        if in_place:
            argv.append("--in_place")
        if lend_grad_hidden:
            argv.append("--lend_grad_hidden")
        if shared_rows_per_piece:
            argv.append(f"--shared_rows_per_piece={shared_rows_per_piece}")
        code, out, err, rss = self.launch(argv)
        if code != 0:
            return {"error": failure(err, code)}, rss
        return json.loads(out.strip().splitlines()[-1]), rss

    def grpc_echo_bench(self, bytes_each_way, streams, copies="protobuf", connections=1):
        """gRPC's own echo of `bytes_each_way` over `streams` concurrent calls (median of 3), its
        messages through protobuf or (copies="one") as raw bytes copied once each way on each side,
        as lossd's Compute moves them; the calls on one connection or spread over `connections`."""
        binary = os.path.join(self.bin, "grpc_echo_bench")
        if not os.path.exists(binary):
            return {"error": f"{binary} not built"}, None
        argv = [binary, f"--bytes={bytes_each_way}", f"--streams={streams}",
                f"--message_bytes={TRANSPORT_MESSAGE_BYTES}", f"--copies={copies}",
                f"--connections={connections}", "--json"]
        code, out, err, rss = self.launch(argv)
        if code != 0:
            return {"error": failure(err, code)}, rss
        return json.loads(out.strip().splitlines()[-1]), rss


def parse_shapes(text):
    """'V,H,N;V,H,N;...' as [(V, H, [N, ...])], the Ns of one (V, H) together and in order."""
    groups = {}
    for item in filter(None, text.split(";")):
        parts = item.split(",")
        if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(
                f"expected positive V,H,N triples separated by ';', got '{item}'")
        v, h, n = (int(p) for p in parts)
        groups.setdefault((v, h), []).append(n)
    if not groups:
        raise argparse.ArgumentTypeError("expected at least one V,H,N")
    return [(v, h, ns) for (v, h), ns in groups.items()]


def failure(stderr, code):
    text = stderr.strip().splitlines()
    if code in (-6, -9) or any(word in stderr for word in ("bad_alloc", "RESOURCE_EXHAUSTED",
                                                           "Cannot allocate", "can't allocate")):
        return OUT_OF_MEMORY
    return f"exit {code}: {text[-1] if text else ''}"[:300]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """lossd_server with the demo head [V, H] (and a [16, H] head for transport), CPU backend.
    One serves every N of a vocabulary's sweep: drawing a [128256, 2048] head takes it about 10 s
    to start."""

    def __init__(self, runner, v, h, compute_socket=False):
        self.runner = runner
        self.hidden_size = h
        self.warm_rows = None
        self.address = f"127.0.0.1:{free_port()}"
        self.log = tempfile.NamedTemporaryFile(prefix="lossd-bench-", suffix=".log")
        argv = [os.path.join(runner.bin, "lossd_server"), f"--listen={self.address}",
                "--metrics_listen=", "--device=cpu", f"--demo_vocab_size={v}",
                f"--demo_hidden_size={h}", f"--workspace_budget_mib={runner.args.budget_mib}"]
        if compute_socket:
            argv.append("--compute_socket_listen=127.0.0.1:0")
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                        env=runner.env, preexec_fn=runner.limit_memory)
        import numpy as np
        from lossd import Client, LossdError
        with Client(self.address) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    client.list_heads()
                    break
                except LossdError:  # not listening yet
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        self.log.seek(0)
                        raise RuntimeError("lossd_server did not start:\n" +
                                           self.log.read().decode()) from None
                    time.sleep(0.2)
            client.upload_head("wire", np.zeros((TRANSPORT_VOCAB, h), np.float32))

    def warm(self, rows):
        """Threads started, and the call buffers the measured calls reuse (a workspace for one
        engine chunk of `rows`, the staging dL/dW) allocated, as in a training loop's steady
        state; the in-process engine is likewise timed after a warm-up run. Once per chunk size:
        the server keeps those buffers between calls."""
        if rows == self.warm_rows:
            return
        self.warm_rows = rows
        import numpy as np
        from lossd import Client
        with Client(self.address) as client:
            client.compute("demo", np.zeros((rows, self.hidden_size), np.float32),
                           np.zeros(rows, np.int64), outputs=["grad_hidden"],
                           accumulate_grad_weight=True)

    def peak_rss(self):
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return None

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=60)
        self.log.close()


def memcpy_gbps():
    """Single-thread copy bandwidth: bytes read per second copying 256 MiB."""
    import numpy as np
    src = np.ones(256 * MIB // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = min(timed(lambda: np.copyto(dst, src)) for _ in range(5))
    return src.nbytes / best / 1e9


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def describe_machine(threads):
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    with open("/proc/meminfo") as f:
        mem_kib = int(f.readline().split()[1])
    torch_version = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                                   capture_output=True, text=True).stdout.strip()
    return {"hostname": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(),
            "threads": threads, "memory_gib": round(mem_kib / (1 << 20), 1), "torch": torch_version,
            "python": platform.python_version()}


def rounds_for(engine_seconds, max_rounds, round_seconds):
    """Paired rounds at a shape: as many as fit in round_seconds of engine time, 1 to max_rounds.
    Single runs on this shared machine move by 5 to 15%, most on short shapes."""
    return max(1, min(max_rounds, int(round_seconds / engine_seconds)))


def bench_shape(runner, server, v, h, n, record):
    """Every method at one shape, the remote ones through `server` (serving [v, h]).

    The engine and the two remote clients run in rounds, one of each in turn (each round starting
    with the next), so that each remote/in-process ratio compares runs a few seconds apart; the
    medians over rounds are reported. The other methods run once."""
    engine_runs = [runner.engine_bench("engine", n, h, v)]
    engine_s = engine_runs[0][0].get("seconds")
    # The chunked torch peer takes as many rows per chunk as the engine's budget gives it.
    chunk_rows = (engine_runs[0][0].get("chunk") or {}).get("tokens") or n
    server.warm(min(n, chunk_rows))
    remote = {"remote_cpp": lambda: runner.lossctl_bench(server.address, "demo", n),
              "remote_python": lambda: runner.worker("remote_python", n, h, v,
                                                     address=server.address)}
    remote_runs = {method: [run()] for method, run in remote.items()}
    rows = {"floor": runner.engine_bench("floor", n, h, v)}
    for method in TORCH_METHODS:
        rows[method] = runner.worker(method, n, h, v, chunk_rows=chunk_rows)
    whole, _ = runner.lossctl_bench(server.address, "demo", n, rows_per_message=n)
    rounds = rounds_for(engine_s, runner.args.rounds, runner.args.round_seconds) if engine_s else 1
    # Each later round starts with the next of the three, so that no method always runs right
    # after the same neighbour: in a fixed order the C++ client, always right after the engine's
    # process, came out 2 to 7% slower than the Python client at most shapes of a run.
    in_turn = [("engine", lambda: runner.engine_bench("engine", n, h, v))] + list(remote.items())
    for round_index in range(1, rounds):
        for i in range(len(in_turn)):
            method, run = in_turn[(i + round_index) % len(in_turn)]
            (engine_runs if method == "engine" else remote_runs[method]).append(run())
    rows["engine"] = median_run(engine_runs)
    rows.update({method: median_run(runs) for method, runs in remote_runs.items()})
    server_rss = server.peak_rss()  # so far: the server's memory is flat in N
    # What every method must hold: hidden and dL/dh [N, H], W and dL/dW [V, H], fp32.
    tensors = 4 * (2 * n * h + 2 * v * h)
    base = {"v": v, "h": h, "n": n, "flops": 6.0 * n * h * v, "tensor_bytes": tensors}
    engine_s = rows["engine"][0].get("seconds")
    for method, (result, rss) in rows.items():
        entry = dict(base, method=method, peak_rss_bytes=rss)
        entry.update({k: result[k] for k in ("seconds", "error", "chunk", "rounds",
                                             "start_rss_bytes") if k in result})
        if method in ("torch_chunked", "torch_compiled"):
            entry["chunk_rows"] = chunk_rows
        if method.startswith("remote_"):
            entry["server_peak_rss_bytes"] = server_rss
            if "server_compute_seconds" in result:
                entry["server_compute_seconds"] = result["server_compute_seconds"]
            ratios = paired_ratios(remote_runs[method], engine_runs)
            if ratios:
                entry["ratio_to_in_process"] = statistics.median(ratios)
                entry["round_ratios"] = ratios
            if engine_s and method == "remote_cpp" and "seconds" in whole:
                entry["whole_batch_seconds"] = whole["seconds"]
                entry["whole_batch_ratio_to_in_process"] = whole["seconds"] / engine_s
        record(entry)


def median_run(runs):
    """The run with the median time (the slower middle one of an even count, so that the tables
    never favour lossd) of [(result, rss)], its peak memory the largest of all, and how many
    rounds ran; the first failure if any failed."""
    failed = [run for run in runs if "seconds" not in run[0]]
    if failed:
        return failed[0]
    ordered = sorted(runs, key=lambda run: run[0]["seconds"])
    result, _ = ordered[len(ordered) // 2]
    rss = max((run[1] for run in runs if run[1] is not None), default=None)
    return dict(result, rounds=len(runs)), rss


def paired_ratios(remote_runs, engine_runs):
    """Remote over in-process time of each round in which both ran."""
    return [remote[0]["seconds"] / engine[0]["seconds"]
            for remote, engine in zip(remote_runs, engine_runs)
            if "seconds" in remote[0] and "seconds" in engine[0]]


def transport_entry(method, dtype, streams, tokens, result):
    """GB/s each way: of the tensors for lossd (hidden rows in, dL/dh out, however they
    travelled), of message payload for the echo."""
    entry = {"method": method, "dtype": dtype, "streams": streams, "n": tokens,
             "h": TRANSPORT_HIDDEN}
    if "error" in result:
        entry["error"] = result["error"]
    else:
        sent = result.get("hidden_bytes", result.get("bytes_sent"))
        received = result.get("grad_hidden_bytes", result.get("bytes_received"))
        entry.update(seconds=result["seconds"], in_gbps=sent / result["seconds"] / 1e9,
                     out_gbps=received / result["seconds"] / 1e9)
    return entry


def bench_echo(runner, tokens, dtype, streams, copies="protobuf", connections=1):
    """gRPC's ceiling for one transport measurement: the payload bytes lossctl bench sends (its
    `tokens // streams` rows per call, on `streams` calls), echoed each way."""
    rows = tokens // streams * streams
    result, _ = runner.grpc_echo_bench(rows * TRANSPORT_HIDDEN * DTYPE_BYTES[dtype], streams,
                                       copies, connections)
    method = "grpc_echo" if copies == "protobuf" else f"grpc_echo_{copies}_copy"
    if connections > 1:
        method += f"_{connections}_connections"
    return transport_entry(method, dtype, streams, tokens, result)


def bench_transport(runner, tokens, record):
    server = Server(runner, TRANSPORT_VOCAB, TRANSPORT_HIDDEN)
    try:
        for dtype in ("float32", "bfloat16"):
            for streams in TRANSPORT_STREAMS:
                for method, shared_memory in (("transport", False), ("transport_shm", True)):
                    result, _ = runner.lossctl_bench(server.address, "wire", tokens, streams=streams,
                                                     dtype=dtype, accumulate=False, warmup=1,
                                                     warmup_tokens=0, shared_memory=shared_memory)
                    record(transport_entry(method, dtype, streams, tokens, result))
                record(bench_echo(runner, tokens, dtype, streams))
    finally:
        server.stop()
    # The same rows through the engine in-process, with the same outputs (dL/dh, no dL/dW): what a
    # call costs with no transfer at all.
    engine, _ = runner.engine_bench("engine", tokens, TRANSPORT_HIDDEN, TRANSPORT_VOCAB,
                                    passes="fwd_dh")
    row_bytes = tokens * TRANSPORT_HIDDEN * DTYPE_BYTES["float32"]
    record(transport_entry("transport_engine", "float32", 1, tokens,
                           engine if "error" in engine else
                           {"seconds": engine["seconds"], "hidden_bytes": row_bytes,
                            "grad_hidden_bytes": row_bytes}))
    record({"method": "memcpy", "gbps": memcpy_gbps()})


# --------------------------------------------------------------------------------------------
# Report.

SWEEP_METHODS = list(TORCH_METHODS) + ["engine", "floor", "remote_cpp", "remote_python"]
FLOORS = ("floor", "torch_floor")
TRANSPORT_METHODS = {"transport": "lossd Compute, messages",
                     "transport_shm": "lossd Compute, shared memory",
                     "transport_engine": "engine alone, in-process",
                     "grpc_echo": "gRPC echo"}


def fmt_seconds(entry):
    return entry.get("error") or f"{entry['seconds']:.3f}"


def best_floor(by_shape_method, shape):
    """The faster floor measured at `shape` ((V, H, N)), or None."""
    times = [by_shape_method.get(shape + (floor,), {}).get("seconds") for floor in FLOORS]
    return min(filter(None, times), default=None)


def write_markdown(path, machine, command, entries):
    sweep = [e for e in entries if e["method"] in SWEEP_METHODS]
    shapes = sorted({(e["v"], e["h"], e["n"]) for e in sweep})
    by = {(e["v"], e["h"], e["n"], e["method"]): e for e in sweep}
    lines = [f"# lossd against its peers: {machine['cpu']}, {machine['threads']} threads",
             "", f"Date: {machine['date']}. Machine: {json.dumps(machine)}.", "",
             f"Command: `{command}`", "",
             "Forward + backward (loss, dL/dh, dL/dW), fp32. Seconds are medians (the engine's "
             "and the remote clients' over the rounds below); ratios are time over the faster "
             "of the two floors' (OpenBLAS's and torch's, the same products on each library) "
             "and over torch naive's. Memory is each process's peak resident set (at start: a "
             "torch process's after importing torch, before any tensor); for the "
             "remote methods, the client's, with the server's in the last column (one server "
             "per vocabulary, its peak so far as N grows). `tensors` is what every method must "
             "hold (hidden and dL/dh, W and dL/dW, in one process or split between client and "
             "server).", "",
             "| V, H, N | method | seconds | tokens/s | x floor | x torch naive | peak MiB | "
             "at start MiB | tensors MiB | server MiB |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for shape in shapes:
        floor = best_floor(by, shape)
        naive = by.get(shape + ("torch_naive",), {}).get("seconds")
        for method in SWEEP_METHODS:
            e = by.get(shape + (method,))
            if e is None:
                continue
            s = e.get("seconds")
            cells = [f"{shape[0]}, {shape[1]}, {shape[2]}", method, fmt_seconds(e),
                     f"{shape[2] / s:.0f}" if s else "-",
                     f"{s / floor:.3f}" if s and floor else "-",
                     f"{s / naive:.3f}" if s and naive else "-",
                     f"{e['peak_rss_bytes'] / MIB:.0f}",
                     f"{e['start_rss_bytes'] / MIB:.0f}" if e.get("start_rss_bytes") else "",
                     f"{e['tensor_bytes'] / MIB:.0f}",
                     f"{e['server_peak_rss_bytes'] / MIB:.0f}" if e.get("server_peak_rss_bytes") else ""]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Remote against in-process", "",
              "Remote time over the engine's in-process time: rows streamed in messages of about "
              "4 MiB (each token chunk computed as soon as its rows are in, results streamed "
              "back), and the whole batch sent as one message, so that nothing is computed "
              "before all of it has arrived. The engine and both clients run in rounds, one "
              "of each in turn, each round starting with the next (more rounds where a run is "
              "short); streamed is the median of the rounds' ratios, each round's shown beside "
              "it. Call over its engine time: the median round's call time over the time the "
              "server spent in the engine during that call (the summary's compute_seconds), "
              "what the remote path adds, measured within the same seconds and so immune to "
              "the machine's speed moving between runs.", "",
              "| V, H, N | client | streamed | each round | whole batch first | in-process s | "
              "call over its engine time |",
              "| --- | --- | ---: | --- | ---: | ---: | ---: |"]
    for shape in shapes:
        for method in ("remote_cpp", "remote_python"):
            e = by.get(shape + (method,))
            engine = by.get(shape + ("engine",), {}).get("seconds")
            if e and "ratio_to_in_process" in e:
                whole = e.get("whole_batch_ratio_to_in_process")
                rounds = ", ".join(f"{r:.3f}" for r in e.get("round_ratios", []))
                server_s = e.get("server_compute_seconds")
                own = f"{e['seconds'] / server_s:.3f}" if server_s else "-"
                lines.append(f"| {shape[0]}, {shape[1]}, {shape[2]} | {method[7:]} | "
                             f"{e['ratio_to_in_process']:.3f} | {rounds} | "
                             f"{f'{whole:.3f}' if whole else '-'} | {engine:.3f} | {own} |")
    transport = [e for e in entries if e["method"] in TRANSPORT_METHODS]
    memcpy = next((e["gbps"] for e in entries if e["method"] == "memcpy"), None)
    if transport:
        lines += ["", "## Transport", "",
                  f"lossd Compute: a call on a [{TRANSPORT_VOCAB}, {TRANSPORT_HIDDEN}] head, "
                  "hidden rows in, dL/dh out, from the C++ client, with the rows in gRPC "
                  "messages or in shared memory (a memfd the server maps); GB/s of those tensors "
                  "each way. Engine alone: the same fp32 rows through the engine in-process, the "
                  "bound of any transport. gRPC echo: the ceiling gRPC "
                  "itself reaches here, grpc_echo_bench echoing the same bytes each way in "
                  f"{TRANSPORT_MESSAGE_BYTES // MIB} MiB messages over as many concurrent calls "
                  "(two processes, loopback, nothing else done; median of 3), GB/s of message "
                  "payload each way. Single-thread memcpy on this machine: "
                  + (f"{memcpy:.2f} GB/s." if memcpy else "not measured."), "",
                  "| dtype | streams | tokens | what | seconds | in GB/s | out GB/s |",
                  "| --- | ---: | ---: | --- | ---: | ---: | ---: |"]
        for e in transport:
            cells = [e["dtype"], str(e["streams"]), str(e["n"]), TRANSPORT_METHODS[e["method"]]]
            if "error" in e:
                cells += [e["error"], "", ""]
            else:
                cells += [f"{e['seconds']:.3f}", f"{e['in_gbps']:.2f}", f"{e['out_gbps']:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
    lines += target_lines(entries)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


# What lossd promises against its peers on this machine (the sweep, forward + backward, fp32).
TARGET_FLOOR_RATIO = 1.10      # engine time over the faster GEMM floor's, at most
TARGET_REMOTE_RATIO = 1.10     # remote call over in-process engine time, median of rounds, at most
TARGET_WIRE_GBPS = 1.5         # tensor bytes each way of one Compute call, at least
FLAT_MEMORY_SLACK = 16 * MIB   # engine memory beyond its tensors may move this much past the budget


def verdict(misses, measured=True):
    """Met only where something was measured: a target with no figures is not met by default."""
    if not measured:
        return "**not measured**"
    return "**met**" if not misses else "**not met** at " + "; ".join(misses)


def ratio_range(ratios):
    return f"{min(ratios):.3f} to {max(ratios):.3f}" if ratios else "nothing measured"


def target_lines(entries):
    """Each target checked against this run's own figures: met, or the shapes that miss it."""
    sweep = {(e["v"], e["h"], e["n"], e["method"]): e for e in entries
             if e["method"] in SWEEP_METHODS}
    shapes = sorted({key[:3] for key in sweep})

    def seconds(shape, method):
        return sweep.get(shape + (method,), {}).get("seconds")

    def name(shape):
        return f"V = {shape[0]}, N = {shape[2]}"

    lines = ["", "## Against the targets", ""]
    for peer in TORCH_PEERS:
        ratios, misses, skipped = [], [], []
        for shape in shapes:
            engine, other = seconds(shape, "engine"), seconds(shape, peer)
            if engine and other:
                ratios.append(engine / other)
                if engine >= other:
                    misses.append(f"{name(shape)} ({engine / other:.3f}x)")
            elif engine and shape + (peer,) in sweep:
                skipped.append(f"{sweep[shape + (peer,)].get('error', 'no time')} at {name(shape)}")
        note = f"; {peer}: {', '.join(skipped)}" if skipped else ""
        lines.append(f"- Engine faster than {peer} at every shape: {verdict(misses, ratios)} "
                     f"(engine time {ratio_range(ratios)}x {peer}'s{note}).")

    ratios, misses, faster = [], [], []
    for shape in shapes:
        engine, floor = seconds(shape, "engine"), best_floor(sweep, shape)
        if engine and floor:
            ratios.append(engine / floor)
            faster.append(min((f for f in FLOORS if seconds(shape, f) == floor)))
            if engine / floor > TARGET_FLOOR_RATIO:
                misses.append(f"{name(shape)} ({engine / floor:.3f}x)")
    which = ", ".join(f"{f} {faster.count(f)}" for f in FLOORS if f in faster)
    lines.append(f"- Engine within {TARGET_FLOOR_RATIO:.2f}x of the GEMM floor at every shape: "
                 f"{verdict(misses, ratios)} ({ratio_range(ratios)}x the faster floor; shapes "
                 f"where each floor was the faster: {which or 'none'}).")

    # Past the budget (N at least the rows of the largest N's token chunk) the engine's memory
    # beyond its tensors must not grow with N; torch naive's logits do, N * V * 4 bytes.
    misses, spans, naive = [], [], []
    for v, h in sorted({shape[:2] for shape in shapes}):
        engines = {n: sweep[(v, h, n, "engine")] for (v2, h2, n) in shapes
                   if (v2, h2) == (v, h) and "peak_rss_bytes" in sweep.get((v, h, n, "engine"), {})}
        if not engines:
            continue
        largest = engines[max(engines)]
        chunk_rows = (largest.get("chunk") or {}).get("tokens", max(engines))
        extra = {n: e["peak_rss_bytes"] - e["tensor_bytes"] for n, e in engines.items()
                 if n >= chunk_rows}
        low, high = min(extra.values()) / MIB, max(extra.values()) / MIB
        amount = f"{low:.0f}" if round(low) == round(high) else f"{low:.0f} to {high:.0f}"
        spans.append(f"V = {v}: {amount} MiB at N = {', '.join(str(n) for n in sorted(extra))}")
        if (high - low) * MIB > FLAT_MEMORY_SLACK:
            misses.append(f"V = {v} (grows by {high - low:.0f} MiB)")
        torch_runs = [(n, sweep[(v, h, n, "torch_naive")]) for n in sorted(engines)
                      if (v, h, n, "torch_naive") in sweep]
        if torch_runs:
            naive.append(f"V = {v}: " + ", ".join(
                (f"{e['peak_rss_bytes'] / MIB:.0f} MiB" if "seconds" in e else
                 e.get("error", "no time")) + f" at N = {n}" for n, e in torch_runs))
    lines.append(f"- Engine memory flat in N past the workspace budget: {verdict(misses, spans)} "
                 f"(beyond its tensors, {'; '.join(spans)}). "
                 f"Torch naive: {'; '.join(naive) or 'not run'}.")

    ratios, misses, within = [], [], []
    for shape in shapes:
        for method in ("remote_cpp", "remote_python"):
            e = sweep.get(shape + (method,), {})
            if "ratio_to_in_process" not in e:
                continue
            ratios.append(e["ratio_to_in_process"])
            if e["ratio_to_in_process"] > TARGET_REMOTE_RATIO:
                misses.append(f"{name(shape)} {method[7:]} ({e['ratio_to_in_process']:.3f}x)")
            if e.get("server_compute_seconds"):
                within.append(e["seconds"] / e["server_compute_seconds"])
    lines.append(f"- Remote Compute within {TARGET_REMOTE_RATIO:.2f}x of in-process at every "
                 f"shape, median of rounds: {verdict(misses, ratios)} ({ratio_range(ratios)}x; "
                 f"each call over the server's own engine time during it, "
                 f"{ratio_range(within)}x).")

    calls = [e for e in entries if e["method"] in ("transport", "transport_shm") and "seconds" in e]
    if calls:
        best = max(calls, key=lambda e: min(e["in_gbps"], e["out_gbps"]))
        gbps = min(best["in_gbps"], best["out_gbps"])
        how = (f"{TRANSPORT_METHODS[best['method']][len('lossd Compute, '):]}, {best['dtype']}, "
               f"{best['streams']} stream{'s' if best['streams'] > 1 else ''}")
        lines.append(f"- Wire throughput of one Compute call at least {TARGET_WIRE_GBPS} GB/s each "
                     f"way: {verdict([] if gbps >= TARGET_WIRE_GBPS else [f'{gbps:.2f} GB/s'])} "
                     f"(best: {gbps:.2f} GB/s, {how}).")
    return lines


def write_plots(out_dir, entries):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sweep = [e for e in entries if e["method"] in SWEEP_METHODS]
    groups = sorted({(e["v"], e["h"]) for e in sweep})
    # The memory plot shows the server for the remote methods: that is where lossd's memory is.
    for name, key, label, methods in (
            ("time_vs_n.png", "seconds", "seconds (fwd + bwd)", SWEEP_METHODS),
            ("memory_vs_n.png", "peak_rss_bytes", "peak resident GiB",
             list(TORCH_METHODS) + ["engine", "floor", "server"])):
        fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
        for ax, (v, h) in zip(axes[0], groups):
            for method in methods:
                source, field = ("remote_cpp", "server_peak_rss_bytes") if method == "server" \
                    else (method, key)
                points = sorted((e["n"], e[field]) for e in sweep
                                if (e["v"], e["h"], e["method"]) == (v, h, source)
                                and e.get("seconds") and e.get(field))
                if points:
                    xs, ys = zip(*points)
                    ys = [y / GIB for y in ys] if key == "peak_rss_bytes" else ys
                    ax.plot(xs, ys, marker="o", label=method)
                for e in sweep:
                    if (e["v"], e["h"], e["method"]) == (v, h, source) and e.get("error"):
                        ax.annotate(f"{method}: " + ("out of memory" if e["error"] == OUT_OF_MEMORY
                                                     else "failed"),
                                    (e["n"], ax.get_ylim()[0]), fontsize=7, rotation=90,
                                    va="bottom")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"V={v}, H={h}")
            ax.set_xlabel("tokens N")
            ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name), dpi=110)
        plt.close(fig)
    write_shape_bars(out_dir, sweep, plt)
    # Per dtype and stream count, one bar per method: lossd's two transfers, the engine alone,
    # and gRPC's echo of the same bytes (hatched).
    transport = {(e["method"], e["dtype"], e["streams"]): e for e in entries
                 if e["method"] in TRANSPORT_METHODS and "error" not in e}
    groups = list(dict.fromkeys(key[1:] for key in transport))
    if groups:
        fig, ax = plt.subplots(figsize=(8, 4))
        labels = [f"{dtype}\n{streams} stream{'s' if streams > 1 else ''}"
                  for dtype, streams in groups]
        # One bar per method (each way is the same for lossd; the echo's too).
        bars = (("transport", "C0", "", "lossd, messages"),
                ("transport_shm", "C2", "", "lossd, shared memory"),
                ("transport_engine", "C3", "", "engine alone, in-process"),
                ("grpc_echo", "C0", "//", "gRPC echo"))
        for i, (method, color, hatch, label) in enumerate(bars):
            points = [(x, transport[(method,) + group]["in_gbps"]) for x, group in enumerate(groups)
                      if (method,) + group in transport]
            if points:
                xs, ys = zip(*points)
                ax.bar([x + (i - 1.5) * 0.2 for x in xs], ys, 0.2, color=color, hatch=hatch,
                       alpha=0.5 if hatch else 1.0, edgecolor=color, label=label)
        memcpy = next((e["gbps"] for e in entries if e["method"] == "memcpy"), None)
        if memcpy:
            ax.axhline(memcpy, color="gray", linestyle="--", label="memcpy, 1 thread")
        ax.set_xticks(range(len(groups)), labels)
        ax.set_ylabel("GB/s")
        ax.set_title("Compute call throughput each way, loopback")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "transport.png"), dpi=110)
        plt.close(fig)


# The shape the bar chart shows when the run measured it: Llama 3's vocabulary at the largest N
# that 2 cores sweep.
BAR_SHAPE = (128256, 2048, 4096)


def bar_shape(sweep):
    """BAR_SHAPE if measured, else the shape with the most work among those where the engine ran."""
    shapes = {(e["v"], e["h"], e["n"]) for e in sweep if e["method"] == "engine" and "seconds" in e}
    if BAR_SHAPE in shapes:
        return BAR_SHAPE
    return max(shapes, key=lambda shape: shape[0] * shape[1] * shape[2], default=None)


def write_shape_bars(out_dir, sweep, plt):
    """shape_bars.png: every method's time and peak memory at one shape, side by side."""
    shape = bar_shape(sweep)
    if shape is None:
        return
    by = {e["method"]: e for e in sweep if (e["v"], e["h"], e["n"]) == shape}
    methods = [m for m in SWEEP_METHODS if m in by]
    fig, (time_ax, memory_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, field, label in ((time_ax, "seconds", "seconds (fwd + bwd)"),
                             (memory_ax, "peak_rss_bytes", "peak resident GiB (remote: server's)")):
        heights = []
        for method in methods:
            e = by[method]
            value = e.get("server_peak_rss_bytes") if field == "peak_rss_bytes" and \
                method.startswith("remote_") else e.get(field)
            heights.append((value / GIB if field == "peak_rss_bytes" else value)
                           if "seconds" in e and value else 0.0)
        colors = ["C3" if m == "engine" or m.startswith("remote_") else
                  "gray" if m in FLOORS else "C0" for m in methods]
        ax.bar(range(len(methods)), heights, color=colors)
        for x, method in enumerate(methods):
            if "seconds" not in by[method]:
                failed = "out of memory" if by[method].get("error") == OUT_OF_MEMORY else "failed"
                ax.annotate(failed, (x, 0), rotation=90, ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"V={shape[0]}, H={shape[1]}, N={shape[2]}, fp32")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "shape_bars.png"), dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, about 2 minutes")
    parser.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    parser.add_argument("--out", help="results folder (default bench/results/<machine>-<date>)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--reps", type=int, default=1,
                        help="timed runs per process of torch and the floor, median")
    parser.add_argument("--rounds", type=int, default=3,
                        help="most paired rounds of the engine and the remote clients per shape "
                             "(fewer on long shapes), medians")
    parser.add_argument("--round-seconds", type=float, default=ROUND_SECONDS,
                        help="engine seconds per shape that its paired rounds may take")
    parser.add_argument("--shapes", type=parse_shapes,
                        help="V,H,N;V,H,N;... instead of the sweep (rows of one V,H share a server)")
    parser.add_argument("--skip-transport", action="store_true",
                        help="leave out the wire throughput measurements")
    parser.add_argument("--budget-mib", type=int, default=0,
                        help="lossd's workspace budget (0, the default: the device's, as "
                             "lossd_server takes it)")
    parser.add_argument("--memory-cap-gib", type=float, default=6.0,
                        help="data-segment cap of every process; 6 GiB of this 24 GiB machine "
                             "plays the part of an accelerator's memory")
    parser.add_argument("--report", metavar="DIR",
                        help="run nothing: write DIR's results.md and plots anew from its "
                             "results.jsonl (the command is kept from its results.md)")
    # Worker mode (internal).
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--shape", type=int, nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--chunk-rows", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--address", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return
    if args.report:
        rewrite_report(args.report)
        return

    args.build_dir = os.path.abspath(args.build_dir)
    sys.path.insert(0, os.path.join(args.build_dir, "python"))
    machine = describe_machine(args.threads)
    machine["date"] = datetime.date.today().isoformat()
    machine_name = "".join(c if c.isalnum() else "-" for c in machine["cpu"].lower()).strip("-")
    out_dir = args.out or os.path.join(REPO, "bench", "results",
                                       f"{machine_name}-{machine['threads']}t-{machine['date']}")
    os.makedirs(out_dir, exist_ok=True)
    command = "bench/peers.sh " + " ".join(sys.argv[1:])
    runner = Runner(args)
    entries = []
    started = time.monotonic()

    def record(entry):
        entry = dict(entry, machine=machine)
        entries.append(entry)
        shown = {k: v for k, v in entry.items() if k != "machine"}
        print(f"[{time.monotonic() - started:6.0f} s] {json.dumps(shown)}", file=sys.stderr,
              flush=True)

    for v, h, ns in args.shapes or (QUICK_SHAPES if args.quick else FULL_SHAPES):
        server = Server(runner, v, h)
        try:
            for n in ns:
                bench_shape(runner, server, v, h, n, record)
        finally:
            server.stop()
    if not args.skip_transport:
        bench_transport(runner, QUICK_TRANSPORT_TOKENS if args.quick else TRANSPORT_TOKENS, record)

    with open(os.path.join(out_dir, "results.jsonl"), "w") as f:
        for entry in entries:
            f.write(json.dumps(entry) + "\n")
    write_markdown(os.path.join(out_dir, "results.md"), machine, command, entries)
    write_plots(out_dir, entries)
    print(f"wrote {out_dir} in {time.monotonic() - started:.0f} s", file=sys.stderr)


def rewrite_report(out_dir):
    """results.md and the plots of an earlier run, from its raw results."""
    with open(os.path.join(out_dir, "results.jsonl")) as f:
        entries = [json.loads(line) for line in f if line.strip()]
    if not entries:
        sys.exit(f"{out_dir}/results.jsonl: expected at least one result")
    command = "not recorded"
    try:
        with open(os.path.join(out_dir, "results.md")) as f:
            command = next((line.strip()[len("Command: `"):-1] for line in f
                            if line.startswith("Command: `")), command)
    except FileNotFoundError:
        pass
    write_markdown(os.path.join(out_dir, "results.md"), entries[0]["machine"], command, entries)
    try:
        import matplotlib  # noqa: F401  (bench/peers.sh installs it; a report can do without)
    except ImportError:
        print("plots not redrawn: matplotlib is not installed", file=sys.stderr)
        return
    write_plots(out_dir, entries)


if __name__ == "__main__":
    main()
