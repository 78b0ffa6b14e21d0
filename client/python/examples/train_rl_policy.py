"""Trains a toy policy with PPO (GRPO's group advantages) on a lossd head, with a KL penalty to a
frozen reference policy, and prints the reward as it rises.

The task: given a prompt token p, answer with LENGTH tokens; the reward is the fraction of them
that equal (p + t) mod V at position t. The policy is a small body (prompt and position
embeddings, an MLP) whose hidden states go to an lm_head W [V, H] living on the server. Each
iteration:

1. rollout: the server scores every position's whole distribution (top_k = V, no gradient) and
   the client samples the answers, keeping each sampled token's log-probability (what an
   inference engine such as vLLM reports);
2. rewards, and GRPO's advantages: each answer's reward against its group's (the answers to the
   same prompt), normalized, given to each of its tokens;
3. reference log-probabilities from a frozen copy of the initial policy: the body kept here, the
   head uploaded once as "<head>-reference";
4. PPO epochs on the same rollout: one Compute call each computes the clipped objective, the k3
   KL penalty, the gradients for the hidden states and for W, with the clip fraction and mean KL
   for the dashboard; then the body's optimizer steps here and the head's AdamW on the server.

The trainer never materializes a logit. Start a server first (e.g. `build/bin/lossd_server
--device=cpu --metrics_listen=`), then, from this folder (lossd comes from the build when it is
not installed): /usr/bin/python3 train_rl_policy.py [--address HOST:PORT] [--iterations N]. The
default 40 iterations took about 15 s here on 2 cores; the mean reward
went from about 1 / V (0.07 to 0.08 over the first 5 iterations, seeds 1, 2, 5, 7) to 0.42 to
0.53 over the last 5, with a quarter to a half of the tokens clipped in the early epochs.
"""
import argparse
import copy
import dataclasses
import os
from typing import List

import numpy as np
import torch

import _lossd_from_checkout  # noqa: F401  (lossd from the build when it is not installed)
import lossd
from lossd.torch import RemoteHead


class PolicyBody(torch.nn.Module):
    """Hidden states [batch, length, width] for prompts [batch]: prompt and position embeddings
    through an MLP."""

    def __init__(self, num_prompts, length, width):
        super().__init__()
        self.prompt = torch.nn.Embedding(num_prompts, width)
        self.position = torch.nn.Embedding(length, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                                       torch.nn.Linear(2 * width, width))
        self.length = length

    def forward(self, prompts):
        positions = torch.arange(self.length)
        x = self.prompt(prompts)[:, None, :] + self.position(positions)[None, :, :]
        return self.mlp(x)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--head", default="rl-policy")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--vocab", type=int, default=16)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--length", type=int, default=6, help="tokens per answer")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per iteration")
    parser.add_argument("--group", type=int, default=8, help="answers per prompt")
    parser.add_argument("--ppo-epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--kl-coef", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


@dataclasses.dataclass
class Iteration:
    reward: float         # mean reward of the iteration's rollout
    loss: float           # the last PPO epoch's loss
    clip_fraction: float  # of the last PPO epoch
    mean_kl: float        # k3 KL to the reference, last PPO epoch


def rollout(head, hidden, rng):
    """Answers sampled from the head's distribution at each row of hidden [N, H], and the
    sampled tokens' log-probabilities."""
    vocab = head.info().vocab_size
    with torch.no_grad():
        scores = head.score(hidden, torch.zeros(hidden.shape[0], dtype=torch.int64),
                            top_k=vocab)
    probabilities = scores.top_k_logprob.double().exp()
    choice = torch.multinomial(probabilities, 1, generator=rng)[:, 0]
    rows = torch.arange(hidden.shape[0])
    return scores.top_k_token[rows, choice], scores.top_k_logprob[rows, choice]


def train(args, client) -> List[Iteration]:
    torch.manual_seed(args.seed)
    rng = torch.Generator().manual_seed(args.seed)
    body = PolicyBody(args.vocab, args.length, args.width)
    reference_body = copy.deepcopy(body).requires_grad_(False)
    weight = torch.randn(args.vocab, args.width) / np.sqrt(args.width)
    head = RemoteHead.upload(client, args.head, weight, replace=True)
    reference = RemoteHead.upload(client, args.head + "-reference", weight, replace=True)
    optimizer = torch.optim.AdamW(body.parameters(), lr=args.lr)
    targets = (torch.arange(args.vocab)[:, None] + torch.arange(args.length)[None, :]) % args.vocab

    history = []
    answers = args.prompts * args.group
    for _ in range(args.iterations):
        prompts = torch.randint(0, args.vocab, (args.prompts,), generator=rng)
        prompts = prompts.repeat_interleave(args.group)  # a group of answers per prompt
        with torch.no_grad():
            hidden = body(prompts).reshape(-1, args.width)
        tokens, sampling_logprobs = rollout(head, hidden, rng)
        tokens = tokens.reshape(answers, args.length)

        rewards = (tokens == targets[prompts]).double().mean(-1)
        grouped = rewards.reshape(args.prompts, args.group)
        advantages = (grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True)
                                                                  + 1e-6)
        token_advantages = advantages.reshape(answers, 1).expand(answers, args.length)
        with torch.no_grad():
            reference_logprobs = reference.score(
                reference_body(prompts).reshape(-1, args.width), tokens.reshape(-1)).logprob

        for _ in range(args.ppo_epochs):
            loss = head(body(prompts), tokens, objective="ppo",
                        sampling_logprobs=sampling_logprobs, advantages=token_advantages,
                        reference_logprobs=reference_logprobs, kl_estimator="k3",
                        kl_coef=args.kl_coef, clip_low=0.2, clip_high=0.28,
                        reduction="seq-mean-token-mean",
                        sequence_lengths=[args.length] * answers)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            head.step("adamw", lr=args.lr, weight_decay=0.0)
        result = head.last_result
        history.append(Iteration(reward=rewards.mean().item(), loss=loss.item(),
                                 clip_fraction=result.clip_fraction, mean_kl=result.mean_kl))
    return history


def main(argv=None):
    args = parse_args(argv)
    with lossd.Client(args.address, timeout=120) as client:
        history = train(args, client)
    print(f"{'iteration':>9} {'reward':>7} {'loss':>9} {'clipped':>8} {'KL':>9}")
    for i, it in enumerate(history):
        print(f"{i:9d} {it.reward:7.3f} {it.loss:9.4f} {it.clip_fraction:8.3f} {it.mean_kl:9.5f}")
    return history


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
