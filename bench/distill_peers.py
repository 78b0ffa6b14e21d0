#!/usr/bin/env python3
"""lossd's distillation against torch's two-logits implementation and Liger-Kernel's fused linear
JSD, side by side in one run, on one GPU or on the CPU.

Every method does a forward and backward pass of the generalized JSD (--beta; 0 forward KL, 1
reverse KL) of a student head W [V, H] on hidden [N, H] against a frozen teacher head W_t
[V, H_t] on its own rows [N, H_t], averaged over the tokens: the loss, dL/dh and dL/dW of the
student, in --dtype with fp32 softmaxes.
  floor          the four GEMMs alone (h W^T, h_t W_t^T, dz W, dz^T h) through torch's matmul:
                 2NV (3H + H_t) flops, the rate every method's useful work is measured against.
  torch_naive    both [N, V] logits materialized, TRL's GKD generalized_jsd_loss on them: where
                 distillation scripts start.
  torch_chunked  the same on token chunks of --chunk-rows, each chunk's backward before the next
                 chunk's forward: the usual hand-written fix.
  liger          Liger-Kernel's LigerFusedLinearJSD (a CUDA device and liger_kernel needed).
  engine         the lossd engine's distill call on --device (distill_bench), its rows and outputs
                 in host memory as the server holds them; its time includes copying them to and
                 from a GPU, which the others do not pay.
The inputs are counter-based random values that distill_bench makes the same way (see its
header), so every method computes on the same numbers and the engine's loss and dL/dh are
compared with torch_naive's. Times are medians of --reps calls after --warmup (CUDA events on a
GPU). Extra memory, on a GPU, is the peak allocated during a call above what was allocated
before it; the engine's is its workspace. Temperature 1 by default: lossd scales the divergence by
tau^2 and TRL and Liger do not, so at other temperatures the engine's loss is tau^2 theirs.

Writes results.jsonl and results.md to --out. `--device cpu --dtype fp32` is the CPU benchmark
(bench/RESULTS.md); on the GPU machine the GPU round runs it with --device cuda.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Llama 3 8B's head distilled from a 70B teacher's (H_t 8192), and a Qwen 2 sized one.
DEFAULT_SHAPES = "8192,4096,8192,128256;8192,3584,3584,152064"
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GIB = 1 << 30


def parse_shapes(text):
    shapes = []
    for item in filter(None, text.split(";")):
        parts = item.split(",")
        if len(parts) != 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"--shapes: expected positive N,H,H_t,V quadruples separated by ';', "
                             f"got '{item}'")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


# distill_bench's inputs (lossd/common/counter_random.h): value i of stream s is uniform on
# [-1, 1) from SplitMix64, scaled to the standard deviation.
_GAMMA = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z):
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def counter_tensor(shape, stddev, stream, dtype, device, block=1 << 24):
    count = math.prod(shape)
    seed = _mix64(np.array([stream], dtype=np.uint64))[0]
    half_width = np.float32(stddev * math.sqrt(3.0))
    out = torch.empty(count, dtype=torch.float32)
    with np.errstate(over="ignore"):
        for start in range(0, count, block):
            index = np.arange(start, min(count, start + block), dtype=np.uint64)
            hashed = _mix64(seed + (index + np.uint64(1)) * _GAMMA)
            unit = (hashed >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / 16777216.0)
            out[start:start + len(index)] = torch.from_numpy(
                half_width * (np.float32(2.0) * unit - np.float32(1.0)))
    return out.reshape(shape).to(device=device, dtype=dtype)


class Timer:
    """Seconds of one call: CUDA events on a GPU (the stream's time, not the host's), else wall."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin


def generalized_jsd(student_logits, teacher_logits, beta, tau):
    """TRL's GKD generalized_jsd_loss per token (forward KL at beta 0, reverse at 1)."""
    log_q = F.log_softmax(student_logits.float() / tau, dim=-1)
    log_p = F.log_softmax(teacher_logits.float() / tau, dim=-1)
    if beta == 0:
        return F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(log_p, log_q, reduction="none", log_target=True).sum(-1)
    log_m = torch.logsumexp(torch.stack([log_q + math.log(1 - beta), log_p + math.log(beta)]),
                            dim=0)
    return (beta * F.kl_div(log_m, log_p, reduction="none", log_target=True).sum(-1) +
            (1 - beta) * F.kl_div(log_m, log_q, reduction="none", log_target=True).sum(-1))


def naive(beta, tau):
    def loss(h, weight, ht, teacher_weight, n):
        with torch.no_grad():
            teacher_logits = ht @ teacher_weight.T
        return tau * tau * generalized_jsd(h @ weight.T, teacher_logits, beta, tau).sum() / n
    return loss


def chunked(beta, tau, chunk_rows):
    """Token chunks, each chunk's backward run before the next chunk's forward; returns the mean
    loss already backpropagated, as a leaf that backward() leaves alone."""
    part_loss = naive(beta, tau)

    def run(h, weight, ht, teacher_weight, n):
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad = torch.empty_like(h)
        for r0 in range(0, n, chunk_rows):
            part = h.detach()[r0:r0 + chunk_rows].requires_grad_()
            loss = part_loss(part, weight, ht[r0:r0 + chunk_rows], teacher_weight, n)
            loss.backward()
            grad[r0:r0 + chunk_rows] = part.grad
            total += loss.detach()
        h.grad = grad
        return total.requires_grad_()
    return run


def floor_gemms(h, weight, ht, teacher_weight, n):
    """The useful GEMMs with no elementwise work."""
    z = h.detach() @ weight.detach().T
    with torch.no_grad():
        ht @ teacher_weight.T
    h.grad = z @ weight.detach()
    weight.grad.addmm_(z.T, h.detach())
    return torch.zeros((), device=h.device, requires_grad=True)


def peer_methods(device, args):
    """name -> loss function, or the reason it cannot run here."""
    methods = {"floor": floor_gemms, "torch_naive": naive(args.beta, args.temperature),
               "torch_chunked": chunked(args.beta, args.temperature, args.chunk_rows)}
    if device.type != "cuda":
        methods["liger"] = "unavailable: needs a CUDA device"
        return methods
    try:
        from liger_kernel.transformers import LigerFusedLinearJSD
        liger = LigerFusedLinearJSD(jsd_beta=args.beta, temperature=args.temperature)
        methods["liger"] = lambda h, weight, ht, teacher_weight, n: liger(h, weight, ht,
                                                                          teacher_weight)
    except ImportError as error:
        methods["liger"] = f"unavailable: {error}"
    return methods


def measure_peer(fn, inputs, timer, args, device):
    h0, weight, ht, teacher_weight = inputs
    n = h0.shape[0]

    def call():
        h = h0.detach().requires_grad_()
        loss = fn(h, weight, ht, teacher_weight, n)
        loss.backward()
        return loss.detach().float(), h.grad

    for _ in range(args.warmup):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    seconds = [timer(call) for _ in range(args.reps)]
    result = {"seconds": statistics.median(seconds), "reps": args.reps}
    if device.type == "cuda":
        result["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - before
    result["loss"], result["grad_hidden"] = call()
    return result


def measure_engine(n, h, ht, v, args):
    with tempfile.TemporaryDirectory() as folder:
        prefix = os.path.join(folder, "grad_hidden")
        argv = [args.distill_bench, f"--device={args.device}", f"--dtype={args.dtype}",
                "--passes=fwd_bwd", f"--shapes={n},{h},{ht},{v}", f"--reps={args.reps}",
                f"--budget-mib={args.budget_mib}", f"--beta={args.beta}",
                f"--temperature={args.temperature}", f"--grad-hidden-out={prefix}"]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
        row = json.loads(done.stdout.strip().splitlines()[-1])
        grad = np.fromfile(f"{prefix}_{n}_{h}_{ht}_{v}.f32", dtype=np.float32).reshape(n, h)
    return {"seconds": row["seconds"], "reps": row["reps"],
            "peak_extra_bytes": row["peak_extra_bytes"], "chunk": row["chunk"],
            "device": row["device"], "loss": torch.tensor(row["loss"]),
            "grad_hidden": torch.from_numpy(grad)}


def relative(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def bench_shape(n, h, ht, v, args, device, record):
    dtype = TORCH_DTYPES[args.dtype]
    hidden = counter_tensor((n, h), 1.0, 1, dtype, device)
    weight = counter_tensor((v, h), 3.0 / math.sqrt(h), 2, dtype, device).requires_grad_()
    weight.grad = torch.zeros_like(weight)
    teacher_hidden = counter_tensor((n, ht), 1.0, 3, dtype, device)
    teacher_weight = counter_tensor((v, ht), 3.0 / math.sqrt(ht), 4, dtype, device)
    inputs = (hidden, weight, teacher_hidden, teacher_weight)
    timer = Timer(device)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (torch)"
    flops = 2.0 * n * v * (3 * h + ht)
    results = {}
    for method, fn in peer_methods(device, args).items():
        if isinstance(fn, str):
            results[method] = {"error": fn}
            continue
        try:
            results[method] = measure_peer(fn, inputs, timer, args, device)
        except (torch.cuda.OutOfMemoryError, RuntimeError) as error:
            results[method] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del inputs, hidden, weight, teacher_hidden, teacher_weight
    if device.type == "cuda":
        torch.cuda.empty_cache()
    results["engine"] = measure_engine(n, h, ht, v, args)

    reference = dict(results.get("torch_naive", {}))
    floor_s = results.get("floor", {}).get("seconds")
    naive_s = reference.get("seconds")
    for method, result in results.items():
        entry = {"n": n, "h": h, "ht": ht, "v": v, "dtype": args.dtype, "beta": args.beta,
                 "temperature": args.temperature, "method": method,
                 "device": result.pop("device", None) or device_name}
        loss, grad = result.pop("loss", None), result.pop("grad_hidden", None)
        if loss is not None and "loss" in reference and method not in ("floor", "torch_naive"):
            entry["loss_rel_diff"] = relative(loss, reference["loss"])
            entry["grad_hidden_rel_diff"] = relative(grad, reference["grad_hidden"])
        entry.update(result)
        if "seconds" in result:
            entry["tflops"] = flops / result["seconds"] / 1e12
            if floor_s:
                entry["ratio_to_floor"] = result["seconds"] / floor_s
            if naive_s:
                entry["ratio_to_torch_naive"] = result["seconds"] / naive_s
        record(entry)


def markdown(entries):
    def cell(entry, key, fmt):
        return fmt.format(entry[key]) if entry.get(key) is not None else "-"

    lines = ["| N, H, H_t, V | method | ms | TFLOP/s | x floor | x torch naive | extra GiB "
             "| loss, dL/dh rel. diff |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for e in entries:
        shape = f"{e['n']}, {e['h']}, {e['ht']}, {e['v']}"
        if "error" in e:
            lines.append(f"| {shape} | {e['method']} | {e['error']} | | | | | |")
            continue
        diff = (f"{e['loss_rel_diff']:.1e}, {e['grad_hidden_rel_diff']:.1e}"
                if "loss_rel_diff" in e else "-")
        extra = f"{e['peak_extra_bytes'] / GIB:.2f}" if "peak_extra_bytes" in e else "-"
        lines.append(f"| {shape} | {e['method']} | {e['seconds'] * 1e3:.1f} | "
                     f"{cell(e, 'tflops', '{:.3g}')} | {cell(e, 'ratio_to_floor', '{:.2f}')} | "
                     f"{cell(e, 'ratio_to_torch_naive', '{:.2f}')} | {extra} | {diff} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="N,H,H_t,V;...")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--dtype", default="bf16", choices=sorted(TORCH_DTYPES))
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--chunk-rows", type=int, default=1024,
                        help="token chunk of torch_chunked")
    parser.add_argument("--budget-mib", type=int, default=1024, help="lossd's workspace budget")
    parser.add_argument("--distill-bench",
                        default=os.path.join(REPO, "build", "bin", "distill_bench"))
    parser.add_argument("--out", required=True, help="folder for results.jsonl and results.md")
    args = parser.parse_args()
    if args.reps < 1 or args.warmup < 0 or args.chunk_rows < 1 or args.budget_mib < 1:
        raise SystemExit("--reps, --chunk-rows and --budget-mib: expected >= 1; --warmup: >= 0")
    if not 0 <= args.beta <= 1:
        raise SystemExit(f"--beta: expected a value in [0, 1], got {args.beta}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    shapes = parse_shapes(args.shapes)
    os.makedirs(args.out, exist_ok=True)
    entries = []
    with open(os.path.join(args.out, "results.jsonl"), "w") as jsonl:
        def record(entry):
            entries.append(entry)
            jsonl.write(json.dumps(entry) + "\n")
            jsonl.flush()
            print(json.dumps(entry), flush=True)

        for n, h, ht, v in shapes:
            bench_shape(n, h, ht, v, args, device, record)
    with open(os.path.join(args.out, "results.md"), "w") as md:
        md.write(markdown(entries))
    sys.stdout.write(markdown(entries))


if __name__ == "__main__":
    main()
