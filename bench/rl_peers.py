#!/usr/bin/env python3
"""lossd's RL policy loss against the implementations RL trainers run, side by side on the CPU.

Every method does a forward and backward pass of the GRPO/DAPO loss of a head W [V, H] over a
batch of B completions of T tokens (hidden [B T, H], fp32): PPO's clipped term (eps 0.2 both
ways) against the old policy's log-probabilities, plus beta = 0.04 times the k3 KL to a reference
policy's, the sum over kept tokens divided by their count (DAPO's token mean); loss, dL/dh and
dL/dW. With --loss gspo the ratio is each completion's (GSPO: the exponential of the mean of
logp - q over its kept tokens, with GSPO-token's stop-gradient form), the rest unchanged.
  torch_floor  the three products alone (h W^T, dz W, dz^T h) on torch's BLAS: 6NHV flops, the
               rate the others' useful work is measured against.
  torch_naive  the logits [B T, V] materialized, log_softmax, the log-probabilities gathered, and
               verl's ppo loss with its k3 penalty (core_algos.compute_policy_loss_vanilla and
               kl_penalty "low_var_kl" without its clamp) on them, then backward: how verl and
               TRL compute it; with --loss gspo verl's compute_policy_loss_gspo.
  liger        Liger-Kernel's LigerFusedLinearGRPOLoss (loss_type "dapo"; importance_sampling_level
               "sequence" with --loss gspo), chunked over the
               completions (chunk_size 1, its default), uncompiled: the peer that never
               materializes the whole [B T, V] logits.
  lossd        a Compute call of objective ppo (gspo) with a k3 KL term to lossd_server on loopback from
               the Python client (lossd.Client.compute), rows in shared memory, dL/dh returned
               and dL/dW accumulated on the server: the path a trainer takes, transport included.
Each method runs in a process of its own, on the same seeded inputs; its extra memory is its
process's peak resident memory above what it held before the first call (inputs and libraries
loaded: for lossd, the head uploaded), and the server's the same, apart: the memory the calls
add, not the head each method holds. Times are medians of --reps
after a warm-up call. The loss of every method is compared with torch_naive's.

    OMP_NUM_THREADS=2 .venv/bin/python bench/rl_peers.py --out bench/results/DIR

needs the build (build/bin/lossd_server, build/python) and liger_kernel in the environment.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("torch_floor", "torch_naive", "liger", "lossd")
BETA, EPS = 0.04, 0.2
GIB = 1 << 30


def problem(b, t, h, v, seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    n = b * t
    hidden = torch.randn(n, h, generator=g) * 0.5
    weight = torch.randn(v, h, generator=g) * (1.0 / h ** 0.5)
    tokens = torch.randint(0, v, (n,), generator=g)
    mask = torch.ones(b, t)
    for row in range(b):  # completions of different lengths, padded
        mask[row, int(t * (0.5 + 0.5 * row / max(b - 1, 1))):] = 0
    with torch.no_grad():
        logp = torch.log_softmax(hidden @ weight.T, -1).gather(1, tokens[:, None])[:, 0]
    old = logp + torch.randn(n, generator=g) * 0.1
    ref = logp + torch.randn(n, generator=g) * 0.1
    advantages = torch.randn(b, generator=g)
    return dict(hidden=hidden, weight=weight, tokens=tokens, mask=mask, old=old, ref=ref,
                advantages=advantages, b=b, t=t)


def naive_loss(p, hidden, weight, loss):
    """verl's ppo (or gspo) term and k3 penalty on materialized logits, DAPO's token mean."""
    import torch
    logp = torch.log_softmax(hidden @ weight.T, -1).gather(1, p["tokens"][:, None])[:, 0]
    a = p["advantages"].repeat_interleave(p["t"])
    if loss == "gspo":  # core_algos.compute_policy_loss_gspo's ratio, its clamp at e^10 included
        mask = p["mask"]
        log_ratio = (logp - p["old"]).view(p["b"], p["t"])
        sequence = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        log_ratio = logp - logp.detach() + sequence.detach().repeat_interleave(p["t"])
        ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    else:
        ratio = torch.exp(logp - p["old"])
    pg = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - EPS, 1 + EPS))
    delta = p["ref"] - logp
    kl = torch.exp(delta) - delta - 1
    mask = p["mask"].reshape(-1)
    return ((pg + BETA * kl) * mask).sum() / mask.sum()


def worker(args):
    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    p = problem(args.b, args.t, args.h, args.v)
    n = args.b * args.t

    if args.method == "torch_floor":
        def call():
            logits = p["hidden"] @ p["weight"].T
            grad_hidden = logits @ p["weight"]
            grad_weight = logits.T @ p["hidden"]
            return float(grad_hidden[0, 0] + grad_weight[0, 0]) * 0.0
    elif args.method == "torch_naive":
        def call():
            hidden = p["hidden"].clone().requires_grad_()
            weight = p["weight"].clone().requires_grad_()
            loss = naive_loss(p, hidden, weight, args.loss)
            loss.backward()
            return loss.item()
    elif args.method == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
        module = LigerFusedLinearGRPOLoss(beta=BETA, compiled=False, use_ref_model=True,
                                          epsilon_low=EPS, epsilon_high=EPS, loss_type="dapo",
                                          importance_sampling_level=(
                                              "sequence" if args.loss == "gspo" else "token"))

        def call():
            hidden = p["hidden"].view(args.b, args.t, args.h).clone().requires_grad_()
            weight = p["weight"].clone().requires_grad_()
            out = module(hidden, weight, p["tokens"].view(args.b, args.t), p["mask"],
                         p["advantages"], ref_per_token_logps=p["ref"].view(args.b, args.t),
                         old_per_token_logps=p["old"].view(args.b, args.t))
            loss = out[0] if isinstance(out, tuple) else out
            loss.backward()
            return loss.item()
    else:
        import numpy as np
        import lossd
        client = lossd.Client(args.address, timeout=3600)
        client.upload_head("rl", p["weight"].numpy(), replace=True)
        labels = p["tokens"].numpy().copy()
        labels[p["mask"].reshape(-1).numpy() == 0] = -100
        a = p["advantages"].repeat_interleave(args.t).numpy()
        hidden = np.ascontiguousarray(p["hidden"].numpy())

        def call():
            result = client.compute(
                "rl", hidden, labels, objective=args.loss, clip_low=EPS, clip_high=EPS,
                sequence_lengths=[args.t] * args.b,
                kl_estimator="k3", kl_coef=BETA, sampling_logprobs=p["old"].numpy(),
                advantages=a, reference_logprobs=p["ref"].numpy(), outputs=["grad_hidden"],
                accumulate_grad_weight=True)
            client.zero_grad("rl")
            return result.loss

    # Each process's peak from here on: the inputs, the libraries and (for lossd) the head's
    # upload are what it held before; the calls' memory is what they add.
    pids = ["self"] + ([str(args.server_pid)] if args.server_pid else [])
    baselines = [reset_peak(pid) for pid in pids]
    loss = call()  # warm-up
    seconds = []
    for _ in range(args.reps):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    extra = [max(peak_resident_bytes(pid) - base, 0) for pid, base in zip(pids, baselines)]
    print(json.dumps(dict(method=args.method, loss_name=args.loss, b=args.b, t=args.t, h=args.h,
                          v=args.v, n=n,
                          seconds=statistics.median(seconds), loss=loss, extra_bytes=extra[0],
                          **({"server_extra_bytes": extra[1]} if len(extra) > 1 else {}))))


def status_bytes(pid, key):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {key}")


def reset_peak(pid):
    """Resets the process's peak resident memory to what it holds now (Linux: clear_refs 5), and
    returns that."""
    with open(f"/proc/{pid}/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return status_bytes(pid, "VmRSS:")


def peak_resident_bytes(pid):
    return status_bytes(pid, "VmHWM:")


class Server:
    def __init__(self, budget_mib):
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix="lossd-rl-bench-", suffix=".log")
        self.process = subprocess.Popen(
            [os.path.join(REPO, "build", "bin", "lossd_server"), f"--listen={self.address}",
             "--metrics_listen=", "--device=cpu", "--demo_vocab_size=16", "--demo_hidden_size=8",
             f"--workspace_budget_mib={budget_mib}"], stdout=self.log, stderr=subprocess.STDOUT)
        sys.path.insert(0, os.path.join(REPO, "build", "python"))
        import lossd
        with lossd.Client(self.address) as client:
            deadline = time.monotonic() + 60
            while True:
                try:
                    client.list_heads()
                    return
                except lossd.LossdError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        self.log.seek(0)
                        raise RuntimeError("lossd_server did not start:\n" +
                                           self.log.read().decode()) from None
                    time.sleep(0.2)

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=60)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="8,256,1024,32000;4,256,1024,128256",
                        help="B,T,H,V quadruples separated by ';'")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--loss", choices=("ppo", "gspo"), default="ppo")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--budget-mib", type=int, default=1024)
    parser.add_argument("--out", default="")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--address", default="", help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", type=int, default=0, help=argparse.SUPPRESS)
    for name in "bthv":
        parser.add_argument(f"--{name}", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.method = args.worker
        worker(args)
        return
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "build", "python"))
    server = Server(args.budget_mib) if "lossd" in args.methods.split(",") else None
    lines = []
    try:
        for shape in filter(None, args.shapes.split(";")):
            b, t, h, v = (int(x) for x in shape.split(","))
            for method in args.methods.split(","):
                argv = [sys.executable, os.path.abspath(__file__), "--worker", method,
                        f"--b={b}", f"--t={t}", f"--h={h}", f"--v={v}", f"--reps={args.reps}",
                        f"--loss={args.loss}",
                        f"--address={server.address if server else ''}",
                        f"--server-pid={server.process.pid if method == 'lossd' else 0}"]
                done = subprocess.run(argv, capture_output=True, text=True, env=env)
                if done.returncode != 0:
                    entry = dict(method=method, b=b, t=t, h=h, v=v, n=b * t,
                                 error=done.stderr.strip().splitlines()[-1:])
                else:
                    entry = json.loads(done.stdout.strip().splitlines()[-1])
                print(json.dumps(entry), flush=True)
                lines.append(entry)
    finally:
        if server is not None:
            server.stop()
    table = ["| B, T, H, V | method | seconds | x floor | x torch naive | extra GiB | "
             "loss rel. diff to torch_naive |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for shape in sorted({(e["b"], e["t"], e["h"], e["v"]) for e in lines},
                        key=lambda s: (s[3], s[0])):
        rows = [e for e in lines if (e["b"], e["t"], e["h"], e["v"]) == shape]
        by = {e["method"]: e for e in rows if "seconds" in e}
        floor = by.get("torch_floor", {}).get("seconds")
        naive = by.get("torch_naive", {})
        for e in rows:
            if "seconds" not in e:
                table.append(f"| {', '.join(map(str, shape))} | {e['method']} | failed: "
                             f"{' '.join(e['error'])} | | | | |")
                continue
            extra = e["extra_bytes"] / GIB
            memory = (f"{extra:.2f} + server {e['server_extra_bytes'] / GIB:.2f}"
                      if "server_extra_bytes" in e else f"{extra:.2f}")
            diff = ("-" if e["method"] in ("torch_floor", "torch_naive") or "loss" not in naive
                    else f"{abs(e['loss'] - naive['loss']) / abs(naive['loss']):.1e}")
            table.append(
                f"| {', '.join(map(str, shape))} | {e['method']} | {e['seconds']:.3f} | "
                f"{e['seconds'] / floor:.2f} | {e['seconds'] / naive['seconds']:.2f} | "
                f"{memory} | {diff} |" if floor and naive else
                f"| {', '.join(map(str, shape))} | {e['method']} | {e['seconds']:.3f} | | | "
                f"{memory} | {diff} |")
    print("\n".join(table))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.jsonl"), "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in lines)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
