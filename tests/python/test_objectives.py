"""The RL objectives through the Python client (RemoteHead, RemoteLogprobs) against torch's float64
autograd of the same formulas, written here the way RL trainers write them (verl's agg_loss for
the reductions), on W fetched from a real lossd_server on loopback.

The server's 1 MiB workspace splits each call into several engine chunks, so sequences cross
chunk boundaries. Bounds: the engine's for the policy objectives (tests/engine_test.cc).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from server_process import demo_server, ensure_python_client

ensure_python_client()
import lossd  # noqa: E402
from lossd.torch import RemoteHead, RemoteLogprobs  # noqa: E402

VOCAB, HIDDEN = 3001, 64
NUM_TOKENS = 300
LOSS_RTOL = 2e-5
GRAD_RTOL = 2e-5
# Ratios 1% or more from the clip bounds 0.8 and 1.28 and the dual-clip bound 3, so that float32
# rounding of logp cannot move a token across one.
RATIO_TARGETS = np.array([0.3, 0.79, 0.81, 1.0, 1.1, 1.27, 1.29, 2.5, 3.2, 0.95])
CLIP_LOW, CLIP_HIGH = 0.2, 0.28


@pytest.fixture(scope="module")
def server():
    with demo_server(VOCAB, HIDDEN, "--workspace_budget_mib=1") as s:
        yield s


@pytest.fixture
def head(new_head):
    return new_head(VOCAB, HIDDEN, prefix="rl")


def relative_error(actual, expected):
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    return ((actual - expected).norm() / expected.norm()).item()


def sequences(num_tokens, rng):
    """Random lengths in [1, 60] summing to num_tokens."""
    lengths = []
    while sum(lengths) < num_tokens:
        lengths.append(min(int(rng.integers(1, 61)), num_tokens - sum(lengths)))
    return lengths


def torch_logits(hidden, weight, temperature=1.0, logit_softcap=0.0):
    logits = hidden @ weight.T
    if logit_softcap:
        logits = logit_softcap * torch.tanh(logits / logit_softcap)
    return logits / temperature


def agg_loss(loss_mat, mask, mode, lengths):
    """verl's agg_loss on a packed batch: token-mean, seq-mean-token-sum, seq-mean-token-mean
    (fully masked sequences left out), sum and none."""
    if mode == "none":
        return loss_mat * mask
    if mode == "sum":
        return (loss_mat * mask).sum()
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    seq_losses = torch.stack([x.sum() for x in torch.split(loss_mat * mask, lengths)])
    seq_counts = torch.stack([m.sum() for m in torch.split(mask, lengths)])
    seq_mask = (seq_counts > 0).double()
    if mode == "seq-mean-token-mean":
        seq_losses = seq_losses / seq_counts.clamp(min=1)
    return (seq_losses * seq_mask).sum() / seq_mask.sum()


def torch_policy_loss(hidden, weight, labels, inputs, spec, lengths):
    """Loss, dL/dh, dL/dW and per-token (ratio, clipped, kl) in float64 autograd."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    log_probs = F.log_softmax(torch_logits(h, w), dim=-1)
    mask = (labels != -100).double()
    logp = log_probs.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    q = torch.as_tensor(inputs["sampling_logprobs"]).double()
    a = torch.as_tensor(inputs["advantages"]).double()
    ratio = torch.exp(logp - q)
    clipped_ratio = torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH)
    clipped = torch.zeros_like(ratio, dtype=torch.bool)
    objective = spec["objective"]
    if objective == "importance_sampling":
        term = -ratio * a
    elif objective == "ppo":
        unclipped_loss, clipped_loss = -a * ratio, -a * clipped_ratio
        term = torch.maximum(unclipped_loss, clipped_loss)
        clipped = clipped_loss > unclipped_loss
        if spec.get("dual_clip"):
            bound = -a * spec["dual_clip"]
            dual = (a < 0) & (term > bound)
            term = torch.where(a < 0, torch.minimum(term, bound), term)
            clipped = clipped | dual
    elif objective == "cispo":  # the clipped ratio is a constant weight
        term = -clipped_ratio.detach() * a * logp
        clipped = (ratio > 1 + CLIP_HIGH) | (ratio < 1 - CLIP_LOW)
    elif objective == "dro":
        # Tinker's DRO (tinker-docs.thinkingmachines.ai/tinker/losses/dro), per token:
        #   quadratic_term = (target_logprobs - sampling_logprobs) ** 2
        #   dro_objective = target_logprobs * advantages - 0.5 * beta * quadratic_term
        #   loss = -dro_objective; it reports no ratio.
        term = -(logp * a - 0.5 * spec["dro_beta"] * (logp - q) ** 2)
        ratio = torch.zeros_like(ratio)
    else:  # sapo (arXiv 2511.20347; verl's "sapo"): a soft gate, its temperature by A's sign
        tau = torch.where(a > 0, spec["sapo_tau_positive"], spec["sapo_tau_negative"])
        term = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a
    rho = torch.ones_like(logp)
    if spec.get("rollout_correction"):
        # verl's rollout_is (trainer/ppo/mismatch_helper.py, truncated importance sampling):
        # log_ratio = old_log_prob - rollout_log_prob; per token, or its masked sum ("sequence")
        # or mean ("geometric") over each sequence; weights = exp(.) clamped at the threshold,
        # detached, multiplying pg_losses.
        log_ratio = (q - torch.as_tensor(inputs["rollout_logprobs"]).double()) * mask
        if spec["rollout_correction"] != "token":
            sums = [x.sum() for x in torch.split(log_ratio, lengths)]
            counts = [m.sum().clamp(min=1) for m in torch.split(mask, lengths)]
            per_sequence = [t / c if spec["rollout_correction"] == "geometric" else t
                            for t, c in zip(sums, counts)]
            log_ratio = torch.cat([v.expand(n) for v, n in zip(per_sequence, lengths)])
        rho = torch.exp(log_ratio).clamp(max=spec.get("rollout_is_cap", 2.0)).detach()
        term = term * rho
    kl = torch.zeros_like(logp)
    if spec.get("kl_estimator"):
        delta = torch.as_tensor(inputs["reference_logprobs"]).double() - logp
        kl = {"k1": -delta, "k2": 0.5 * delta ** 2,
              "k3": torch.exp(delta) - delta - 1}[spec["kl_estimator"]]
        if spec.get("kl_ratio_weighted"):
            # DeepSeek-V3.2's unbiased KL estimate: pi_theta / pi_old times k3, through both.
            kl = torch.exp(logp - q) * kl
    per_token = term + spec.get("kl_coef", 0.0) * kl - spec.get("entropy_coef", 0.0) * entropy
    loss = agg_loss(per_token, mask, spec["reduction"], lengths)
    upstream = spec.get("upstream", 1.0)
    if spec["reduction"] == "none":
        (loss * torch.as_tensor(upstream).double()).sum().backward()
    else:
        (loss * upstream).backward()
    counted = mask.bool()
    stats = dict(clip_fraction=(clipped & counted).double().sum().item() / counted.sum().item(),
                 mean_kl=(kl * mask).sum().item() / counted.sum().item(),
                 ratio=(ratio * mask).detach(), clipped=(clipped & counted),
                 mean_rho=(rho * mask).sum().item() / counted.sum().item(),
                 truncated=((rho >= spec.get("rollout_is_cap", 2.0)) & counted).double().sum()
                 .item() / counted.sum().item(),
                 # The reduction of |loss_i|: the scale a reduced loss's rounding error follows
                 # when advantages of both signs make its terms cancel.
                 loss_scale=agg_loss(per_token.detach().abs(), mask, spec["reduction"], lengths))
    return loss.detach(), h.grad, w.grad, stats


CASES = {
    "ppo_dual_k3_entropy_seq_token_mean": dict(
        objective="ppo", dual_clip=3.0, kl_estimator="k3", kl_coef=0.05, entropy_coef=0.01,
        reduction="seq-mean-token-mean"),
    "ppo_upstream_0.37_token_mean": dict(objective="ppo", reduction="token-mean", upstream=0.37),
    "importance_sampling_k1_token_mean": dict(
        objective="importance_sampling", kl_estimator="k1", kl_coef=0.1, reduction="token-mean"),
    "cispo_k2_entropy_seq_token_sum": dict(
        objective="cispo", kl_estimator="k2", kl_coef=0.1, entropy_coef=0.02,
        reduction="seq-mean-token-sum"),
    "ppo_none_random_upstream": dict(objective="ppo", kl_estimator="k3", kl_coef=0.05,
                                     reduction="none", upstream="random"),
    "dro_seq_token_sum": dict(objective="dro", dro_beta=0.5, reduction="seq-mean-token-sum"),
    "ppo_ratio_weighted_k3": dict(objective="ppo", kl_estimator="k3", kl_coef=0.1,
                                  kl_ratio_weighted=True, reduction="token-mean"),
    "ppo_rollout_token_k3": dict(objective="ppo", rollout_correction="token", rollout_is_cap=1.5,
                                 kl_estimator="k3", kl_coef=0.05, reduction="token-mean"),
    "cispo_rollout_sequence": dict(objective="cispo", rollout_correction="sequence",
                                   rollout_is_cap=3.0, reduction="seq-mean-token-mean"),
    "sapo_rollout_geometric": dict(objective="sapo", sapo_tau_positive=1.0,
                                   sapo_tau_negative=1.05, rollout_correction="geometric",
                                   rollout_is_cap=1.02, reduction="seq-mean-token-sum"),
    "sapo_k3_token_mean": dict(objective="sapo", sapo_tau_positive=0.9, sapo_tau_negative=1.2,
                               kl_estimator="k3", kl_coef=0.05, reduction="token-mean"),
}
# The objectives whose terms clip (ppo's branches, cispo's weight); the others never do.
CLIPPING = ("ppo", "cispo")


def policy_batch(head, rng):
    """Rows, labels (40 ignored, and the whole second sequence), packed sequence lengths, the
    head's W and every token's exact log-probability under it."""
    hidden = torch.randn(NUM_TOKENS, HIDDEN)
    labels = torch.randint(0, VOCAB, (NUM_TOKENS,))
    labels[torch.randperm(NUM_TOKENS)[:40]] = -100
    lengths = sequences(NUM_TOKENS, rng)
    labels[lengths[0]:lengths[0] + lengths[1]] = -100  # a sequence with nothing to learn from
    weight = head.fetch_weight()
    exact_logp = F.log_softmax(torch_logits(hidden.double(), weight.double()), -1).gather(
        1, labels.clamp(min=0)[:, None])[:, 0].numpy()
    return hidden, labels, lengths, weight, exact_logp


@pytest.mark.parametrize("shared_memory", [False, True], ids=["messages", "shared_memory"])
@pytest.mark.parametrize("case", CASES)
def test_policy_objectives_match_torch(client, head, case, shared_memory):
    spec = dict(CASES[case])
    rng = np.random.default_rng()
    hidden, labels, lengths, weight, exact_logp = policy_batch(head, rng)
    inputs = dict(
        sampling_logprobs=(exact_logp - np.log(RATIO_TARGETS[np.arange(NUM_TOKENS) % 10]))
        .astype(np.float32),
        advantages=np.where(np.arange(NUM_TOKENS) % 5 == 4, 0.0,
                            rng.uniform(-2, 2, NUM_TOKENS)).astype(np.float32),
        reference_logprobs=(exact_logp + rng.normal(0, 0.5, NUM_TOKENS)).astype(np.float32))
    # The inference engine's log-probabilities: near the old policy's, so that some weights stay
    # under the cap and some are truncated.
    inputs["rollout_logprobs"] = (inputs["sampling_logprobs"] + rng.normal(0, 0.3, NUM_TOKENS)
                                  ).astype(np.float32)
    if spec.get("upstream") == "random":
        spec["upstream"] = torch.randn(NUM_TOKENS).numpy()
    # The reference sees the float32 values that travel.
    inputs = {name: values.astype(np.float64).astype(np.float32) for name, values in
              inputs.items()}

    remote_hidden = hidden.clone().requires_grad_()
    remote_head = RemoteHead(client, head.head, shared_memory=shared_memory)
    kwargs = {k: v for k, v in spec.items() if k not in ("reduction", "upstream")}
    loss = remote_head(remote_hidden, labels, reduction=spec["reduction"],
                       sampling_logprobs=inputs["sampling_logprobs"],
                       advantages=inputs["advantages"],
                       reference_logprobs=(inputs["reference_logprobs"]
                                           if spec.get("kl_estimator") else None),
                       rollout_logprobs=(inputs["rollout_logprobs"]
                                         if spec.get("rollout_correction") else None),
                       sequence_lengths=lengths, clip_low=CLIP_LOW, clip_high=CLIP_HIGH,
                       **kwargs)
    result = remote_head.last_result
    upstream = spec.get("upstream", 1.0)
    if spec["reduction"] == "none":
        (loss * torch.as_tensor(upstream, dtype=loss.dtype)).sum().backward()
    else:
        (loss * upstream).backward()

    expected_loss, expected_grad_hidden, expected_grad_weight, stats = torch_policy_loss(
        hidden, weight, labels, inputs, spec, lengths)
    assert loss.shape == expected_loss.shape
    if spec["reduction"] == "none":
        assert relative_error(loss.detach(), expected_loss) < LOSS_RTOL
    else:
        assert abs(loss.item() - expected_loss.item()) <= LOSS_RTOL * (
            stats["loss_scale"].item() + 1e-3)
    assert relative_error(remote_hidden.grad, expected_grad_hidden) < GRAD_RTOL
    assert relative_error(head.fetch_grad_weight(), expected_grad_weight) < GRAD_RTOL
    counted = labels != -100
    assert result.counted_tokens == counted.sum().item()
    assert result.clip_fraction == pytest.approx(stats["clip_fraction"], abs=1e-12)
    assert (result.clip_fraction > 0) == (spec["objective"] in CLIPPING)
    assert np.array_equal(result.clip != lossd.CLIP_NONE, stats["clipped"].numpy())
    if spec["objective"] == "dro":
        assert not result.ratio.any()
    else:
        assert relative_error(result.ratio, stats["ratio"]) < 1e-5
    if spec.get("kl_estimator"):
        assert result.mean_kl == pytest.approx(stats["mean_kl"], rel=1e-4, abs=1e-6)
    if spec.get("rollout_correction"):
        assert result.mean_rollout_is_weight == pytest.approx(stats["mean_rho"], rel=1e-6)
        assert result.rollout_is_truncated_fraction == pytest.approx(stats["truncated"],
                                                                     abs=1e-12)
        if spec["rollout_correction"] == "token":  # 9% of the tokens past 1.5, on average
            assert 0 < stats["truncated"] < 1


def verl_gspo_loss(hidden, weight, labels, q, a, lengths):
    """verl's policy loss "gspo" (verl/trainer/ppo/core_algos.py, compute_policy_loss_gspo) on a
    packed batch in float64 autograd: the sequence's mean log-ratio over its response tokens,
    carried on every token by log s_it = logp - sg(logp) + sg(mean), clamped at 10, clipped as
    ppo is, aggregated seq-mean-token-mean. Returns the loss, dL/dh, dL/dW, the ratios and which
    tokens the clipped branch held."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logp = F.log_softmax(torch_logits(h, w), dim=-1).gather(1, labels.clamp(min=0)[:, None])[:, 0]
    mask = (labels != -100).double()
    negative_approx_kl = logp - torch.as_tensor(q).double()
    sums = [x.sum() for x in torch.split(negative_approx_kl * mask, lengths)]
    counts = [m.sum().clamp(min=1) for m in torch.split(mask, lengths)]
    sequence_mean = torch.cat([(t / c).expand(n) for t, c, n in zip(sums, counts, lengths)])
    log_ratio = torch.clamp(logp - logp.detach() + sequence_mean.detach(), max=10.0)
    ratio = torch.exp(log_ratio)
    advantages = torch.as_tensor(a).double()
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH)
    loss = agg_loss(torch.maximum(losses1, losses2), mask, "seq-mean-token-mean", lengths)
    loss.backward()
    return loss.detach(), h.grad, w.grad, ratio.detach(), (losses2 > losses1) & mask.bool()


@pytest.mark.parametrize("long_sequence", [False, True], ids=["one_pass", "two_passes"])
@pytest.mark.parametrize("shared_memory", [False, True], ids=["messages", "shared_memory"])
def test_gspo_matches_verl(client, head, shared_memory, long_sequence):
    """GSPO-token: each sequence's ratio the geometric mean of its tokens', set per sequence on
    both sides of the clip bounds; advantages vary within sequences (GSPO-token's generality).
    Sequences of at most 60 rows fit the server's engine chunks of 64 rows (1 MiB of workspace
    at this head), which then end at sequence ends and finish each sequence in one pass; a
    sequence of 150 rows makes the call measure every ratio in a pass of its own first."""
    rng = np.random.default_rng()
    hidden, labels, lengths, weight, exact_logp = policy_batch(head, rng)
    if long_sequence:
        lengths = sequences(NUM_TOKENS - 150, rng) + [150]
    # Token log-ratios that scatter around their sequence's target, centred on it over the
    # sequence's counted tokens, so that s_i is the target itself.
    counted = (labels != -100).numpy()
    q = np.empty(NUM_TOKENS)
    first = 0
    for i, length in enumerate(lengths):
        span = slice(first, first + length)
        noise = rng.normal(0, 0.3, length)
        if counted[span].any():
            noise -= noise[counted[span]].mean()
        q[span] = exact_logp[span] - np.log(RATIO_TARGETS[i % 10]) - noise
        first += length
    q = q.astype(np.float32)
    a = np.where(np.arange(NUM_TOKENS) % 5 == 4, 0.0,
                 rng.uniform(-2, 2, NUM_TOKENS)).astype(np.float32)

    remote_hidden = hidden.clone().requires_grad_()
    remote_head = RemoteHead(client, head.head, shared_memory=shared_memory)
    loss = remote_head(remote_hidden, labels, reduction="seq-mean-token-mean", objective="gspo",
                       sampling_logprobs=q, advantages=a, sequence_lengths=lengths,
                       clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
    loss.backward()
    result = remote_head.last_result
    expected_loss, expected_grad_hidden, expected_grad_weight, ratio, clipped = verl_gspo_loss(
        hidden, weight, labels, q, a, lengths)
    assert abs(loss.item() - expected_loss.item()) <= LOSS_RTOL * (abs(expected_loss.item()) + 1e-3)
    assert relative_error(remote_hidden.grad, expected_grad_hidden) < GRAD_RTOL
    assert relative_error(head.fetch_grad_weight(), expected_grad_weight) < GRAD_RTOL
    mask = torch.as_tensor(counted)
    assert relative_error(result.ratio[counted], ratio[mask]) < 1e-5
    assert np.array_equal(result.clip != lossd.CLIP_NONE, clipped.numpy())
    assert 0 < result.clip_fraction < 1


@pytest.mark.parametrize("extra, named", [
    # A sequence's ratio needs the call's sequences.
    ({}, "sequence_lengths: expected the call's sequences with OBJECTIVE_GSPO"),
    # It runs as ppo on the server; its errors still name it as the client did.
    (dict(sequence_lengths=[3, 5], outputs=["kd"]), "objective gspo"),
    # The unbiased KL weights by the token's own ratio, which gspo's sequence ratio replaces.
    (dict(sequence_lengths=[3, 5], kl_estimator="k3", kl_coef=0.1, kl_ratio_weighted=True,
          reference_logprobs=np.zeros(8, np.float32)), "options.policy.kl_ratio_weighted"),
], ids=["no_sequences", "kd_output", "unbiased_kl"])
def test_gspo_refuses_what_it_cannot_compute_by_name(client, head, extra, named):
    with pytest.raises(lossd.LossdError) as error:
        client.compute(head.head, torch.randn(8, HIDDEN).numpy(),
                       torch.randint(0, VOCAB, (8,)).numpy(), objective="gspo",
                       sampling_logprobs=np.zeros(8, np.float32),
                       advantages=np.ones(8, np.float32), **extra)
    assert error.value.code == "INVALID_ARGUMENT"
    assert named in error.value.message


def test_gspo_keeps_rows_only_for_sequences_longer_than_a_chunk():
    """Sequences that fit an engine chunk take gspo's single pass and need no more memory than
    ppo: 16384 rows of 64 fp32 values in sequences of 256 fit a 3 MiB compute budget (1 MiB of
    workspace). One sequence of all 16384 rows outgrows every chunk (at most 4096 rows on the
    CPU): the call then keeps its rows (4 MiB) between two passes, counted against the budget."""
    rows = 16384
    hidden = np.random.default_rng().standard_normal((rows, 64)).astype(np.float32)
    labels = np.arange(rows) % 100
    inputs = dict(sampling_logprobs=np.full(rows, -5.0, np.float32),
                  advantages=np.ones(rows, np.float32))
    with demo_server(100, 64, "--workspace_budget_mib=1", "--compute_memory_mib=3") as server:
        with lossd.Client(server.address, timeout=600) as small:
            for objective in ("ppo", "gspo"):
                result = small.compute("demo", hidden, labels, objective=objective,
                                       sequence_lengths=[256] * (rows // 256), **inputs)
                assert result.counted_tokens == rows
            with pytest.raises(lossd.LossdError) as error:
                small.compute("demo", hidden, labels, objective="gspo", sequence_lengths=[rows],
                              **inputs)
    assert error.value.code == "RESOURCE_EXHAUSTED"
    assert f"{rows * 64 * 4} for the rows a gspo call keeps" in error.value.message


def test_log_ratio_clamp_follows_verl(client, head):
    """log_ratio_clamp=20 clamps log r = logp - q to [-20, 20] before the exponential, as verl's
    ppo loss does, with no gradient through r where the clamp holds; tokens whose exact ratio is
    e^30 or e^-30 then match verl's float64 formula, where without the clamp e^30 is 1e13."""
    rng = np.random.default_rng()
    hidden = torch.randn(NUM_TOKENS, HIDDEN)
    labels = torch.randint(0, VOCAB, (NUM_TOKENS,))
    weight = head.fetch_weight()
    exact_logp = F.log_softmax(torch_logits(hidden.double(), weight.double()), -1).gather(
        1, labels[:, None])[:, 0].numpy()
    offsets = RATIO_TARGETS[np.arange(NUM_TOKENS) % 10]
    q = exact_logp - np.log(offsets)
    q[:5] = exact_logp[:5] - 30.0   # r = e^30: clamped to e^20
    q[5:10] = exact_logp[5:10] + 30.0  # r = e^-30: clamped to e^-20
    q = q.astype(np.float32)
    a = rng.uniform(-2, 2, NUM_TOKENS).astype(np.float32)
    head.zero_grad()
    result = client.compute(head.head, hidden.numpy(), labels.numpy(), objective="ppo",
                            sampling_logprobs=q, advantages=a, clip_low=CLIP_LOW,
                            clip_high=CLIP_HIGH, log_ratio_clamp=20.0,
                            outputs=["grad_hidden", "ratio"], accumulate_grad_weight=True)

    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    logp = F.log_softmax(torch_logits(h, w), -1).gather(1, labels[:, None])[:, 0]
    ratio = torch.exp(torch.clamp(logp - torch.as_tensor(q).double(), -20.0, 20.0))
    advantage = torch.as_tensor(a).double()
    term = torch.maximum(-advantage * ratio,
                         -advantage * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH))
    loss = term.mean()
    loss.backward()
    assert abs(result.loss - loss.item()) <= LOSS_RTOL * (term.detach().abs().mean().item() + 1e-3)
    assert relative_error(result.ratio, ratio.detach()) < 1e-5
    assert result.ratio[:5] == pytest.approx(np.exp(20.0), rel=1e-5)
    assert relative_error(result.grad_hidden, h.grad) < GRAD_RTOL
    assert relative_error(head.fetch_grad_weight(), w.grad) < GRAD_RTOL


def test_remote_logprobs_backpropagate_any_loss(client, head):
    """A DPO-style loss on sequence sums of log-probabilities, computed locally: the gradient
    sent back as dL/dlogp gives hidden.grad and the server's dL/dW as torch's autograd does."""
    pairs, length = 6, 25
    hidden = torch.randn(2 * pairs * length, HIDDEN)
    tokens = torch.randint(0, VOCAB, (2 * pairs * length,))
    tokens[::7] = -100  # prompt tokens: no log-probability, no gradient
    reference = torch.randn(2 * pairs, dtype=torch.float64) * 3
    beta = 0.1

    def dpo(logp):
        sums = logp.reshape(2 * pairs, length).sum(-1).double() - reference
        chosen, rejected = sums[:pairs], sums[pairs:]
        return -F.logsigmoid(beta * (chosen - rejected)).mean()

    remote_hidden = hidden.clone().requires_grad_()
    logp = RemoteLogprobs(client, head.head)(remote_hidden, tokens)
    assert logp.shape == tokens.shape and logp.requires_grad
    loss = dpo(logp)
    loss.backward()

    h = hidden.double().requires_grad_()
    w = head.fetch_weight().double().requires_grad_()
    log_probs = F.log_softmax(h @ w.T, -1).gather(1, tokens.clamp(min=0)[:, None])[:, 0]
    expected = dpo(log_probs * (tokens != -100))
    expected.backward()
    assert abs(loss.item() - expected.item()) < 1e-5 * abs(expected.item())
    assert relative_error(remote_hidden.grad, h.grad) < GRAD_RTOL
    assert relative_error(head.fetch_grad_weight(), w.grad) < GRAD_RTOL
    assert not remote_hidden.grad[::7].any()


def test_remote_logprobs_without_autograd_only_score(head):
    hidden = torch.randn(50, HIDDEN)
    tokens = torch.randint(0, VOCAB, (50,))
    with torch.no_grad():
        logp = head.logprobs(hidden, tokens)
    expected = F.log_softmax(hidden.double() @ head.fetch_weight().double().T, -1).gather(
        1, tokens[:, None])[:, 0]
    assert relative_error(logp, expected) < 1e-6
    assert not head.fetch_grad_weight().any()


def test_objective_inputs_are_checked(client, head):
    hidden = np.random.default_rng().standard_normal((10, HIDDEN), dtype=np.float32)
    labels = np.arange(10)
    with pytest.raises(lossd.LossdError) as error:
        client.compute(head.head, hidden, labels, objective="ppo", advantages=np.ones(10))
    assert error.value.code == "INVALID_ARGUMENT"
    assert "sampling_logprobs" in error.value.message
    with pytest.raises(ValueError, match="objective"):
        client.compute(head.head, hidden, labels, objective="grpo")
    with pytest.raises(ValueError, match="advantages"):
        client.compute(head.head, hidden, labels, objective="ppo", advantages=np.ones(9),
                       sampling_logprobs=np.zeros(10))


def tinker_reference(loss_fn, config, logp, inputs):
    """Tinker's losses as its documentation writes them (tinker-docs.thinkingmachines.ai/tinker/
    losses and its pages per loss), per token, summed; the weights applied as a mask."""
    q = torch.as_tensor(inputs.get("logprobs", np.zeros(len(logp)))).double()
    a = torch.as_tensor(inputs.get("advantages", np.zeros(len(logp)))).double()
    weights = torch.as_tensor(inputs.get("weights", np.ones(len(logp)))).double()
    prob_ratio = torch.exp(logp - q)
    low = config.get("clip_low_threshold", 0.8)
    high = config.get("clip_high_threshold", 1.2)
    if loss_fn == "cross_entropy":
        per_token = -logp
    elif loss_fn == "importance_sampling":
        per_token = -(prob_ratio * a)
    elif loss_fn == "ppo":
        clipped_ratio = torch.clamp(prob_ratio, low, high)
        per_token = -torch.min(prob_ratio * a, clipped_ratio * a)
    elif loss_fn == "cispo":
        clipped_ratio = torch.clamp(prob_ratio, low, high)
        per_token = -(clipped_ratio.detach() * logp * a)
    else:  # dro
        per_token = -(logp * a - 0.5 * config["beta"] * (logp - q) ** 2)
    return (per_token * weights).sum()


TINKER_CASES = {
    "cross_entropy_weights": ("cross_entropy", {}),
    "importance_sampling": ("importance_sampling", {}),
    "ppo_thresholds": ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.28}),
    "cispo_default_thresholds": ("cispo", {}),
    "dro_beta": ("dro", {"beta": 0.4}),
}


@pytest.mark.parametrize("case", TINKER_CASES)
def test_tinker_losses_by_name_match_tinkers_definitions(client, head, case):
    """lossd.tinker's options and inputs give Tinker's summed losses, as its documentation defines
    them, with their gradients: a Tinker loss configuration works unchanged."""
    loss_fn, config = TINKER_CASES[case]
    rng = np.random.default_rng()
    hidden = torch.randn(NUM_TOKENS, HIDDEN)
    target_tokens = torch.randint(0, VOCAB, (NUM_TOKENS,))
    weight = head.fetch_weight()
    exact_logp = F.log_softmax(torch_logits(hidden.double(), weight.double()), -1).gather(
        1, target_tokens[:, None])[:, 0].numpy()
    inputs = {"weights": (rng.random(NUM_TOKENS) < 0.8).astype(np.float32)}
    if loss_fn != "cross_entropy":
        inputs["logprobs"] = (exact_logp - np.log(RATIO_TARGETS[np.arange(NUM_TOKENS) % 10])
                              ).astype(np.float32)
        inputs["advantages"] = rng.uniform(-2, 2, NUM_TOKENS).astype(np.float32)
    head.zero_grad()
    result = client.compute(head.head, hidden.numpy(), target_tokens.numpy(),
                            options=lossd.tinker.loss_options(loss_fn, config),
                            **lossd.tinker.loss_inputs(loss_fn, inputs),
                            outputs=["logprob", "grad_hidden"], accumulate_grad_weight=True)

    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    logp = F.log_softmax(torch_logits(h, w), -1).gather(1, target_tokens[:, None])[:, 0]
    expected = tinker_reference(loss_fn, config, logp, inputs)
    expected.backward()
    scale = (logp.detach().abs() * (1 + torch.as_tensor(inputs.get("advantages", 0)).abs())
             ).sum().item()
    assert abs(result.loss - expected.item()) <= LOSS_RTOL * scale
    assert relative_error(result.grad_hidden, h.grad) < GRAD_RTOL
    assert relative_error(head.fetch_grad_weight(), w.grad) < GRAD_RTOL
    # Tinker's output tensor "logprobs": every token's, masked or not.
    assert np.abs(result.logprob - exact_logp).max() < 1e-4


@pytest.mark.parametrize("loss_fn, config, inputs, message", [
    ("grpo", {}, {}, "loss_fn: expected one of cross_entropy"),
    ("ppo", {"clip_ratio": 0.2}, {}, "loss_fn_config['clip_ratio']: ppo takes clip_low_threshold"),
    ("cross_entropy", {"beta": 0.1}, {}, "loss_fn_config['beta']: cross_entropy takes no keys"),
    ("dro", {}, {}, "loss_fn_config['beta']: dro needs"),
    ("ppo", {"clip_low_threshold": 1.5}, {}, "clip_low_threshold']: expected a ratio in [0, 1]"),
    ("ppo", {}, {"logprobs": [0.0]}, "loss_fn_inputs['advantages']: ppo needs it"),
    ("cross_entropy", {}, {"advantages": [0.0]}, "loss_fn_inputs['advantages']: cross_entropy reads"),
])
def test_tinker_names_refuse_what_tinker_would_not_take(loss_fn, config, inputs, message):
    with pytest.raises(ValueError) as error:
        lossd.tinker.loss_options(loss_fn, config)
        lossd.tinker.loss_inputs(loss_fn, inputs)
    assert message in str(error.value)


def liger_grpo_aggregate(per_token_loss, attention_mask, loss_type, max_completion_length):
    """Liger-Kernel's LigerFusedLinearGRPOLoss aggregation of a [B, T] batch (chunked_loss/
    grpo_loss.py, by loss_type), and verl's seq-mean-token-sum-norm (core_algos.agg_loss)."""
    masked = per_token_loss * attention_mask
    if loss_type == "grpo":
        return (masked.sum(-1) / attention_mask.sum(-1).clamp(min=1.0)).sum() / masked.shape[0]
    if loss_type in ("bnpo", "dapo"):  # dapo: over the global batch, here this one
        return masked.sum() / attention_mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return masked.sum() / (masked.shape[0] * max_completion_length)
    return masked.sum() / max_completion_length  # seq-mean-token-sum-norm


@pytest.mark.parametrize("loss_type", lossd.options.GRPO_LOSS_TYPES)
def test_grpo_loss_types_aggregate_as_liger_and_verl_do(client, head, loss_type):
    """A [B, T] batch of completions with padding and one completion fully masked, ppo's token
    loss aggregated by each GRPO variant's name, against Liger's formula in float64."""
    batch, length = 6, 50
    rng = np.random.default_rng()
    hidden = torch.randn(batch * length, HIDDEN)
    labels = torch.randint(0, VOCAB, (batch, length))
    for b in range(batch):
        labels[b, int(rng.integers(10, length)):] = -100  # padding after each completion
    labels[2] = -100  # a completion with nothing to learn from
    labels = labels.reshape(-1)
    weight = head.fetch_weight()
    exact_logp = F.log_softmax(torch_logits(hidden.double(), weight.double()), -1).gather(
        1, labels.clamp(min=0)[:, None])[:, 0].numpy()
    q = (exact_logp - np.log(RATIO_TARGETS[np.arange(batch * length) % 10])).astype(np.float32)
    a = rng.uniform(-2, 2, batch * length).astype(np.float32)
    max_completion_length = 64
    keywords = lossd.grpo_loss_type(loss_type, num_sequences=batch,
                                    max_completion_length=max_completion_length)
    remote_hidden = hidden.clone().requires_grad_()
    head.zero_grad()
    loss = RemoteHead(client, head.head)(
        remote_hidden, labels, objective="ppo", sampling_logprobs=q, advantages=a,
        sequence_lengths=[length] * batch, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, **keywords)
    loss.backward()

    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    logp = F.log_softmax(torch_logits(h, w), -1).gather(1, labels.clamp(min=0)[:, None])[:, 0]
    ratio = torch.exp(logp - torch.as_tensor(q).double())
    advantages = torch.as_tensor(a).double()
    per_token = -torch.min(ratio * advantages,
                           torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH) * advantages)
    mask = (labels != -100).double()
    expected = liger_grpo_aggregate(per_token.view(batch, length), mask.view(batch, length),
                                    loss_type, max_completion_length)
    expected.backward()
    scale = liger_grpo_aggregate(per_token.detach().abs().view(batch, length),
                                 mask.view(batch, length), loss_type, max_completion_length)
    assert abs(loss.item() - expected.item()) <= LOSS_RTOL * (scale.item() + 1e-3)
    assert relative_error(remote_hidden.grad, h.grad) < GRAD_RTOL
    assert relative_error(head.fetch_grad_weight(), w.grad) < GRAD_RTOL


def test_grpo_loss_types_name_what_they_need():
    with pytest.raises(ValueError, match="max_completion_length: loss_type 'dr_grpo' needs"):
        lossd.grpo_loss_type("dr_grpo", num_sequences=4)
    with pytest.raises(ValueError, match="num_sequences: loss_type 'grpo' needs a count > 0"):
        lossd.grpo_loss_type("grpo", num_sequences=0)
    with pytest.raises(ValueError, match="loss_type: expected one of grpo, bnpo"):
        lossd.grpo_loss_type("gspo")
