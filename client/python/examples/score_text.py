"""Prints the log-probability of every byte of a text under a tiny LM whose lm_head is on lossd.

The tiny LM of train_tiny_lm.py is trained for a few seconds with its head on the server (the same
loop as that example's run B), then the text is scored: for each byte, log p(byte | the bytes
before it), the model's top-3 guesses and the entropy of its prediction, all computed by the
server's Score path (RemoteHead.score) from the body's hidden states. Scoring accumulates nothing.

Start a server first (`build/bin/lossd_server --device=cpu --metrics_listen=`), then, from this
folder (lossd comes from the build when it is not installed):
    /usr/bin/python3 score_text.py [--address HOST:PORT] [--text "..."] [--train-steps N] [--quiet]
"""
import argparse
import math

import torch

import _lossd_from_checkout  # noqa: F401  (lossd from the build when it is not installed)
import lossd
import train_tiny_lm


def printable(byte):
    """A byte as a quoted character ('a', ' ', '\\n'), or its hex escape beyond ASCII."""
    return repr(chr(byte)) if byte < 128 else f"'\\x{byte:02x}'"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--text", default="The keeper climbed the steps and lit the lamp.")
    parser.add_argument("--train-steps", type=int, default=80)
    parser.add_argument("--quiet", action="store_true",
                        help="no training progress on stderr")
    args = parser.parse_args(argv)
    training = train_tiny_lm.parse_args(["--steps", str(args.train_steps),
                                         "--head", "tiny-lm-scorer"])
    text = torch.tensor(list(args.text.encode("utf-8")), dtype=torch.int64)
    if not 2 <= len(text) <= training.context + 1:
        parser.error(f"--text: expected 2 to {training.context + 1} bytes, got {len(text)}")

    with lossd.Client(args.address, timeout=120) as client:
        corpus = train_tiny_lm.load_corpus()
        progress = train_tiny_lm.StepProgress.for_stderr(args.quiet)
        losses, body, head = train_tiny_lm.train_remote(training, corpus, client, progress)
        print(f"trained {args.train_steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        body.eval()
        with torch.no_grad():
            hidden = body(text[None, :-1])[0]  # [length - 1, width]: predicts bytes 1..
        scores = head.score(hidden, text[1:], top_k=3, entropy=True)

    print(f"{'byte':>6} {'log p':>8} {'entropy':>8}  top-3 guesses")
    for i, byte in enumerate(text[1:].tolist()):
        guesses = "  ".join(f"{printable(t):>6} {lp:6.2f}" for t, lp in
                            zip(scores.top_k_token[i].tolist(), scores.top_k_logprob[i].tolist()))
        print(f"{printable(byte):>6} {scores.logprob[i].item():8.3f} "
              f"{scores.entropy[i].item():8.3f}  {guesses}")
    total = scores.logprob.sum().item()
    print(f"total log p {total:.2f} nats over {len(text) - 1} bytes: "
          f"{-total / (len(text) - 1) / math.log(2):.3f} bits per byte")


if __name__ == "__main__":
    main()
