#!/usr/bin/env python3
"""lossd against torch and the fused cross-entropy kernels on one GPU, side by side in one run.

Every method computes cross-entropy over hidden [N, H] and W [V, H] in --dtype (bf16 by default)
with an fp32 loss, in two passes: fwd_bwd (the mean loss, dL/dh and dL/dW accumulated into W.grad)
and fwd (the loss alone, without autograd).
  floor           the GEMMs alone through torch's matmul (cuBLAS): h W^T (2NHV flops) for fwd, and
                  dz W and dz^T h as well (6NHV) for fwd_bwd: the rate every method's useful work
                  is measured against, in this run.
  torch_naive     F.cross_entropy((h @ W.T).float(), labels): where training scripts start.
  torch_chunked   token chunks of the same (--chunk-rows), each chunk's backward run before the
                  next chunk's forward, so [chunk, V] logits at a time: the usual hand-written fix.
  torch_compiled  torch_chunked with each chunk's loss compiled by torch.compile.
  torch_lce       torch's own F.linear_cross_entropy with LinearCrossEntropyOptions() (chunked),
                  where this torch has it.
  liger           Liger-Kernel's LigerFusedLinearCrossEntropyLoss.
  cce             Cut Cross-Entropy's linear_cross_entropy with its default gradient filter.
  lossd_<B>MiB    the lossd engine on the CUDA backend with a workspace budget of B MiB
                  (engine_bench --device=cuda, one process per budget; --budgets-mib, where
                  `default` is the budget the server takes by default: lossd_default), and with
                  --lossd-modes=default,exact also in the exact gradient mode (_exact). Its
                  hidden states and dL/dh live in page-locked host memory, as the server's
                  do; the mode `pageable` (_pageable) gives it plain memory instead, as an
                  in-process caller's own arrays, copied through staging; the mode `chunks`
                  (_chunks) plans without windows of rows (LOSSD_CUDA_WINDOWS=0), as the engine
                  planned before them, to time both in one run. Its device
                  time is the engine's own (CUDA events around each call, which count the copies
                  the call waits for); its wall time is the host's clock around each call.
The engine is timed first, before this process holds any inputs on the GPU, so that its rows exist
whatever the peers do. A method that cannot run here is recorded with the reason, one that fails
with its error (out of memory, a failed import or anything else) or runs past its own deadline
(--peer-seconds) with that, and the run goes on. --methods picks the methods to run.

Each method runs --warmup calls on the real shape first (the first one's time is recorded: it
includes torch.compile's and Triton's compilation), then --reps timed calls: device time from CUDA
events around each call (median, min and max), wall time from the host's clock (median), and the
peak memory allocated during the timed calls above what was allocated before them (inputs and
W.grad excluded; the engine's is its workspace). Each method's loss and dL/dh are compared with
torch_naive's on the same inputs. Peers whose turn comes after --deadline-seconds are skipped and
recorded so.

Writes results.jsonl and results.md (a header naming the device, driver, CUDA, versions, date and
command, then the table, ready for bench/RESULTS.md) to --out, both rewritten after every row, so
that a run stopped from outside keeps what it measured. On the GPU machine scripts/gpu_round.sh
call1 runs it; `--device cpu --dtype fp32` runs the same code on the CPU with
small shapes, for testing.
"""
import argparse
import datetime
import importlib.metadata
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Llama 3 8B's head with a 16k-token batch, and Gemma 2 2B's (the Cut Cross-Entropy paper's table).
DEFAULT_SHAPES = "16384,4096,128256;8192,2304,256000"
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PASSES = ("fwd_bwd", "fwd")
PEERS = ("floor", "torch_naive", "torch_chunked", "torch_lce", "liger", "cce", "torch_compiled")
METHODS = ("lossd",) + PEERS
GIB = 1 << 30
MIB = 1 << 20
OUT_OF_MEMORY = "out of memory"


def parse_shapes(text):
    shapes = []
    for item in filter(None, text.split(";")):
        parts = item.split(",")
        if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(
                f"--shapes: expected positive N,H,V triples separated by ';', got '{item}'")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def parse_budgets(text):
    """Budgets in MiB; 0 stands for `default`, the budget the server takes by default."""
    items = [item for item in text.split(",") if item]
    if not items or not all(item == "default" or (item.isdigit() and int(item) > 0)
                            for item in items):
        raise SystemExit("--budgets-mib: expected positive integers or 'default' separated by ',', "
                         f"got '{text}'")
    return [0 if item == "default" else int(item) for item in items]


def parse_methods(text):
    items = [item for item in text.split(",") if item]
    if not items or any(item not in METHODS for item in items):
        raise SystemExit(f"--methods: expected a comma-separated subset of {', '.join(METHODS)}, "
                         f"got '{text}'")
    return items


LOSSD_MODES = ("default", "exact", "pageable", "chunks")


def parse_modes(text):
    items = [item for item in text.split(",") if item]
    if not items or any(item not in LOSSD_MODES for item in items):
        raise SystemExit(f"--lossd-modes: expected a comma-separated subset of "
                         f"{', '.join(LOSSD_MODES)}, got '{text}'")
    return items


def engine_method(budget_mib, mode="default"):
    name = "lossd_default" if budget_mib == 0 else f"lossd_{budget_mib}MiB"
    return name if mode == "default" else f"{name}_{mode}"


def useful_flops(n, h, v, pass_name):
    return (6.0 if pass_name == "fwd_bwd" else 2.0) * n * h * v


# --------------------------------------------------------------------------------------------
# The methods: each is loss_fn(h, weight, labels) -> the mean loss, differentiable when autograd
# is on, or a string saying why it cannot run here.

def naive_loss(h, weight, labels):
    return F.cross_entropy((h @ weight.T).float(), labels)


def sum_loss(h, weight, labels):
    return F.cross_entropy((h @ weight.T).float(), labels, reduction="sum")


def chunked(chunk_loss, chunk_rows):
    """The mean over token chunks of chunk_loss; with autograd on, each chunk's backward runs before
    the next chunk's forward, and the loss comes back as a leaf that backward() leaves alone."""

    def run(h, weight, labels):
        n = h.shape[0]
        backward = torch.is_grad_enabled() and h.requires_grad
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad = torch.empty_like(h) if backward else None
        for r0 in range(0, n, chunk_rows):
            part = h.detach()[r0:r0 + chunk_rows]
            if backward:
                part.requires_grad_()
            loss = chunk_loss(part, weight, labels[r0:r0 + chunk_rows]) / n
            if backward:
                loss.backward()
                grad[r0:r0 + chunk_rows] = part.grad
            total += loss.detach()
        if backward:
            h.grad = grad
            return total.requires_grad_()
        return total

    return run


def floor_gemms(h, weight, labels):
    """The useful GEMMs with no elementwise work: z = h W^T, and with autograd on dh = z W and
    dW += z^T h."""
    z = h.detach() @ weight.detach().T
    if torch.is_grad_enabled() and h.requires_grad:
        h.grad = z @ weight.detach()
        weight.grad.addmm_(z.T, h.detach())
        return torch.zeros((), device=h.device, requires_grad=True)
    return torch.zeros((), device=h.device)


def describe_failure(error):
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:250]


def make_liger():
    from liger_kernel.transformers.fused_linear_cross_entropy import (
        LigerFusedLinearCrossEntropyLoss)
    liger = LigerFusedLinearCrossEntropyLoss()
    return lambda h, weight, labels: liger(weight, h, labels)


def make_cce():
    from cut_cross_entropy import linear_cross_entropy
    return lambda h, weight, labels: linear_cross_entropy(h, weight, labels)


def make_torch_lce():
    if not (hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")):
        return (f"absent: torch {torch.__version__} has no "
                "F.linear_cross_entropy with LinearCrossEntropyOptions")
    options = torch.nn.LinearCrossEntropyOptions()
    return lambda h, weight, labels: F.linear_cross_entropy(h, weight, labels, options=options)


def peer_methods(device, chunk_rows):
    """name -> loss function, or the reason it cannot run here. A peer whose import or setup
    raises anything at all (not only ImportError: a Triton that does not know this GPU, a wheel
    built for another torch) is recorded with the error; the others still run."""
    makers = {"floor": lambda: floor_gemms, "torch_naive": lambda: naive_loss,
              "torch_chunked": lambda: chunked(sum_loss, chunk_rows),
              "torch_lce": make_torch_lce, "liger": make_liger, "cce": make_cce}
    # Last among the peers: its first call compiles, for up to a minute per shape and pass.
    if hasattr(torch, "compile"):
        makers["torch_compiled"] = lambda: chunked(torch.compile(sum_loss), chunk_rows)
    methods = {}
    for name in PEERS:
        if name in ("liger", "cce") and device.type != "cuda":
            methods[name] = "unavailable: needs a CUDA device"
        elif name not in makers:
            methods[name] = f"unavailable: torch {torch.__version__} has no torch.compile"
        else:
            try:
                methods[name] = makers[name]()
            except ImportError as error:
                methods[name] = f"unavailable: {error}"
            except Exception as error:  # recorded; the next peer is made
                methods[name] = f"failed: {describe_failure(error)}"
    return methods


class PeerTimeout(Exception):
    pass


class Deadline:
    """Raises PeerTimeout in the main thread after `seconds` (SIGALRM): a peer stuck compiling or
    in a slow fallback gives up its turn instead of the run's. A call blocked in C (a kernel, a
    synchronize) is interrupted when it returns to Python."""

    def __init__(self, seconds):
        self.seconds = seconds

    def _expired(self, signum, frame):
        raise PeerTimeout(f"past its {self.seconds:g} s deadline")

    def __enter__(self):
        if self.seconds and self.seconds != float("inf"):
            self.previous = signal.signal(signal.SIGALRM, self._expired)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc):
        if self.seconds and self.seconds != float("inf"):
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
        return False


# --------------------------------------------------------------------------------------------
# Measuring.

class Clock:
    """Times one call: (device seconds from CUDA events on a GPU, else the host's; wall seconds)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn):
        self.sync()
        begin = time.perf_counter()
        if not self.cuda:
            result = fn()
            wall = time.perf_counter() - begin
            return wall, wall, result
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        wall = time.perf_counter() - begin
        return start.elapsed_time(end) / 1000.0, wall, result


def one_call(loss_fn, hidden, weight, labels, pass_name):
    """(loss, dL/dh or None) of one call; with fwd_bwd, dL/dW accumulates into weight.grad."""
    if pass_name == "fwd":
        with torch.no_grad():
            return loss_fn(hidden, weight, labels).detach().float(), None
    h = hidden.detach().requires_grad_()
    loss = loss_fn(h, weight, labels)
    loss.backward()
    return loss.detach().float(), h.grad


def spread(device_seconds, wall_seconds):
    return {"seconds": statistics.median(device_seconds), "min_seconds": min(device_seconds),
            "max_seconds": max(device_seconds), "wall_seconds": statistics.median(wall_seconds),
            "reps": len(device_seconds)}


def measure_peer(loss_fn, hidden, weight, labels, pass_name, clock, args, device):
    def call():
        return one_call(loss_fn, hidden, weight, labels, pass_name)

    first_call = None
    for _ in range(args.warmup):
        _, wall, _ = clock(call)
        first_call = wall if first_call is None else first_call
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    device_seconds, wall_seconds = [], []
    for _ in range(args.reps):
        seconds, wall, _ = clock(call)
        device_seconds.append(seconds)
        wall_seconds.append(wall)
    result = spread(device_seconds, wall_seconds)
    if first_call is not None:
        result["first_call_seconds"] = first_call
    if device.type == "cuda":
        result["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - before
    # One more call for the outputs to compare: keeping a timed call's would hold its dL/dh
    # through the next and count it in that call's peak memory.
    result["loss"], result["grad_hidden"] = call()
    return result


def failure(error):
    """The record of a method that raised: out of memory, its deadline, or the error's type and
    first line."""
    if isinstance(error, PeerTimeout):
        return {"error": f"timeout: {error}"}
    if isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower():
        return {"error": OUT_OF_MEMORY}
    return {"error": f"failed: {describe_failure(error)}"[:300]}


def measure_engine(n, h, v, budget_mib, mode, args):
    """{pass name: result} from one engine_bench process, or {pass name: {"error": ...}}."""
    argv = [args.engine_bench, f"--device={args.device}", f"--dtype={args.dtype}",
            "--methods=engine", f"--passes={','.join(args.passes)}", f"--shapes={n},{h},{v}",
            f"--reps={args.reps}", "--rep-seconds=600", "--warmup-tokens=0",
            "--gradients=exact" if mode == "exact" else "--gradients=default",
            "--host-memory=pageable" if mode == "pageable" else "--host-memory=server"]
    if budget_mib > 0:
        argv.append(f"--budget-mib={budget_mib}")
    try:
        env = dict(os.environ, LOSSD_CUDA_WINDOWS="0") if mode == "chunks" else None
        done = subprocess.run(argv, capture_output=True, text=True, timeout=args.engine_timeout,
                              env=env)
    except subprocess.TimeoutExpired:
        return {p: {"error": f"failed: engine_bench ran past {args.engine_timeout:g} s"}
                for p in args.passes}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {p: {"error": f"failed: {last}"[:300]} for p in args.passes}
    results = {}
    for line in done.stdout.splitlines():
        row = json.loads(line)
        pass_name = row["method"].removeprefix("engine_")
        wall = row["round_seconds"]
        # The device's own clock where the backend has one; else the host's around calls that
        # end synchronized.
        device_rounds = row.get("device_round_seconds") or wall
        results[pass_name] = dict(spread(device_rounds, wall),
                                  peak_extra_bytes=row["peak_extra_bytes"],
                                  budget_bytes=row["budget_bytes"], chunk=row.get("chunk"),
                                  host_memory=row.get("host_memory"),
                                  backend=row["machine"].get("device"))
    return results


def relative(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def bench_shape(n, h, v, args, device, record, started):
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (torch)"
    kept = {}  # (method, pass) -> the floor's and torch_naive's results, for later methods

    def finish(method, pass_name, result):
        """Records a result as soon as it is measured, so that a run cut short keeps it."""
        reference = kept.get(("torch_naive", pass_name), {})
        floor_s = kept.get(("floor", pass_name), {}).get("seconds")
        entry = {"n": n, "h": h, "v": v, "dtype": args.dtype, "pass": pass_name,
                 "method": method, "device": result.pop("backend", None) or device_name}
        loss, grad = result.pop("loss", None), result.pop("grad_hidden", None)
        if loss is not None and "loss" in reference:
            entry["loss_rel_diff"] = relative(loss, reference["loss"])
            if grad is not None:
                entry["grad_hidden_rel_diff"] = relative(grad, reference["grad_hidden"])
        entry.update(result)
        if "seconds" in result:
            entry["tflops"] = useful_flops(n, h, v, pass_name) / result["seconds"] / 1e12
            if floor_s:
                entry["ratio_to_floor"] = result["seconds"] / floor_s
        if method in ("floor", "torch_naive"):
            kept[method, pass_name] = dict(result, loss=loss, grad_hidden=grad)
        record(entry)

    # The engine first, in processes of its own, while this one holds nothing on the GPU.
    if "lossd" in args.methods:
        for budget in args.budgets_mib:
            for mode in args.lossd_modes:
                method = engine_method(budget, mode)
                print(f"gpu_peers: {n},{h},{v} {method}", file=sys.stderr, flush=True)
                for pass_name, result in measure_engine(n, h, v, budget, mode, args).items():
                    if pass_name in args.passes:
                        finish(method, pass_name, result)
    if not any(m in args.methods for m in PEERS):
        return

    dtype = TORCH_DTYPES[args.dtype]
    generator = torch.Generator(device="cpu").manual_seed(n * 1000003 + v)
    hidden = torch.randn(n, h, generator=generator).to(device, dtype)
    # Logits with standard deviation about 3, as a trained head gives.
    weight = (torch.randn(v, h, generator=generator) * (3.0 / h ** 0.5)).to(device, dtype)
    weight.requires_grad_()
    weight.grad = torch.zeros_like(weight)
    labels = torch.randint(0, v, (n,), generator=generator).to(device)
    clock = Clock(device)
    for method, loss_fn in peer_methods(device, args.chunk_rows).items():
        if method not in args.methods:
            continue
        for pass_name in args.passes:
            if isinstance(loss_fn, str):
                finish(method, pass_name, {"error": loss_fn})
                continue
            if time.monotonic() - started > args.deadline_seconds:
                finish(method, pass_name,
                       {"error": f"skipped: the run's {args.deadline_seconds:g} s were spent"})
                continue
            print(f"gpu_peers: {n},{h},{v} {method} {pass_name}", file=sys.stderr, flush=True)
            try:
                with Deadline(args.peer_seconds):
                    result = measure_peer(loss_fn, hidden, weight, labels, pass_name, clock,
                                          args, device)
            except Exception as error:  # recorded, and the next method runs
                result = failure(error)
            finish(method, pass_name, result)
            try:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
            except Exception as error:  # a peer that broke the device: the rest cannot run
                print(f"gpu_peers: the device failed after {method}: {error}", file=sys.stderr)
                return


# --------------------------------------------------------------------------------------------
# The report.

def describe_run(device, argv):
    """What results.md's header says about where and how the run was made."""
    versions = {"torch": torch.__version__}
    for package in ("triton", "liger-kernel", "cut-cross-entropy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "absent"
    run = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "command": shlex.join(["bench/gpu_peers.py"] + argv), "versions": versions,
           "python": sys.version.split()[0]}
    if device.type == "cuda":
        run["device"] = torch.cuda.get_device_name()
        run["cuda"] = torch.version.cuda
        try:
            run["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            run["driver"] = "unknown"
    else:
        run["device"] = "cpu"
    return run


def markdown(run, entries):
    def cell(entry, key, fmt):
        return fmt.format(entry[key]) if entry.get(key) is not None else "-"

    versions = ", ".join(f"{name} {version}" for name, version in run["versions"].items())
    lines = [f"Device: {run['device']}"
             + (f", driver {run['driver']}, CUDA {run['cuda']}" if "cuda" in run else ""),
             f"Software: Python {run['python']}, {versions}",
             f"Date: {run['date']}",
             f"Command: `{run['command']}`",
             "",
             "Device time: median (min to max) of the timed calls, from CUDA events (lossd's "
             "around each of its calls, counting the copies of rows and dL/dh between host and "
             "GPU that the call waits for); wall: the host's clock; TFLOP/s: useful flops (2NHV "
             "fwd, 6NHV fwd_bwd) over the median; extra: peak memory above the inputs (lossd: "
             "its workspace); rows: lossd's rows per chunk, and in a window the rows of logits "
             "it holds at once; diff: loss and dL/dh relative to torch_naive.",
             "",
             "| N, H, V | pass | method | device ms | min to max ms | wall ms | TFLOP/s "
             "| x floor | extra GiB | rows | first call s | loss, dL/dh diff |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
    # The engine runs before the floor: its ratio to the floor is taken here.
    floors = {(e["n"], e["h"], e["v"], e["pass"]): e["seconds"] for e in entries
              if e["method"] == "floor" and "seconds" in e}
    entries = [dict(e, ratio_to_floor=e["seconds"] / floors[e["n"], e["h"], e["v"], e["pass"]])
               if "seconds" in e and (e["n"], e["h"], e["v"], e["pass"]) in floors else e
               for e in entries]
    shapes = list(dict.fromkeys((e["n"], e["h"], e["v"]) for e in entries))
    by_shape_and_pass = sorted(entries, key=lambda e: (shapes.index((e["n"], e["h"], e["v"])),
                                                      PASSES.index(e["pass"])))
    for e in by_shape_and_pass:
        shape = f"{e['n']}, {e['h']}, {e['v']}"
        if "error" in e:
            lines.append(f"| {shape} | {e['pass']} | {e['method']} | {e['error']} "
                         "| | | | | | | | |")
            continue
        diff = "-"
        if "loss_rel_diff" in e:
            diff = f"{e['loss_rel_diff']:.1e}"
            if "grad_hidden_rel_diff" in e:
                diff += f", {e['grad_hidden_rel_diff']:.1e}"
        extra = f"{e['peak_extra_bytes'] / GIB:.2f}" if "peak_extra_bytes" in e else "-"
        chunk = e.get("chunk") or {}
        rows = str(chunk.get("tokens", "-"))
        if chunk.get("vocab") and chunk["vocab"] < e["v"]:
            rows += f" x {chunk['vocab']}"
        if chunk.get("logit_rows"):
            rows += f" by {chunk['logit_rows']}"
        lines.append(
            f"| {shape} | {e['pass']} | {e['method']} | {e['seconds'] * 1e3:.1f} | "
            f"{e['min_seconds'] * 1e3:.1f} to {e['max_seconds'] * 1e3:.1f} | "
            f"{e['wall_seconds'] * 1e3:.1f} | {cell(e, 'tflops', '{:.3g}')} | "
            f"{cell(e, 'ratio_to_floor', '{:.2f}')} | {extra} | {rows} | "
            f"{cell(e, 'first_call_seconds', '{:.1f}')} | {diff} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="N,H,V;N,H,V;...")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu, for testing")
    parser.add_argument("--dtype", default="bf16", choices=sorted(TORCH_DTYPES))
    parser.add_argument("--passes", default=",".join(PASSES),
                        help="fwd_bwd, fwd or both (default both), comma-separated")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per method and pass")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first, real shape")
    parser.add_argument("--chunk-rows", type=int, default=4096,
                        help="token chunk of torch_chunked and torch_compiled")
    parser.add_argument("--budgets-mib", default="256,1024,8192",
                        help="lossd's workspace budgets, one engine row each; 'default' for the "
                        "budget the server takes by default")
    parser.add_argument("--lossd-modes", default="default",
                        help="lossd's modes, one row each: default, exact (gradients), "
                        "pageable (rows and dL/dh in plain host memory) and chunks (no windows "
                        "of rows)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"which of {', '.join(METHODS)} to run (default all)")
    parser.add_argument("--peer-seconds", type=float, default=float("inf"),
                        help="each peer's deadline for one pass, warm-up included")
    parser.add_argument("--deadline-seconds", type=float, default=float("inf"),
                        help="skip the peers whose turn comes later than this into the run")
    parser.add_argument("--engine-timeout", type=float, default=180.0,
                        help="seconds one engine_bench process may take")
    parser.add_argument("--engine-bench",
                        default=os.path.join(REPO, "build", "bin", "engine_bench"))
    parser.add_argument("--out", required=True, help="folder for results.jsonl and results.md")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.warmup < 0 or args.chunk_rows < 1:
        raise SystemExit("--reps and --chunk-rows: expected >= 1; --warmup: >= 0")
    args.passes = [p for p in args.passes.split(",") if p]
    if not args.passes or any(p not in PASSES for p in args.passes):
        raise SystemExit(f"--passes: expected fwd_bwd, fwd or both, got '{','.join(args.passes)}'")
    args.budgets_mib = parse_budgets(args.budgets_mib)
    args.methods = parse_methods(args.methods)
    args.lossd_modes = parse_modes(args.lossd_modes)
    if not args.peer_seconds > 0:
        raise SystemExit("--peer-seconds: expected a number of seconds > 0")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    shapes = parse_shapes(args.shapes)
    os.makedirs(args.out, exist_ok=True)
    run = describe_run(device, argv)
    started = time.monotonic()
    entries = []
    with open(os.path.join(args.out, "results.jsonl"), "w") as jsonl:
        def record(entry):
            entries.append(entry)
            jsonl.write(json.dumps(entry) + "\n")
            jsonl.flush()
            write_report(args.out, markdown(run, entries))

        for n, h, v in shapes:
            bench_shape(n, h, v, args, device, record, started)
    report = markdown(run, entries)
    write_report(args.out, report)
    sys.stdout.write(report)


def write_report(out, report):
    """results.md, replaced whole (a reader never sees half a table)."""
    path = os.path.join(out, "results.md")
    with open(path + ".tmp", "w") as md:
        md.write(report)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
