"""The demo scenario against a running lossd server: a few training steps on the server-owned
demo head whose loss goes down, a scoring call, and a look at the metrics."""
import argparse
import sys
import urllib.request

import numpy as np

import lossd


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--server", default="127.0.0.1:50051")
    parser.add_argument("--metrics", default="http://127.0.0.1:9464/metrics")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    client = lossd.Client(args.server)
    head = client.list_heads()[0]
    print(f"head '{head.name}': W [{head.vocab_size}, {head.hidden_size}] {head.dtype}, "
          f"version {head.version}, from {head.source}")

    # One fixed batch: the server's AdamW steps on W should drive its loss down.
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((args.tokens, head.hidden_size), dtype=np.float32)
    labels = rng.integers(0, head.vocab_size, args.tokens)
    losses = []
    for step in range(args.steps):
        result = client.compute(head.name, hidden, labels, outputs=["grad_hidden"],
                                accumulate_grad_weight=True)
        info = client.step(head.name, "adamw", lr=1e-2, weight_decay=0.0)
        losses.append(result.loss)
        print(f"step {step}: loss {result.loss:.4f}  |dL/dW| {info.grad_norm:.4f}  "
              f"dL/dh {result.grad_hidden.shape}  compute {result.compute_seconds:.2f} s  "
              f"-> version {info.head_version}")
    if not losses[-1] < losses[0]:
        sys.exit(f"the loss did not go down: {losses}")

    scored = client.score(head.name, hidden[:4], labels[:4], top_k=3, entropy=True)
    print("scoring: token, log p(token), entropy, top-3 (token: log p)")
    for i in range(4):
        top = ", ".join(f"{t}: {p:.2f}" for t, p in zip(scored.top_k_token[i], scored.top_k_logprob[i]))
        print(f"  {labels[i]:6d}  {scored.logprob[i]:8.3f}  {scored.entropy[i]:6.3f}  [{top}]")

    with urllib.request.urlopen(args.metrics, timeout=10) as response:
        metrics = response.read().decode()
    print(f"metrics at {args.metrics}, for example:")
    for line in metrics.splitlines():
        if line.startswith(("lossd_tokens_total", "lossd_memory_bytes", "lossd_logits_bytes_avoided",
                            'lossd_requests_total{code="OK",method="Compute"}', "lossd_head_version")):
            print("  " + line)
    print("Point Prometheus at it with deploy/prometheus/prometheus.yml; Grafana: deploy/grafana/.")


if __name__ == "__main__":
    main()
