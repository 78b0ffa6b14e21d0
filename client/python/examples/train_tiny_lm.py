"""Trains a tiny byte-level transformer LM twice from the same seed and compares the loss curves.

(A) local:  the body and an nn.Linear lm_head, F.cross_entropy, torch.optim.AdamW for everything.
(B) remote: the same body with the same AdamW locally; the lm_head lives on a lossd server. Its
            initial W (the same as A's) is uploaded, each step is
                loss = RemoteHead(...)(hidden, labels); loss.backward(); body_optimizer.step()
                head.step("adamw", ...)   # the server's AdamW, same hyperparameters
            and the trainer never holds the [N, V] logits, W, its gradient or its AdamW state.

Start a server first, e.g. `build/bin/lossd_server --device=cpu --metrics_listen=` (it listens on
127.0.0.1:50051), then, from this folder:

    /usr/bin/python3 train_tiny_lm.py [--address HOST:PORT] [--steps N] [--quiet]

lossd comes from the build (build/python) when it is not installed; torch from Debian's
python3-torch. On a terminal each run's step and loss are shown on stderr as it trains.

How closely the curves agree. Both runs do the same arithmetic in float32 but not in the same
order (the server's chunked, multithreaded engine against torch's matmul and log-softmax), and the
remote loss is the server's float64 sum rounded to float32, so the losses differ by rounding from
the first step, and AdamW, which divides each update by the root of its second moment, carries
small gradient differences on at relative size. Measured here (2 cores, Debian's torch 1.13,
default settings): max |loss_A - loss_B| over the first 60 steps 2.4e-7 to 4.8e-7 for seeds 0 to
14, i.e. one or two float32 ulps of a loss between 2 and 6; over 300 steps 1.8e-6 to 1.5e-5
(seeds 0 to 4) as training amplifies the rounding slowly. tests/python/test_training_example.py
runs 60 steps and asserts at most 1e-5: 20x the largest difference measured, yet below what
plausible mistakes give within those 60 steps (measured: the server's AdamW without weight decay
4.7e-5, with eps 1e-6 instead of 1e-8 1.8e-4, with a learning rate 1% off 4.1e-3).

The default run (300 steps each way) took about 2 minutes here on 2 cores: the server does the
head's share of the work, so run B is no slower than run A.
"""
import argparse
import dataclasses
import math
import os
import sys
import time
from typing import List

import torch
import torch.nn.functional as F

import _lossd_from_checkout  # noqa: F401  (lossd from the build when it is not installed)
import lossd
from lossd.torch import RemoteHead

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tiny_corpus.txt")
VOCAB_SIZE = 256  # bytes


class CausalSelfAttention(torch.nn.Module):
    def __init__(self, width, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.num_heads, -1).transpose(1, 2)
                   for t in self.qkv(x).split(width, dim=-1))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        attended = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
        return self.out(attended.transpose(1, 2).reshape(batch, length, width))


class Block(torch.nn.Module):
    def __init__(self, width, num_heads):
        super().__init__()
        self.attention_norm = torch.nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, num_heads)
        self.mlp_norm = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyLMBody(torch.nn.Module):
    """Token and position embeddings, pre-norm transformer blocks, a final LayerNorm: the hidden
    states [batch, length, width] that an lm_head turns into logits."""

    def __init__(self, width, num_layers, num_heads, context):
        super().__init__()
        self.token_embedding = torch.nn.Embedding(VOCAB_SIZE, width)
        self.position_embedding = torch.nn.Embedding(context, width)
        self.blocks = torch.nn.ModuleList(Block(width, num_heads) for _ in range(num_layers))
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def build_model(args):
    """The body and an nn.Linear lm_head, initialized from args.seed (the same in both runs)."""
    torch.manual_seed(args.seed)
    body = TinyLMBody(args.width, args.layers, args.heads, args.context)
    lm_head = torch.nn.Linear(args.width, VOCAB_SIZE, bias=False)
    return body, lm_head


def load_corpus():
    with open(CORPUS, "rb") as f:
        return torch.tensor(list(f.read()), dtype=torch.int64)


def batches(corpus, args):
    """(inputs, next-byte labels) [batch, context] windows at random offsets from args.seed."""
    generator = torch.Generator().manual_seed(args.seed)
    while True:
        starts = torch.randint(0, len(corpus) - args.context - 1, (args.batch_size,),
                               generator=generator)
        windows = torch.stack([corpus[s:s + args.context + 1] for s in starts])
        yield windows[:, :-1], windows[:, 1:]


class StepProgress:
    """A run's step and loss on stderr while it trains: on a terminal one line redrawn in place;
    in a log or a pipe a plain line every tenth of the run, so that a long run is seen to move
    there too; nothing with --quiet (enabled False)."""

    def __init__(self, enabled, terminal=True):
        self.enabled = enabled
        self.terminal = terminal

    @classmethod
    def for_stderr(cls, quiet):
        return cls(not quiet, sys.stderr.isatty())

    def step(self, run, step, steps, loss):
        if not self.enabled:
            return
        if self.terminal:
            sys.stderr.write(f"\r{run}: step {step}/{steps}, loss {loss:.4f}\033[K")
            if step == steps:
                sys.stderr.write("\n")
        elif step == steps or step % max(1, steps // 10) == 0:
            sys.stderr.write(f"{run}: step {step}/{steps}, loss {loss:.4f}\n")
        sys.stderr.flush()


QUIET = StepProgress(False)


def adamw_settings(args):
    return dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=args.weight_decay)


def train_local(args, corpus, progress=QUIET):
    """(A): everything in torch."""
    body, lm_head = build_model(args)
    optimizer = torch.optim.AdamW([*body.parameters(), *lm_head.parameters()],
                                  **adamw_settings(args))
    losses = []
    data = batches(corpus, args)
    for _ in range(args.steps):
        inputs, labels = next(data)
        logits = lm_head(body(inputs))  # [batch, context, V]: what (B) never materializes
        loss = F.cross_entropy(logits.view(-1, VOCAB_SIZE), labels.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        progress.step("(A) local head", len(losses), args.steps, losses[-1])
    return losses


def train_remote(args, corpus, client, progress=QUIET):
    """(B): the body in torch, the lm_head on the lossd server. Returns the losses, the trained
    body and its RemoteHead."""
    body, lm_head = build_model(args)
    head = RemoteHead.upload(client, args.head, lm_head.weight, replace=True)
    optimizer = torch.optim.AdamW(body.parameters(), **adamw_settings(args))
    losses = []
    data = batches(corpus, args)
    for _ in range(args.steps):
        inputs, labels = next(data)
        loss = head(body(inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # hidden's gradient flows into the body; dL/dW stays on the server
        optimizer.step()
        head.step("adamw", **adamw_settings(args))
        losses.append(loss.item())
        progress.step("(B) lossd head", len(losses), args.steps, losses[-1])
    return losses, body, head


@dataclasses.dataclass
class Comparison:
    local_losses: List[float]
    remote_losses: List[float]
    local_seconds: float
    remote_seconds: float

    @property
    def max_abs_difference(self):
        return max(abs(a - b) for a, b in zip(self.local_losses, self.remote_losses))


def compare(args, client, progress=QUIET):
    corpus = load_corpus()
    start = time.perf_counter()
    local_losses = train_local(args, corpus, progress)
    local_seconds = time.perf_counter() - start
    start = time.perf_counter()
    remote_losses, _, _ = train_remote(args, corpus, client, progress)
    remote_seconds = time.perf_counter() - start
    return Comparison(local_losses, remote_losses, local_seconds, remote_seconds)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", default="127.0.0.1:50051", help="the lossd server")
    parser.add_argument("--head", default="tiny-lm", help="name of the head to (re)create")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--print-every", type=int, default=10)
    parser.add_argument("--quiet", action="store_true",
                        help="no per-step progress on stderr")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    body, lm_head = build_model(args)
    parameters = sum(p.numel() for p in [*body.parameters(), *lm_head.parameters()])
    print(f"tiny byte-level LM: {parameters / 1e6:.2f}M parameters, {args.steps} steps of "
          f"{args.batch_size}x{args.context} tokens, AdamW lr {args.lr}")
    progress = StepProgress.for_stderr(args.quiet)
    with lossd.Client(args.address, timeout=120) as client:
        result = compare(args, client, progress)
    print(f"{'step':>6} {'local loss':>12} {'lossd loss':>12} {'difference':>12}")
    for step, (a, b) in enumerate(zip(result.local_losses, result.remote_losses)):
        if step % args.print_every == 0 or step == args.steps - 1:
            print(f"{step:>6} {a:>12.6f} {b:>12.6f} {b - a:>12.2e}")
    print(f"max |local - lossd| over {args.steps} steps: {result.max_abs_difference:.2e}")
    print(f"time: local {result.local_seconds:.1f} s, with lossd {result.remote_seconds:.1f} s")
    tokens = args.batch_size * args.context
    logits_bytes = tokens * VOCAB_SIZE * 4
    head_state_bytes = 4 * VOCAB_SIZE * args.width * 4
    print(f"not held by the trainer: {logits_bytes:,} bytes of float32 logits per step "
          f"(N*V*4, N={tokens}, V={VOCAB_SIZE}), and {head_state_bytes:,} bytes of lm_head weight, "
          f"gradient and AdamW moments (4*V*H*4, H={args.width})")
    return result


if __name__ == "__main__":
    main()
