"""Tinker's loss functions by name, with their configuration keys and semantics.

A training loop written against Tinker's forward_backward(data, loss_fn, loss_fn_config) keeps its
names and its configuration here:

    options = lossd.tinker.loss_options("ppo", {"clip_low_threshold": 0.9,
                                                "clip_high_threshold": 1.28})
    result = client.compute("main", hidden, target_tokens, options=options,
                            **lossd.tinker.loss_inputs("ppo", loss_fn_inputs),
                            outputs=["logprob", "grad_hidden"], accumulate_grad_weight=True)
    result.loss          # Tinker's loss: the sum over the tokens
    result.logprob       # Tinker's output tensor "logprobs" (target_logprobs)

Tinker's losses (tinker-docs.thinkingmachines.ai/tinker/losses) are sums over the tokens of a
batch: cross_entropy sums -logp * weights; importance_sampling, ppo and cispo sum their policy
terms against the sampler's log-probabilities ("logprobs") and the advantages; dro sums
-(logp * A - beta / 2 (logp - q)^2). lossd computes each as the objective of the same name with
the sum reduction. Configuration keys: clip_low_threshold and clip_high_threshold are the ratio
bounds of ppo and cispo (Tinker's clamp(ratio, low, high)), which lossd holds as
clip_low = 1 - low and clip_high = high - 1; beta is dro's penalty. A key a loss does not take,
or a loss Tinker does not have, is refused with ValueError naming it.
"""
import numpy as np

from lossd.options import LossOptions, PolicyOptions

# Each Tinker loss: the configuration keys it takes, and the loss_fn_inputs it reads besides
# target_tokens (with their names in Client.compute).
_LOSSES = {
    "cross_entropy": ((), {}),
    "importance_sampling": ((), {"logprobs": "sampling_logprobs", "advantages": "advantages"}),
    "ppo": (("clip_low_threshold", "clip_high_threshold"),
            {"logprobs": "sampling_logprobs", "advantages": "advantages"}),
    "cispo": (("clip_low_threshold", "clip_high_threshold"),
              {"logprobs": "sampling_logprobs", "advantages": "advantages"}),
    "dro": (("beta",), {"logprobs": "sampling_logprobs", "advantages": "advantages"}),
}
# Inputs any loss may carry: a token mask or weight (Tinker's "weights"), applied as lossd's
# per-token weights.
_OPTIONAL_INPUTS = {"weights": "weights"}


def _loss(loss_fn):
    if loss_fn not in _LOSSES:
        raise ValueError(f"loss_fn: expected one of {', '.join(_LOSSES)}, got {loss_fn!r}")
    return _LOSSES[loss_fn]


def loss_options(loss_fn, loss_fn_config=None):
    """The LossOptions of Tinker's loss `loss_fn` under `loss_fn_config` (a dict, or None)."""
    keys, _ = _loss(loss_fn)
    config = dict(loss_fn_config or {})
    unknown = sorted(set(config) - set(keys))
    if unknown:
        takes = ", ".join(keys) if keys else "no keys"
        raise ValueError(f"loss_fn_config[{unknown[0]!r}]: {loss_fn} takes {takes}")
    policy = {}
    if "clip_low_threshold" in config:
        low = float(config["clip_low_threshold"])
        if not 0.0 <= low <= 1.0:
            raise ValueError(f"loss_fn_config['clip_low_threshold']: expected a ratio in [0, 1], "
                             f"got {low!r}")
        policy["clip_low"] = 1.0 - low
    if "clip_high_threshold" in config:
        high = float(config["clip_high_threshold"])
        if not high >= 1.0:
            raise ValueError(f"loss_fn_config['clip_high_threshold']: expected a ratio >= 1, "
                             f"got {high!r}")
        policy["clip_high"] = high - 1.0
    if loss_fn == "dro":
        if "beta" not in config:
            raise ValueError("loss_fn_config['beta']: dro needs its penalty's beta")
        policy["dro_beta"] = float(config["beta"])
    return LossOptions(reduction="sum", objective=loss_fn, policy=PolicyOptions(**policy))


def loss_inputs(loss_fn, loss_fn_inputs):
    """Client.compute's per-token keyword arguments from Tinker's loss_fn_inputs (a dict of
    arrays; target_tokens, the labels, is passed to compute apart and not read here)."""
    _, reads = _loss(loss_fn)
    takes = {**_OPTIONAL_INPUTS, **reads}
    unknown = sorted(set(loss_fn_inputs) - set(takes) - {"target_tokens"})
    if unknown:
        raise ValueError(f"loss_fn_inputs[{unknown[0]!r}]: {loss_fn} reads "
                         f"{', '.join(['target_tokens', *takes])}")
    missing = [name for name in reads if name not in loss_fn_inputs]
    if missing:
        raise ValueError(f"loss_fn_inputs[{missing[0]!r}]: {loss_fn} needs it")
    return {takes[name]: np.asarray(values, np.float32) for name, values in loss_fn_inputs.items()
            if name != "target_tokens"}
