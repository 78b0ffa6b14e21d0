#!/usr/bin/env python3
"""lossd against torch and the fused cross-entropy kernels on one GPU, side by side in one run.

Every method does a forward and backward pass of cross-entropy over hidden [N, H] and W [V, H] in
--dtype (bf16 by default) with fp32 loss: the mean loss, dL/dh and dL/dW.
  floor           the GEMMs alone (h W^T, dz W, dz^T h) through torch's matmul (cuBLAS), 6NHV
                  flops: the rate every method's useful work is measured against.
  torch_naive     F.cross_entropy((h @ W.T).float(), labels): where training scripts start.
  torch_chunked   token chunks of the same (--chunk-rows), each chunk's backward run before the
                  next chunk's forward, so [chunk, V] logits at a time: the usual hand-written fix.
  torch_compiled  torch_chunked with each chunk's loss compiled by torch.compile.
  liger           Liger-Kernel's LigerFusedLinearCrossEntropyLoss, when it can be imported.
  cce             Cut Cross-Entropy's linear_cross_entropy with its default gradient filter, when
                  it can be imported.
  engine          the lossd engine on the CUDA backend (engine_bench --device=cuda), whose hidden
                  states and outputs live in host memory as the server's do: its time includes
                  copying them to and from the GPU, which the others do not pay.
Times are medians of --reps calls after --warmup calls (CUDA events on a GPU). Extra memory is the
peak allocated during a call above what was allocated before it (inputs, W.grad); the engine's is
its workspace. Every method's loss and dL/dh are compared with torch_naive's where it ran.

Writes results.jsonl and results.md to --out. On the GPU machine scripts/gpu_round.sh runs it;
`--device cpu --dtype fp32` runs the same code on the CPU with small shapes, for testing.
"""
import argparse
import json
import os
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
GIB = 1 << 30


def parse_shapes(text):
    shapes = []
    for item in filter(None, text.split(";")):
        parts = item.split(",")
        if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(
                f"--shapes: expected positive N,H,V triples separated by ';', got '{item}'")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


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


def loss_and_grads(loss_fn, hidden, weight, labels):
    """One forward and backward: (loss, dL/dh); dL/dW accumulates into weight.grad."""
    h = hidden.detach().requires_grad_()
    loss = loss_fn(h, weight, labels)
    loss.backward()
    return loss.detach().float(), h.grad


def naive_loss(h, weight, labels):
    return F.cross_entropy((h @ weight.T).float(), labels)


def chunked(chunk_loss, chunk_rows):
    """Sum over token chunks with each chunk's backward before the next forward; returns the mean
    loss already backpropagated, as a leaf that backward() leaves alone."""

    def run(h, weight, labels):
        n = h.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad = torch.empty_like(h)
        for r0 in range(0, n, chunk_rows):
            part = h.detach()[r0:r0 + chunk_rows].requires_grad_()
            loss = chunk_loss(part, weight, labels[r0:r0 + chunk_rows]) / n
            loss.backward()
            grad[r0:r0 + chunk_rows] = part.grad
            total += loss.detach()
        h.grad = grad
        return total.requires_grad_()

    return run


def sum_loss(h, weight, labels):
    return F.cross_entropy((h @ weight.T).float(), labels, reduction="sum")


def floor_gemms(h, weight, labels):
    """The useful GEMMs with no elementwise work: z = h W^T, dh = z W, dW += z^T h."""
    z = h.detach() @ weight.detach().T
    h.grad = z @ weight.detach()
    weight.grad.addmm_(z.T, h.detach())
    return torch.zeros((), device=h.device, requires_grad=True)


def peer_methods(device, chunk_rows):
    """name -> loss function, or the reason it cannot run here."""
    methods = {"floor": floor_gemms, "torch_naive": naive_loss,
               "torch_chunked": chunked(sum_loss, chunk_rows)}
    if not hasattr(torch, "compile"):
        methods["torch_compiled"] = f"unavailable: torch {torch.__version__} has no torch.compile"
    else:
        methods["torch_compiled"] = chunked(torch.compile(sum_loss), chunk_rows)
    if device.type != "cuda":
        methods["liger"] = methods["cce"] = "unavailable: needs a CUDA device"
        return methods
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss()
        methods["liger"] = lambda h, weight, labels: liger(weight, h, labels)
    except ImportError as error:
        methods["liger"] = f"unavailable: {error}"
    try:
        from cut_cross_entropy import linear_cross_entropy
        methods["cce"] = lambda h, weight, labels: linear_cross_entropy(h, weight, labels)
    except ImportError as error:
        methods["cce"] = f"unavailable: {error}"
    return methods


def measure_peer(fn, hidden, weight, labels, timer, args, device):
    def call():
        return loss_and_grads(fn, hidden, weight, labels)

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
    # One more call for the outputs to compare: keeping a timed call's would hold its dL/dh
    # through the next and count it in that call's peak memory.
    result["loss"], result["grad_hidden"] = call()
    return result


def measure_engine(n, h, v, args):
    argv = [args.engine_bench, f"--device={args.device}", f"--dtype={args.dtype}",
            "--methods=engine", "--passes=fwd_bwd", f"--shapes={n},{h},{v}",
            f"--reps={args.reps}", f"--budget-mib={args.budget_mib}"]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    row = json.loads(done.stdout.strip().splitlines()[-1])
    return {"seconds": row["seconds"], "reps": row["reps"],
            "peak_extra_bytes": row["peak_extra_bytes"],
            "chunk": row.get("chunk"), "device": row["machine"].get("device")}


def relative(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def bench_shape(n, h, v, args, device, record):
    dtype = TORCH_DTYPES[args.dtype]
    generator = torch.Generator(device="cpu").manual_seed(n * 1000003 + v)
    hidden = torch.randn(n, h, generator=generator).to(device, dtype)
    # Logits with standard deviation about 3, as a trained head gives.
    weight = (torch.randn(v, h, generator=generator) * (3.0 / h ** 0.5)).to(device, dtype)
    weight.requires_grad_()
    weight.grad = torch.zeros_like(weight)
    labels = torch.randint(0, v, (n,), generator=generator).to(device)
    timer = Timer(device)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (torch)"
    flops = 6.0 * n * h * v
    results = {}
    for method, fn in peer_methods(device, args.chunk_rows).items():
        if isinstance(fn, str):
            results[method] = {"error": fn}
            continue
        try:
            results[method] = measure_peer(fn, hidden, weight, labels, timer, args, device)
        except torch.cuda.OutOfMemoryError:
            results[method] = {"error": "out of memory"}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del hidden, weight, labels
    if device.type == "cuda":
        torch.cuda.empty_cache()
    results["engine"] = measure_engine(n, h, v, args)

    reference = dict(results.get("torch_naive", {}))
    floor_s = results.get("floor", {}).get("seconds")
    naive_s = reference.get("seconds")
    for method, result in results.items():
        entry = {"n": n, "h": h, "v": v, "dtype": args.dtype, "method": method,
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

    lines = ["| N, H, V | method | ms | TFLOP/s | x floor | x torch naive | extra GiB "
             "| loss, dL/dh rel. diff |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for e in entries:
        shape = f"{e['n']}, {e['h']}, {e['v']}"
        if "error" in e:
            lines.append(f"| {shape} | {e['method']} | {e['error']} | | | | | |")
            continue
        diff = (f"{e['loss_rel_diff']:.1e}, {e['grad_hidden_rel_diff']:.1e}"
                if "loss_rel_diff" in e else "-")
        extra = f"{e['peak_extra_bytes'] / GIB:.2f}" if "peak_extra_bytes" in e else "-"
        lines.append(f"| {shape} | {e['method']} | {e['seconds'] * 1e3:.1f} | "
                     f"{cell(e, 'tflops', '{:.3g}')} | {cell(e, 'ratio_to_floor', '{:.2f}')} | "
                     f"{cell(e, 'ratio_to_torch_naive', '{:.2f}')} | "
                     f"{extra} | {diff} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="N,H,V;N,H,V;...")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu, for testing")
    parser.add_argument("--dtype", default="bf16", choices=sorted(TORCH_DTYPES))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--chunk-rows", type=int, default=4096,
                        help="token chunk of torch_chunked and torch_compiled")
    parser.add_argument("--budget-mib", type=int, default=1024, help="lossd's workspace budget")
    parser.add_argument("--engine-bench",
                        default=os.path.join(REPO, "build", "bin", "engine_bench"))
    parser.add_argument("--out", required=True, help="folder for results.jsonl and results.md")
    args = parser.parse_args()
    if args.reps < 1 or args.warmup < 0 or args.chunk_rows < 1 or args.budget_mib < 1:
        raise SystemExit("--reps, --chunk-rows and --budget-mib: expected >= 1; --warmup: >= 0")
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

        for n, h, v in shapes:
            bench_shape(n, h, v, args, device, record)
    with open(os.path.join(args.out, "results.md"), "w") as md:
        md.write(markdown(entries))
    sys.stdout.write(markdown(entries))


if __name__ == "__main__":
    main()
