"""Distillation through the Python client (lossd.torch.RemoteDistill, Client.score_kl) against
torch's float64 autograd of the naive formula, both [N, V] logits materialized, written as TRL's
GKD generalized_jsd_loss writes it, on heads uploaded to a real lossd_server on loopback.

The server's 1 MiB workspace splits each call into several engine chunks of two logits tiles.
Bounds: the engine's for distillation (tests/engine_test.cc).
"""
import math
import uuid

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from server_process import demo_server, ensure_python_client

ensure_python_client()
import lossd  # noqa: E402
from lossd.torch import RemoteDistill  # noqa: E402

VOCAB, HIDDEN, TEACHER_HIDDEN = 2003, 48, 32
NUM_TOKENS = 200
LOSS_RTOL = 2e-5
GRAD_RTOL = 2e-5
TERM_ATOL = 2e-4


@pytest.fixture(scope="module")
def server():
    with demo_server(VOCAB, HIDDEN, "--workspace_budget_mib=1") as s:
        yield s


def upload(client, rows, columns, scale, name_prefix):
    name = f"{name_prefix}-{uuid.uuid4().hex[:12]}"
    weight = np.random.default_rng().standard_normal((rows, columns), dtype=np.float32)
    weight *= scale / math.sqrt(columns)
    client.upload_head(name, weight)
    return name, torch.from_numpy(weight)


@pytest.fixture
def heads(client):
    """A student head and a teacher head of another hidden size, logits of about 3 and 4."""
    student, student_weight = upload(client, VOCAB, HIDDEN, 3.0, "student")
    teacher, teacher_weight = upload(client, VOCAB, TEACHER_HIDDEN, 4.0, "teacher")
    return student, student_weight, teacher, teacher_weight


def relative_error(actual, expected):
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    return ((actual - expected).norm() / expected.norm()).item()


def head_logits(hidden, weight, temperature=1.0, softcap=0.0):
    logits = hidden @ weight.T
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return logits / temperature


def generalized_jsd(student_logits, teacher_log_probs, beta, tau):
    """TRL's generalized_jsd_loss per token, before its reduction: forward KL at beta 0, reverse
    KL at 1, else beta KL(p || m) + (1 - beta) KL(q || m) with m = beta p + (1 - beta) q. The
    teacher's p log p terms use xlogy, so that a sparse teacher's zero probabilities add 0."""
    log_q = F.log_softmax(student_logits / tau, dim=-1)
    log_p = teacher_log_probs
    p = log_p.exp()
    if beta == 0:
        return (torch.xlogy(p, p) - p * log_q).sum(-1)
    if beta == 1:
        return F.kl_div(log_p, log_q, reduction="none", log_target=True).sum(-1)
    log_m = torch.logsumexp(torch.stack([log_q + math.log(1 - beta), log_p + math.log(beta)]),
                            dim=0)
    kl_teacher = (torch.xlogy(p, p) - p * log_m).sum(-1)
    kl_student = F.kl_div(log_m, log_q, reduction="none", log_target=True).sum(-1)
    return beta * kl_teacher + (1 - beta) * kl_student


def sparse_log_probs(tokens, logprobs, mass, tau):
    """A sparse teacher's log p at tau: its top-k log-probabilities completed over the vocabulary
    (-inf elsewhere, or the rest of the mass spread evenly), then softmax(/ tau)."""
    tokens = torch.as_tensor(tokens).long()
    logprobs = torch.as_tensor(logprobs).double()
    rest = (1 - logprobs.exp().sum(-1)).clamp(min=0)
    k = tokens.shape[-1]
    fill = torch.log(rest / (VOCAB - k)) if mass == "spread" else torch.full_like(rest, -math.inf)
    completed = fill[:, None].expand(-1, VOCAB).clone()
    completed.scatter_(1, tokens, logprobs)
    return F.log_softmax(completed / tau, dim=-1)


def tail_bucket_divergence(student_logits, tokens, logprobs, beta):
    """Top-k + tail distillation per token, from its definition: both distributions over the
    teacher's k tokens and one bucket for the rest of the vocabulary. The teacher's bucket holds
    1 - sum p (at least 0; the k + 1 values renormalized, as the server does when a rounded top-k
    sums past 1), the student's its mass outside the same k tokens (a masked logsumexp); then
    generalized_jsd over the k + 1 buckets."""
    log_q = F.log_softmax(student_logits, dim=-1)
    tokens = torch.as_tensor(tokens).long()
    outside = torch.ones_like(log_q, dtype=torch.bool).scatter_(1, tokens, False)
    log_q_tail = torch.logsumexp(log_q.masked_fill(~outside, -math.inf), dim=-1, keepdim=True)
    student_buckets = torch.cat([log_q.gather(1, tokens), log_q_tail], dim=-1)
    logprobs = torch.as_tensor(logprobs).double()
    tail = (1 - logprobs.exp().sum(-1, keepdim=True)).clamp(min=0)
    teacher_buckets = torch.cat([logprobs, tail.log()], dim=-1)
    teacher_buckets = teacher_buckets - torch.logsumexp(teacher_buckets, dim=-1, keepdim=True)
    # The student's buckets are log-probabilities already: generalized_jsd's log_softmax keeps them.
    return generalized_jsd(student_buckets, teacher_buckets, beta, 1.0)


def torch_distill(h, w, teacher_log_probs, labels, spec, divergence=None):
    """Loss, dL/dh, dL/dW and per-token (kd, ce) of the naive formula in float64 autograd;
    divergence(z), when given, is D per token in place of generalized_jsd against
    teacher_log_probs."""
    h = h.detach().double().requires_grad_()
    w = w.detach().double().requires_grad_()
    tau, beta, alpha = spec.get("temperature", 1.0), spec.get("beta", 0.0), spec.get("alpha", 0.0)
    z = head_logits(h, w, spec.get("student_temperature", 1.0), spec.get("logit_softcap", 0.0))
    kd = tau ** 2 * (divergence(z) if divergence is not None
                     else generalized_jsd(z, teacher_log_probs, beta, tau))
    if labels is None:
        ce = torch.zeros_like(kd)
        mask = torch.ones_like(kd)
    else:
        ce = F.cross_entropy(z, labels, reduction="none", ignore_index=-100)
        mask = (labels != -100).double()
    per_token = (alpha * ce + (1 - alpha) * kd) * mask
    reduction = spec.get("reduction", "mean")
    loss = {"mean": lambda x: x.sum() / mask.sum(), "sum": torch.sum,
            "none": lambda x: x}[reduction](per_token)
    upstream = torch.as_tensor(spec.get("upstream", 1.0)).double()
    (loss * upstream).sum().backward()
    return loss.detach(), h.grad, w.grad, (kd * mask).detach(), (ce * mask).detach()


def dense_teacher_log_probs(ht, wt, spec):
    zt = head_logits(ht.double(), wt.double(), spec.get("teacher_temperature", 1.0),
                     spec.get("teacher_logit_softcap", 0.0))
    return F.log_softmax(zt / spec.get("temperature", 1.0), dim=-1)


def make_batch(with_labels=True):
    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 31)))
    h = torch.randn(NUM_TOKENS, HIDDEN, generator=g)
    ht = torch.randn(NUM_TOKENS, TEACHER_HIDDEN, generator=g)
    labels = None
    if with_labels:
        labels = torch.randint(0, VOCAB, (NUM_TOKENS,), generator=g)
        labels[torch.rand(NUM_TOKENS, generator=g) < 0.1] = -100
    return h, ht, labels


CASES = {
    "forward_kl": dict(beta=0.0),
    "reverse_kl_tau2_alpha": dict(beta=1.0, alpha=0.3, temperature=2.0),
    "jsd_heads_transformed_upstream": dict(
        beta=0.4, alpha=0.2, temperature=1.5, teacher_temperature=0.8, teacher_logit_softcap=15.0,
        logit_softcap=20.0, student_temperature=1.2, reduction="sum", upstream=0.37),
    "jsd_none_upstream": dict(beta=0.5, alpha=0.5, reduction="none", upstream="random"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_remote_distill_matches_torch(client, heads, name):
    spec = dict(CASES[name])
    student, w, teacher, wt = heads
    h, ht, labels = make_batch()
    if spec.get("upstream") == "random":
        spec["upstream"] = np.random.default_rng().uniform(-1, 2, NUM_TOKENS)
    loss_ref, grad_h_ref, grad_w_ref, kd_ref, ce_ref = torch_distill(
        h, w, dense_teacher_log_probs(ht, wt, spec), labels, spec)

    distill = RemoteDistill(client, student=student, teacher=teacher, beta=spec.get("beta", 0.0),
                            alpha=spec.get("alpha", 0.0), temperature=spec.get("temperature", 1.0),
                            teacher_temperature=spec.get("teacher_temperature", 1.0),
                            teacher_logit_softcap=spec.get("teacher_logit_softcap", 0.0))
    hidden = h.clone().requires_grad_()
    teacher_hidden = ht.clone().requires_grad_()  # frozen teacher rows: no gradient
    loss = distill(hidden, teacher_hidden, labels, reduction=spec.get("reduction", "mean"),
                   logit_softcap=spec.get("logit_softcap", 0.0),
                   student_temperature=spec.get("student_temperature", 1.0))
    (loss.double() * torch.as_tensor(spec.get("upstream", 1.0)).double()).sum().backward()

    assert relative_error(loss.detach(), loss_ref) < LOSS_RTOL
    assert relative_error(hidden.grad, grad_h_ref) < GRAD_RTOL
    assert teacher_hidden.grad is None
    result = distill.last_result
    assert np.abs(result.kd - kd_ref.numpy()).max() < TERM_ATOL
    assert np.abs(result.ce - ce_ref.numpy()).max() < TERM_ATOL
    counted = int((labels != -100).sum())
    assert result.mean_kd == pytest.approx(kd_ref.sum().item() / counted, abs=TERM_ATOL)
    grad_w = torch.from_numpy(client.fetch_grad_weight(student))
    assert relative_error(grad_w, grad_w_ref) < GRAD_RTOL
    assert not client.fetch_grad_weight(teacher).any(), "the teacher was trained"


@pytest.mark.parametrize("mass,beta", [("renormalize", 0.0), ("spread", 0.5), ("spread", 1.0),
                                       ("tail_bucket", 0.0), ("tail_bucket", 0.5),
                                       ("tail_bucket", 1.0)])
def test_sparse_teacher_matches_torch(client, heads, mass, beta):
    """Cached teacher outputs: the top-20 of the teacher head's own log-probabilities. A tail
    bucket (top-k + tail: the rest of the teacher's mass as one bucket against the student's mass
    outside the same tokens) is checked against torch's autograd of its definition, at the
    temperature 1 it needs."""
    student, w, teacher, wt = heads
    h, ht, labels = make_batch()
    spec = dict(beta=beta, alpha=0.25, temperature=1.0 if mass == "tail_bucket" else 1.3)
    teacher_log_probs = F.log_softmax(head_logits(ht.double(), wt.double()), dim=-1)
    top = teacher_log_probs.topk(20, dim=-1)
    tokens, logprobs = top.indices.int(), top.values.float()
    if mass == "tail_bucket":
        reference = torch_distill(
            h, w, None, labels, spec,
            divergence=lambda z: tail_bucket_divergence(z, tokens, logprobs, beta))
    else:
        reference = torch_distill(
            h, w, sparse_log_probs(tokens, logprobs, mass, spec["temperature"]), labels, spec)
    loss_ref, grad_h_ref, grad_w_ref, kd_ref, _ = reference
    distill = RemoteDistill(client, student=student, beta=beta, alpha=spec["alpha"],
                            temperature=spec["temperature"], sparse_teacher_mass=mass)
    hidden = h.clone().requires_grad_()
    loss = distill(hidden, None, labels, teacher_top_k_tokens=tokens,
                   teacher_top_k_logprobs=logprobs)
    loss.backward()
    assert relative_error(loss.detach(), loss_ref) < LOSS_RTOL
    assert relative_error(hidden.grad, grad_h_ref) < GRAD_RTOL
    assert np.abs(distill.last_result.kd - kd_ref.numpy()).max() < TERM_ATOL
    assert relative_error(torch.from_numpy(client.fetch_grad_weight(student)), grad_w_ref) < \
        GRAD_RTOL


def test_tail_bucket_with_a_temperature_is_refused_by_name(client, heads):
    """The tail has no logits to soften: a tail bucket needs distill temperature 1."""
    student, _, _, _ = heads
    h, _, labels = make_batch()
    tokens = torch.arange(4, dtype=torch.int32).expand(NUM_TOKENS, 4).contiguous()
    logprobs = torch.full((NUM_TOKENS, 4), math.log(0.1))
    distill = RemoteDistill(client, student=student, temperature=2.0,
                            sparse_teacher_mass="tail_bucket")
    with pytest.raises(lossd.LossdError) as error:
        distill(h.requires_grad_(), None, labels, teacher_top_k_tokens=tokens,
                teacher_top_k_logprobs=logprobs)
    assert error.value.code == "INVALID_ARGUMENT"
    assert "options.distill.temperature" in error.value.message
    assert "tail_bucket" in error.value.message


def test_bfloat16_rows_against_their_float64_values(client, heads):
    """bf16 rows for both heads travel as bf16; the reference takes the same rounded values."""
    student, w, teacher, wt = heads
    h, ht, labels = make_batch()
    h16, ht16 = h.bfloat16(), ht.bfloat16()
    spec = dict(beta=0.3, alpha=0.1)
    loss_ref, grad_h_ref, _, _, _ = torch_distill(
        h16.double(), w, dense_teacher_log_probs(ht16.double(), wt, spec), labels, spec)
    hidden = h16.clone().requires_grad_()
    loss = RemoteDistill(client, student, teacher, beta=0.3, alpha=0.1)(hidden, ht16, labels)
    loss.backward()
    assert hidden.grad.dtype == torch.bfloat16
    assert relative_error(loss.detach(), loss_ref) < LOSS_RTOL
    assert relative_error(hidden.grad.double(), grad_h_ref) < 2 ** -8  # dL/dh rounded to bf16


def test_score_kl_of_a_policy_against_its_reference(client, heads):
    """Monitoring: KL(policy || reference) per token without labels or gradients."""
    student, w, teacher, wt = heads
    h, ht, _ = make_batch(with_labels=False)
    before = client.fetch_grad_weight(student)
    result = client.score_kl(student, h.numpy(), teacher, ht.numpy())
    log_q = F.log_softmax(head_logits(h.double(), w.double()), dim=-1)
    log_p = F.log_softmax(head_logits(ht.double(), wt.double()), dim=-1)
    expected = (log_q.exp() * (log_q - log_p)).sum(-1)
    assert np.abs(result.kd - expected.numpy()).max() < TERM_ATOL
    assert result.counted_tokens == NUM_TOKENS
    assert not result.grad_weight_accumulated
    assert np.array_equal(client.fetch_grad_weight(student), before)
    with torch.no_grad():
        scored = RemoteDistill(client, student, teacher, beta=1.0)(h, ht, reduction="none")
    assert np.abs(scored.numpy() - expected.numpy()).max() < TERM_ATOL


def test_a_head_distilled_from_itself_gets_exactly_nothing(client, heads):
    student, _, _, _ = heads
    h, _, labels = make_batch()
    hidden = h.clone().requires_grad_()
    loss = RemoteDistill(client, student, student, beta=0.5, temperature=2.0)(hidden, h, labels)
    loss.backward()
    assert loss.item() == 0.0
    assert not hidden.grad.any()


def test_heads_soft_caps_apply_unless_the_call_sets_them(client):
    """Heads loaded with a soft cap (Gemma 2's final_logit_softcapping) keep it as students and
    as teachers; 0 turns each off."""
    caps = dict(logit_softcap=2.0, teacher_logit_softcap=3.0)
    names, weights = [], []
    for columns, scale, cap in ((HIDDEN, 3.0, 2.0), (TEACHER_HIDDEN, 4.0, 3.0)):
        name = f"capped-{uuid.uuid4().hex[:12]}"
        weight = np.random.default_rng().standard_normal((VOCAB, columns), dtype=np.float32)
        weight *= scale / math.sqrt(columns)
        client.upload_head(name, weight, logit_softcap=cap)
        names.append(name)
        weights.append(torch.from_numpy(weight))
    h, ht, labels = make_batch()
    # What the call sets, and the caps that then apply.
    for call_caps, applied in (({}, caps),
                               (dict(logit_softcap=0.0), dict(teacher_logit_softcap=3.0)),
                               (dict(teacher_logit_softcap=0.0), dict(logit_softcap=2.0))):
        spec = dict(beta=0.5, **applied)
        _, _, _, kd_ref, _ = torch_distill(
            h, weights[0], dense_teacher_log_probs(ht, weights[1], spec), labels, spec)
        distill = RemoteDistill(client, names[0], names[1], beta=0.5,
                                teacher_logit_softcap=call_caps.get("teacher_logit_softcap"))
        with torch.no_grad():
            distill(h, ht, labels, reduction="none", logit_softcap=call_caps.get("logit_softcap"))
        assert np.abs(distill.last_result.kd - kd_ref.numpy()).max() < TERM_ATOL, call_caps
        kl = client.score_kl(names[0], h.numpy(), names[1], ht.numpy(), beta=0.5, labels=labels,
                             **call_caps)
        assert np.array_equal(kl.kd, distill.last_result.kd), call_caps


def test_teacher_of_another_vocabulary_is_refused_naming_both(client, heads):
    student, _, _, _ = heads
    other, _ = upload(client, VOCAB - 1, TEACHER_HIDDEN, 1.0, "small")
    h, ht, labels = make_batch()
    with pytest.raises(lossd.LossdError) as error:
        RemoteDistill(client, student, other)(h.requires_grad_(), ht, labels)
    assert error.value.code == "INVALID_ARGUMENT"
    assert f"head '{student}' (V = {VOCAB})" in error.value.message
    assert f"head '{other}' with V = {VOCAB - 1}" in error.value.message
