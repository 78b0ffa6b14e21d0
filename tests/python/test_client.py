"""The Python client (lossd.Client, lossd.torch.RemoteHead) against a real lossd_server on loopback.

References are torch's own float64 computations on W fetched from the server. Bounds are the
engine's: loss relative error 1e-6, gradients relative Frobenius error 2e-5 (the server computes in
float32 from float32 inputs).
"""
import gc
import os
import signal
import subprocess
import threading
import time
import uuid

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from holding_relay import HoldingRelay
from server_process import ServerProcess, demo_server, ensure_python_client, free_port

ensure_python_client()
import lossd  # noqa: E402
from lossd import _shared_memory, _wire  # noqa: E402
from lossd.torch import RemoteHead, RemoteLogprobs  # noqa: E402
from lossd.v1 import lossd_pb2 as pb  # noqa: E402

LOSSCTL = os.environ.get("LOSSCTL_BIN", "build/bin/lossctl")
VOCAB, HIDDEN = 3001, 64
LOSS_RTOL = 1e-6
GRAD_RTOL = 2e-5


@pytest.fixture(scope="module")
def server():
    # A 1 MiB workspace makes the engine compute a few hundred tokens in several chunks, so
    # results come back in several messages that the client puts together by row offset.
    with demo_server(VOCAB, HIDDEN, "--workspace_budget_mib=1") as s:
        yield s


@pytest.fixture
def head(new_head):
    return new_head(VOCAB, HIDDEN)


def relative_error(actual, expected):
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    return ((actual - expected).norm() / expected.norm()).item()


def random_batch(num_tokens, ignored=0):
    hidden = torch.randn(num_tokens, HIDDEN)
    labels = torch.randint(0, VOCAB, (num_tokens,))
    labels[torch.randperm(num_tokens)[:ignored]] = -100
    return hidden, labels


def torch_reference(hidden, weight, labels, reduction, upstream, weights=None, label_smoothing=0.0):
    """Loss, dL/dh and dL/dW from F.cross_entropy(hidden @ W.T) in float64, after
    upstream(loss).backward(). Per-token weights scale the per-token losses; the mean divides by
    the non-ignored count (the engine's convention, kernels/include/lossd/kernels/types.h)."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logits = h @ w.T
    if weights is None and reduction != "none":
        loss = F.cross_entropy(logits, labels, reduction=reduction, label_smoothing=label_smoothing)
    else:
        per_token = F.cross_entropy(logits, labels, reduction="none",
                                    label_smoothing=label_smoothing)
        if weights is not None:
            per_token = per_token * weights.double()
        counted = (labels != -100).sum()
        loss = {"none": per_token, "sum": per_token.sum(),
                "mean": per_token.sum() / counted}[reduction]
    upstream(loss).backward()
    return loss.detach(), h.grad, w.grad


def scalar_times(factor):
    return lambda loss: loss * factor


def random_weighted_sum(num_tokens):
    """(loss * u).sum() for a fixed random u: an upstream gradient that is not all ones."""
    u = torch.randn(num_tokens, dtype=torch.float64)
    return lambda loss: (loss * u.to(loss.dtype)).sum()


CASES = {
    "mean": dict(reduction="mean", upstream=scalar_times(1.0)),
    "mean_upstream_0.37": dict(reduction="mean", upstream=scalar_times(0.37)),
    "sum": dict(reduction="sum", upstream=scalar_times(1.0)),
    "sum_upstream_-2.5": dict(reduction="sum", upstream=scalar_times(-2.5)),
    "none_upstream_ones": dict(reduction="none", upstream=lambda loss: loss.sum()),
    "none_upstream_random": dict(reduction="none", upstream="random"),
    "mean_ignore_index": dict(reduction="mean", upstream=scalar_times(1.0), ignored=60),
    "mean_label_smoothing_0.37": dict(reduction="mean", upstream=scalar_times(0.37), ignored=30,
                                      label_smoothing=0.1),
    "none_label_smoothing_random": dict(reduction="none", upstream="random", ignored=30,
                                        label_smoothing=0.2),
    "mean_weights_0.37": dict(reduction="mean", upstream=scalar_times(0.37), ignored=30,
                              weighted=True),
    "sum_weights": dict(reduction="sum", upstream=scalar_times(1.0), weighted=True),
    "none_weights_random": dict(reduction="none", upstream="random", ignored=30, weighted=True),
}


def check_case_against_torch(remote_head, head, case):
    """CASES[case] through `remote_head` (a RemoteHead on `head`'s W, whichever way its calls
    travel): loss, dL/dh and the accumulated dL/dW against torch's float64."""
    spec = CASES[case]
    num_tokens = 300
    hidden, labels = random_batch(num_tokens, spec.get("ignored", 0))
    weights = None
    if spec.get("weighted"):
        # Negative and zero weights too (RL advantages, masks), yet a mean of 0.5 so that the
        # weighted sum stays far from 0 and its relative error means something.
        weights = torch.rand(num_tokens) * 2 - 0.5
        weights[:20] = 0
    upstream = random_weighted_sum(num_tokens) if spec["upstream"] == "random" else spec["upstream"]
    smoothing = spec.get("label_smoothing", 0.0)

    remote_hidden = hidden.clone().requires_grad_()
    loss = remote_head(remote_hidden, labels, weights=weights, reduction=spec["reduction"],
                       label_smoothing=smoothing)
    upstream(loss).backward()

    weight = head.fetch_weight()
    expected_loss, expected_grad_hidden, expected_grad_weight = torch_reference(
        hidden, weight, labels, spec["reduction"], upstream, weights, smoothing)
    assert loss.shape == expected_loss.shape
    assert relative_error(loss.detach(), expected_loss) < LOSS_RTOL
    assert remote_hidden.grad.dtype == torch.float32
    assert relative_error(remote_hidden.grad, expected_grad_hidden) < GRAD_RTOL
    assert relative_error(head.fetch_grad_weight(), expected_grad_weight) < GRAD_RTOL


# Shared memory too: the same references must hold when forward and the backward's correction
# hand their rows and dL/dh over in a memfd.
@pytest.mark.parametrize("shared_memory", [False, True], ids=["messages", "shared_memory"])
@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradients_match_torch(client, head, case, shared_memory):
    check_case_against_torch(RemoteHead(client, head.head, shared_memory=shared_memory), head,
                             case)


def test_token_accuracy_is_the_share_of_labels_that_are_the_argmax(client, head):
    """LossResult.accuracy, its per-token `correct` and RemoteHead.last_result.accuracy against
    float64 logits: half the rows labelled with their argmax where it clearly leads, the others
    with their smallest logit, every fifth row ignored (random labels would almost never be the
    argmax)."""
    rows = torch.arange(120)
    hidden, _ = random_batch(120)
    logits = hidden.double() @ head.fetch_weight().double().T
    best = logits.topk(2, dim=1)
    chosen = (rows % 2 == 0) & (best.values[:, 0] - best.values[:, 1] > 1e-3)
    labels = torch.where(chosen, best.indices[:, 0], logits.argmin(dim=1))
    labels[rows % 5 == 4] = -100
    correct = int((chosen & (rows % 5 != 4)).sum())
    counted = int((rows % 5 != 4).sum())
    assert correct > 0
    result = client.compute(head.head, hidden.numpy(), labels.numpy(), outputs=["correct"])
    assert (result.correct_tokens, result.counted_tokens) == (correct, counted)
    assert result.accuracy == pytest.approx(correct / counted)
    assert result.correct.dtype == np.int32
    np.testing.assert_array_equal(result.correct, (chosen & (rows % 5 != 4)).numpy())
    head(hidden, labels)
    assert head.last_result.accuracy == pytest.approx(correct / counted)


def test_leading_dimensions_are_flattened(head):
    hidden, labels = random_batch(4 * 75)
    hidden, labels = hidden.view(4, 75, HIDDEN), labels.view(4, 75)
    remote_hidden = hidden.clone().requires_grad_()
    per_token = head(remote_hidden, labels, reduction="none")
    assert per_token.shape == (4, 75)
    upstream = torch.randn(4, 75)
    (per_token * upstream).sum().backward()
    _, expected_grad_hidden, expected_grad_weight = torch_reference(
        hidden.view(-1, HIDDEN), head.fetch_weight(), labels.view(-1), "none",
        lambda loss: (loss * upstream.view(-1).double()).sum())
    assert remote_hidden.grad.shape == (4, 75, HIDDEN)
    assert relative_error(remote_hidden.grad.view(-1, HIDDEN), expected_grad_hidden) < GRAD_RTOL
    assert relative_error(head.fetch_grad_weight(), expected_grad_weight) < GRAD_RTOL


def test_softcap_temperature_and_z_loss_match_torch(head):
    hidden, labels = random_batch(200, ignored=20)
    cap, temperature, z_scale = 5.0, 0.7, 1e-3
    remote_hidden = hidden.clone().requires_grad_()
    loss = head(remote_hidden, labels, logit_softcap=cap, temperature=temperature,
                z_loss_scale=z_scale)
    loss.backward()

    h = hidden.double().requires_grad_()
    w = head.fetch_weight().double().requires_grad_()
    logits = cap * torch.tanh((h @ w.T) / cap) / temperature
    counted = labels != -100
    per_token = (F.cross_entropy(logits, labels, reduction="none")
                 + z_scale * torch.logsumexp(logits, dim=1) ** 2 * counted)
    expected = per_token.sum() / counted.sum()
    expected.backward()
    assert relative_error(loss.detach(), expected.detach()) < LOSS_RTOL
    assert relative_error(remote_hidden.grad, h.grad) < GRAD_RTOL
    assert relative_error(head.fetch_grad_weight(), w.grad) < GRAD_RTOL


def causal_lm_reference(hidden, weight, labels, upstream, cap=None):
    """transformers' causal LM loss in float64 (ForCausalLMLoss): labels padded with -100 and
    shifted by one along the last dimension, mean over the shifted labels not ignored."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logits = h @ w.T
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1),
                                reduction="none").view(shifted.shape)
    loss = upstream(per_token)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_shift_labels_is_the_causal_lm_loss(head, reduction):
    """[4, 75] labels: four sequences, each position scored against the next label, the last
    one ignored; the hidden rows are sent as they are. "none" with a random upstream gradient
    also takes backward's correction call through the shift."""
    hidden, labels = random_batch(4 * 75, ignored=30)
    hidden, labels = hidden.view(4, 75, HIDDEN), labels.view(4, 75)
    remote_hidden = hidden.clone().requires_grad_()
    loss = head(remote_hidden, labels, reduction=reduction, shift_labels=True)
    weights = torch.randn(4, 75, dtype=torch.float64)
    counted = (F.pad(labels, (0, 1), value=-100)[..., 1:] != -100).sum()
    reduce = {"mean": lambda t: t.sum() / counted, "sum": lambda t: t.sum(),
              "none": lambda t: (t * weights).sum()}[reduction]
    (loss if reduction != "none" else (loss * weights.float()).sum()).backward()
    expected_loss, expected_grad_hidden, expected_grad_weight = causal_lm_reference(
        hidden, head.fetch_weight(), labels, reduce)
    if reduction != "none":
        assert relative_error(loss.detach(), expected_loss) < LOSS_RTOL
    else:
        assert loss.shape == (4, 75) and torch.all(loss[:, -1] == 0)
    assert relative_error(remote_hidden.grad, expected_grad_hidden) < GRAD_RTOL
    assert relative_error(head.fetch_grad_weight(), expected_grad_weight) < GRAD_RTOL


def test_shift_labels_with_sequence_lengths(head):
    """A packed batch: three sequences of 10, 1 and 89 rows in one flat call."""
    hidden, labels = random_batch(100, ignored=10)
    lengths = [10, 1, 89]
    result = head.client.compute(head.head, hidden.numpy(), labels.numpy(), shift_labels=True,
                                 sequence_lengths=lengths, outputs=["token_loss"])
    expected = torch.zeros(100, dtype=torch.float64)
    weight = head.fetch_weight().double()
    first = 0
    for length in lengths:
        rows = slice(first, first + length - 1)
        targets = labels[first + 1:first + length]
        expected[rows] = F.cross_entropy(hidden[rows].double() @ weight.T, targets,
                                         reduction="none")
        first += length
    counted = sum(int((labels[f + 1:f + n] != -100).sum()) for f, n in zip([0, 10, 11], lengths))
    assert result.counted_tokens == counted
    assert relative_error(result.token_loss, expected) < LOSS_RTOL
    with pytest.raises(lossd.LossdError) as error:
        head.client.compute(head.head, hidden.numpy(), labels.numpy(), shift_labels=True,
                            sequence_lengths=[10, 89])
    assert error.value.code == "INVALID_ARGUMENT" and "sequence_lengths" in error.value.message


def test_head_soft_cap_applies_unless_the_call_sets_one(client):
    """A head uploaded with the model's soft cap (Gemma 2's final_logit_softcapping) caps every
    call that leaves logit_softcap unset; 0 turns it off; a value replaces it."""
    name = f"capped-{uuid.uuid4().hex[:12]}"
    weight = torch.randn(VOCAB, HIDDEN) * 0.5  # logits of several units, where a cap of 2 bites
    head = RemoteHead.upload(client, name, weight, logit_softcap=2.0)
    info = head.info()
    assert info.logit_softcap == 2.0 and not info.tied_embeddings
    hidden, labels = random_batch(150, ignored=10)
    for asked, applied in [(None, 2.0), (0.0, None), (5.0, 5.0)]:
        remote_hidden = hidden.clone().requires_grad_()
        loss = head(remote_hidden, labels, logit_softcap=asked, shift_labels=True)
        loss.backward()
        expected_loss, expected_grad_hidden, _ = causal_lm_reference(
            hidden, weight, labels, lambda t: t.sum() / (labels[1:] != -100).sum(), cap=applied)
        assert relative_error(loss.detach(), expected_loss) < LOSS_RTOL, asked
        assert relative_error(remote_hidden.grad, expected_grad_hidden) < GRAD_RTOL, asked
    head.zero_grad()


def test_tied_head_serves_embedding_rows_and_takes_their_gradient(client, head):
    """A tied head's rows by token id, in any order and with repeats, and their gradient added
    into the accumulator by id; a head that is not tied refuses both."""
    name = f"tied-{uuid.uuid4().hex[:12]}"
    weight = np.random.default_rng().standard_normal((VOCAB, HIDDEN), dtype=np.float32)
    client.upload_head(name, weight, tied_embeddings=True)
    assert client.get_head(name).tied_embeddings
    ids = np.array([7, 0, VOCAB - 1, 7, 1234])
    looked_up = client.lookup_embedding(name, ids)
    np.testing.assert_array_equal(looked_up.rows, weight[ids])
    assert looked_up.head_version == client.get_head(name).version
    bf16 = client.lookup_embedding(name, ids, dtype="bfloat16", head_version=looked_up.head_version)
    np.testing.assert_array_equal(bf16.rows, lossd.float32_to_bfloat16_bits(weight[ids]))
    empty = client.lookup_embedding(name, [])
    assert empty.rows.shape == (0, HIDDEN) and empty.head_version == looked_up.head_version

    grad = np.random.default_rng().standard_normal((len(ids), HIDDEN), dtype=np.float32)
    assert client.accumulate_embedding_grad(name, ids, grad,
                                            head_version=looked_up.head_version) == 4
    expected = np.zeros((VOCAB, HIDDEN), np.float64)
    np.add.at(expected, ids, grad.astype(np.float64))
    assert relative_error(client.fetch_grad_weight(name), expected) < 1e-6
    for call in (lambda: client.lookup_embedding(head.head, ids),
                 lambda: client.accumulate_embedding_grad(head.head, ids, grad)):
        with pytest.raises(lossd.LossdError) as error:
            call()
        assert error.value.code == "FAILED_PRECONDITION" and "not tied" in error.value.message


@pytest.mark.parametrize("dtype,grad_rtol", [(torch.float64, GRAD_RTOL), (torch.float16, 2e-3),
                                             (torch.bfloat16, 1e-2)])
def test_hidden_dtypes(head, dtype, grad_rtol):
    """float64 travels as float32; bfloat16 and float16 as themselves (the reference uses the
    same rounded values). hidden.grad has hidden's dtype: its rounding sets the bound."""
    hidden, labels = random_batch(200)
    remote_hidden = hidden.to(dtype).requires_grad_()
    loss = head(remote_hidden, labels)
    (loss * 0.5).backward()
    expected_loss, expected_grad_hidden, expected_grad_weight = torch_reference(
        remote_hidden.detach().float(), head.fetch_weight(), labels, "mean", scalar_times(0.5))
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert remote_hidden.grad.dtype == dtype
    assert relative_error(loss.detach(), expected_loss) < LOSS_RTOL
    assert relative_error(remote_hidden.grad, expected_grad_hidden) < grad_rtol
    assert relative_error(head.fetch_grad_weight(), expected_grad_weight) < GRAD_RTOL


def test_forward_without_backward_accumulates_nothing_until_its_backward(head):
    """The forward stages its dL/dW on the server; only its backward commits it, times the
    upstream gradient, so an evaluation forward under autograd trains nothing."""
    hidden, labels = random_batch(100)
    loss = head(hidden.clone().requires_grad_(), labels)
    assert head.last_result.grad_weight_staged
    assert not head.fetch_grad_weight().any()
    assert head.info().accumulated_tokens == 0
    assert head.info().staged_gradients == 1
    (loss * 3.0).backward()
    _, _, expected_grad_weight = torch_reference(hidden, head.fetch_weight(), labels, "mean",
                                                 scalar_times(3.0))
    assert relative_error(head.fetch_grad_weight(), expected_grad_weight) < GRAD_RTOL
    assert head.info().accumulated_tokens == 100
    assert head.info().staged_gradients == 0
    head.zero_grad()
    assert not head.fetch_grad_weight().any()
    assert head.info().accumulated_tokens == 0


def test_forwards_whose_backward_never_runs_are_dropped_by_the_step(head):
    hidden, labels = random_batch(50)
    for _ in range(3):
        head(hidden.clone().requires_grad_(), labels)  # never backpropagated
    assert head.info().staged_gradients == 3
    loss = head(hidden.clone().requires_grad_(), labels)
    loss.backward()
    weight = head.fetch_weight()
    _, _, expected_grad_weight = torch_reference(hidden, weight, labels, "mean",
                                                 scalar_times(1.0))
    head.step("sgd", lr=0.5)
    assert head.info().staged_gradients == 0
    assert relative_error(weight - head.fetch_weight(), 0.5 * expected_grad_weight) < GRAD_RTOL


def test_without_staging_the_forward_accumulates_and_backward_corrects(head):
    """A server without room to stage (or stage_grad_weight=False) accumulates at the forward
    for an upstream gradient of 1; backward corrects for its real upstream gradient."""
    head.stage_grad_weight = False
    try:
        hidden, labels = random_batch(100)
        loss = head(hidden.clone().requires_grad_(), labels)
        assert head.last_result.grad_weight_accumulated
        assert head.info().accumulated_tokens == 100
        (loss * 0.5).backward()
        _, _, expected_grad_weight = torch_reference(hidden, head.fetch_weight(), labels, "mean",
                                                     scalar_times(0.5))
        assert relative_error(head.fetch_grad_weight(), expected_grad_weight) < GRAD_RTOL
    finally:
        head.stage_grad_weight = True


def test_backward_twice_accumulates_the_full_gradient_again(head):
    hidden, labels = random_batch(100)
    loss = head(hidden.clone().requires_grad_(), labels, reduction="sum")
    loss.backward(retain_graph=True)
    (loss * 0.25).backward()
    _, _, expected_grad_weight = torch_reference(hidden, head.fetch_weight(), labels, "sum",
                                                 scalar_times(1.25))
    assert relative_error(head.fetch_grad_weight(), expected_grad_weight) < GRAD_RTOL


def test_scoring_without_autograd_accumulates_nothing(head):
    hidden, labels = random_batch(200, ignored=10)
    with torch.no_grad():
        loss_no_grad = head(hidden.clone().requires_grad_(), labels)
    per_token = head(hidden, labels, reduction="none")  # requires_grad False
    assert loss_no_grad.grad_fn is None and per_token.grad_fn is None
    expected_loss, _, _ = torch_reference(hidden, head.fetch_weight(), labels, "none",
                                          lambda loss: loss.sum())
    assert relative_error(per_token, expected_loss) < LOSS_RTOL
    assert relative_error(loss_no_grad, expected_loss.sum() / 190) < LOSS_RTOL
    assert not head.fetch_grad_weight().any()
    assert head.info().accumulated_calls == 0


def test_score_matches_torch(head):
    hidden, token_ids = random_batch(250)
    hidden, token_ids = hidden.view(5, 50, HIDDEN), token_ids.view(5, 50)
    scores = head.score(hidden, token_ids, top_k=5, entropy=True)
    log_probs = torch.log_softmax(hidden.double() @ head.fetch_weight().double().T, dim=-1)
    expected_top = log_probs.topk(5, dim=-1)
    assert scores.logprob.shape == (5, 50) and scores.top_k_token.shape == (5, 50, 5)
    torch.testing.assert_close(scores.logprob.double(),
                               log_probs.gather(-1, token_ids[..., None]).squeeze(-1),
                               rtol=1e-6, atol=1e-5)
    # Values, not ids, against torch's top-k: near-ties may order differently in float32. The ids
    # must name tokens with exactly those log-probabilities.
    torch.testing.assert_close(scores.top_k_logprob.double(), expected_top.values,
                               rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(log_probs.gather(-1, scores.top_k_token), expected_top.values,
                               rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(scores.entropy.double(),
                               -(log_probs.exp() * log_probs).sum(-1), rtol=1e-5, atol=1e-5)
    assert not head.fetch_grad_weight().any()


def test_results_are_reassembled_by_row_offset(client, head):
    """Small messages each way: the rows travel in many messages and the results come back in
    several, yet every per-token output lands on its row (bit-identical to one big message)."""
    hidden, labels = random_batch(301, ignored=20)
    outputs = ["token_loss", "logprob", "lse", "entropy", "argmax", "grad_hidden"]
    whole = client.compute(head.head, hidden.numpy(), labels.numpy(), outputs=outputs, top_k=3)
    small = client.compute(head.head, hidden.numpy(), labels.numpy(), outputs=outputs, top_k=3,
                           rows_per_message=7)
    for name in outputs + ["top_k_logprob", "top_k_token"]:
        assert np.array_equal(getattr(whole, name), getattr(small, name)), name
    assert whole.loss == small.loss and whole.counted_tokens == 281
    expected_loss, _, _ = torch_reference(hidden, head.fetch_weight(), labels, "none",
                                          lambda loss: loss.sum())
    assert relative_error(torch.from_numpy(small.token_loss), expected_loss) < LOSS_RTOL
    logits = hidden.double() @ head.fetch_weight().double().T
    # The argmax's logit is the largest (up to float32 rounding, should two nearly tie).
    torch.testing.assert_close(logits.gather(1, torch.from_numpy(small.argmax).long()[:, None]),
                               logits.max(1, keepdim=True).values, rtol=1e-6, atol=1e-5)


def test_errors_carry_the_grpc_code_and_the_servers_message(client, head):
    hidden, labels = random_batch(10)
    with pytest.raises(lossd.LossdError) as error:
        client.compute(head.head, np.zeros((10, HIDDEN + 1), np.float32), labels.numpy())
    assert error.value.code == "INVALID_ARGUMENT" and "hidden_size" in error.value.message
    assert isinstance(error.value, RuntimeError)
    with pytest.raises(lossd.LossdError) as error:
        head(hidden, torch.full((10,), VOCAB))
    assert error.value.code == "INVALID_ARGUMENT" and "labels" in error.value.message
    with pytest.raises(lossd.LossdError) as error:
        client.get_head("no-such-head")
    assert error.value.code == "NOT_FOUND" and error.value.reason is None
    with pytest.raises(lossd.LossdError) as error:
        client.compute(head.head, hidden.numpy(), labels.numpy(),
                       head_version=head.info().version + 1)
    assert error.value.code == "FAILED_PRECONDITION"
    # What code acts on arrives typed (the server's ErrorInfo), not only in the message.
    assert (error.value.reason, error.value.field) == ("HEAD_MOVED", "head_version")
    with pytest.raises(lossd.LossdError) as error:
        client.compute(head.head, hidden.numpy(), labels.numpy(), options=lossd.LossOptions(
            label_smoothing=2.0))
    assert error.value.code == "INVALID_ARGUMENT" and error.value.reason is None
    assert error.value.field is not None and error.value.message.startswith(error.value.field + ":")


# Addresses both clients refuse before dialing, and what the message must say besides the field.
BAD_ADDRESSES = [
    # gRPC would dial port 443, where no lossd listens.
    ("localhost", 'has no port: lossd listens on 50051 unless its --listen says otherwise, as in '
                  '"localhost:50051"'),
    ("[::1]", 'as in "[::1]:50051"'),
    # gRPC cannot resolve a URL ("Misformatted domain name").
    ("http://127.0.0.1:50051", 'a URL: gRPC takes no http:// or https:// scheme (root '
                               'certificates turn TLS on); give "127.0.0.1:50051"'),
    ("https://lossd.example.com/v1", 'give "lossd.example.com:50051"'),
    # Which colon starts the port is ambiguous.
    ("::1", 'an IPv6 address goes in brackets, as in "[::1]:50051"'),
    # gRPC would take port 0 and fail at the first call.
    ("127.0.0.1:0", "which is not HOST:PORT with a port in [1, 65535]"),
    ("127.0.0.1:grpc", "which is not HOST:PORT with a port in [1, 65535]"),
]
ADDRESS_EXPECTED = ("expected HOST:PORT or a gRPC target URI (dns:///HOST:PORT, ipv4:ADDR:PORT, "
                    "unix:PATH), got")


@pytest.mark.parametrize("address,says", BAD_ADDRESSES, ids=[a for a, _ in BAD_ADDRESSES])
def test_bad_addresses_are_refused_alike_by_python_and_lossctl(address, says):
    with pytest.raises(ValueError) as error:
        lossd.Client(address)
    message = str(error.value)
    assert message.startswith(f'address: {ADDRESS_EXPECTED} "{address}"') and says in message, \
        message
    with pytest.raises(ValueError) as error:
        RemoteHead(address, "demo")
    assert str(error.value) == message
    done = subprocess.run([LOSSCTL, f"--server={address}", "heads"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines()[0] == "lossctl heads: --server:" + message[len("address:"):]


def test_grpc_target_uris_reach_the_server(server, tmp_path):
    socket_path = tmp_path / "lossd.sock"
    with ServerProcess("--device=cpu", "--demo_vocab_size=16", "--demo_hidden_size=8",
                       f"--listen=unix:{socket_path}", metrics=False) as on_socket:
        targets = [f"localhost:{server.port}", f"dns:///127.0.0.1:{server.port}",
                   f"ipv4:127.0.0.1:{server.port}", f"unix:{socket_path}"]
        for target in targets:
            with lossd.Client(target, timeout=600) as c:
                assert c.list_heads(), target
            done = subprocess.run([LOSSCTL, f"--server={target}", "heads"], capture_output=True,
                                  text=True, timeout=600)
            assert done.returncode == 0 and "demo" in done.stdout, done.stdout + done.stderr
        assert on_socket.process.poll() is None


def test_labels_must_be_integer_token_ids(client, head):
    hidden, labels = random_batch(6)
    # A float label of 2.7 was cast to token 2; F.cross_entropy would read float targets as class
    # probabilities. Neither is what the caller meant: refused before anything is sent.
    float_labels = labels.double() + 0.7
    for call in (lambda: client.compute(head.head, hidden.numpy(), float_labels.numpy()),
                 lambda: client.score(head.head, hidden.numpy(), float_labels.tolist()),
                 lambda: head(hidden, float_labels),
                 lambda: head.score(hidden, labels.float()),
                 lambda: head(hidden, labels > 0),
                 lambda: RemoteLogprobs(client, head.head)(hidden, float_labels)):
        with pytest.raises(TypeError, match=r"(labels|token_ids|tokens): expected integer token ids, "
                                            r"got \S+ values"):
            call()
    assert head.info().accumulated_tokens == 0
    expected = client.compute(head.head, hidden.numpy(), labels.numpy()).loss
    for same in (labels.int().numpy(), labels.tolist(), labels.numpy().astype(np.uint16)):
        assert client.compute(head.head, hidden.numpy(), same).loss == expected


def test_a_wrong_head_name_fails_when_the_remote_head_is_made(client, head):
    for module in (RemoteHead, RemoteLogprobs):
        with pytest.raises(lossd.LossdError) as error:
            module(client, "no-such-head")
        assert error.value.code == "NOT_FOUND"
        assert "no-such-head" in error.value.message and head.head in error.value.message


def test_backward_after_a_step_is_refused(head):
    """The correction call is pinned to the W its forward used."""
    hidden, labels = random_batch(50)
    loss = head(hidden.clone().requires_grad_(), labels)
    head.step("sgd", lr=0.1)
    with pytest.raises(lossd.LossdError) as error:
        (loss * 0.5).backward()
    assert error.value.code == "FAILED_PRECONDITION"


def test_a_remote_head_made_for_one_forward_still_backpropagates(client, head):
    """Nothing but the graph holds a module made for one forward: its backward (with upstream 2,
    a correction call) still finds it."""
    hidden, labels = random_batch(30, ignored=3)
    weight = head.fetch_weight()
    h = hidden.clone().requires_grad_()
    loss = RemoteHead(client, head.head)(h, labels, reduction="sum")
    gc.collect()
    (loss * 2.0).backward()
    expected_loss, expected_grad_hidden, expected_grad_weight = torch_reference(
        hidden, weight, labels, "sum", scalar_times(2.0))
    assert relative_error(loss.detach(), expected_loss) < LOSS_RTOL
    assert relative_error(h.grad, expected_grad_hidden) < GRAD_RTOL
    assert relative_error(head.fetch_grad_weight(), expected_grad_weight) < GRAD_RTOL


# Call ids and retries ----------------------------------------------------------------------------


def test_training_calls_carry_fresh_ids_and_a_repeated_id_is_a_replay(client, head):
    hidden, labels = random_batch(40)
    calls = [client.compute(head.head, hidden.numpy(), labels.numpy(), outputs=["grad_hidden"],
                            accumulate_grad_weight=True) for _ in range(2)]
    assert len(calls[0].call_id) == 32 and calls[0].call_id != calls[1].call_id
    assert not calls[0].replayed and calls[0].attempts == 1
    assert head.info().accumulated_calls == 2, "two calls, two ids, two commits"

    repeat = client.compute(head.head, hidden.numpy(), labels.numpy(), outputs=["grad_hidden"],
                            accumulate_grad_weight=True, call_id=calls[0].call_id)
    assert repeat.replayed and repeat.grad_weight_accumulated
    assert repeat.loss == calls[0].loss
    assert np.array_equal(repeat.grad_hidden, calls[0].grad_hidden)
    assert head.info().accumulated_calls == 2
    # A scoring call has nothing to count twice and carries no id.
    assert client.compute(head.head, hidden.numpy(), labels.numpy()).call_id == ""

    with pytest.raises(lossd.LossdError) as error:
        client.compute(head.head, hidden.numpy(), labels.numpy(), accumulate_grad_weight=True,
                       call_id="not an id")
    assert error.value.code == "INVALID_ARGUMENT" and "call_id" in error.value.message


def test_retry_policy_is_validated():
    for bad in (dict(max_attempts=0), dict(initial_backoff=-1.0),
                dict(initial_backoff=2.0, max_backoff=1.0), dict(backoff_multiplier=0.5),
                dict(max_elapsed=-1.0), dict(max_elapsed=float("inf"))):
        with pytest.raises(ValueError):
            lossd.RetryPolicy(**bad)
    with pytest.raises(TypeError):
        lossd.Client("127.0.0.1:1", retry=3)


def test_a_client_without_a_server_says_where_it_looked():
    address = f"127.0.0.1:{free_port()}"
    with lossd.Client(address, timeout=10, retry=lossd.RetryPolicy(max_attempts=1)) as client:
        with pytest.raises(lossd.LossdError) as error:
            client.get_head("demo")
    assert error.value.code == "UNAVAILABLE"
    assert f"no lossd server answers at {address}" in error.value.message
    assert f"lossd_server --listen={address}" in error.value.message


def test_retries_ride_out_a_server_restart():
    """A policy with a window of seconds keeps a call going while its server restarts."""
    port = free_port()
    flags = ("--device=cpu", "--demo_vocab_size=50", "--demo_hidden_size=8",
             f"--listen=127.0.0.1:{port}")
    with ServerProcess(*flags, metrics=False):
        pass  # stopped: the call below starts while no server listens
    # The server starts only once an attempt has failed, however slowly the caller's thread runs.
    failed_once = threading.Event()
    policy = lossd.RetryPolicy(max_attempts=10**6, max_elapsed=600, max_backoff=0.2,
                               on_retry=lambda error, attempt, wait: failed_once.set())
    outcome = {}
    with lossd.Client(f"127.0.0.1:{port}", timeout=600, retry=policy) as client:
        hidden, labels = np.ones((3, 8), np.float32), np.array([1, 2, 3])
        caller = threading.Thread(target=lambda: outcome.update(
            result=client.compute("demo", hidden, labels)))
        caller.start()
        assert failed_once.wait(timeout=600)
        with ServerProcess(*flags, metrics=False):
            caller.join(timeout=600)
    assert outcome["result"].attempts > 1
    assert outcome["result"].counted_tokens == 3


def drop_once(relay, head, *, committed=0, staged=0):
    """Breaks the relay's connections once the server holds `committed` committed calls and
    `staged` staged gradients for the head: the answer the relay holds is lost for sure, however
    long the call took on a loaded machine (a client deadline would race the call)."""
    def watch():
        while True:
            info = head.info()
            if info.accumulated_calls >= committed and info.staged_gradients >= staged:
                break
            time.sleep(0.005)
        relay.drop()
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_retry_after_a_lost_answer_accumulates_once(server, head, caplog):
    """The server commits a call and answers; the relay holds the answer back and the connection
    breaks, so the client cannot tell whether the call took effect."""
    hidden, labels = random_batch(24)
    _, expected_grad_hidden, expected_grad_weight = torch_reference(
        hidden, head.fetch_weight(), labels, "mean", scalar_times(1.0))
    with HoldingRelay(server.port) as relay:
        # Without retries the caller sees UNAVAILABLE, the gradient already accumulated.
        # Rows in messages over gRPC: a client would otherwise ask for the shared-memory socket
        # and the Compute socket at its first call, through the relay while it holds.
        with lossd.Client(relay.address, timeout=600, shared_memory=False, compute_socket=False,
                          retry=lossd.RetryPolicy(max_attempts=1)) as once:
            once.get_head(head.head)  # the connection is up before the hold
            relay.hold()
            drop_once(relay, head, committed=1)
            with pytest.raises(lossd.LossdError) as error:
                once.compute(head.head, hidden.numpy(), labels.numpy(), accumulate_grad_weight=True,
                             call_id="lost-answer-1")
            assert error.value.code == "UNAVAILABLE"
            assert head.info().accumulated_calls == 1
            relay.release()
            # The caller's own repeat with the id is answered without a second copy.
            assert once.compute(head.head, hidden.numpy(), labels.numpy(),
                                accumulate_grad_weight=True, call_id="lost-answer-1").replayed
            assert head.info().accumulated_calls == 1
            assert relative_error(head.fetch_grad_weight(), expected_grad_weight) < GRAD_RTOL

        # With the client's retries, from a fresh accumulator and a fresh id.
        head.zero_grad()
        failures = []
        policy = lossd.RetryPolicy(initial_backoff=0.02,
                                   on_retry=lambda error, attempt, wait: (failures.append(error),
                                                                          relay.release()))
        with lossd.Client(relay.address, timeout=600, retry=policy, shared_memory=False,
                          compute_socket=False) as retrying:
            retrying.get_head(head.head)
            relay.hold()
            drop_once(relay, head, committed=1)
            with caplog.at_level("WARNING", logger="lossd"):
                result = retrying.compute(head.head, hidden.numpy(), labels.numpy(),
                                          outputs=["grad_hidden"], accumulate_grad_weight=True)
    assert [failure.code for failure in failures] == ["UNAVAILABLE"]
    assert result.attempts == 2 and result.replayed
    assert any(result.call_id in record.getMessage() for record in caplog.records)
    assert relative_error(result.grad_hidden, expected_grad_hidden) < GRAD_RTOL
    assert head.info().accumulated_calls == 1
    assert relative_error(head.fetch_grad_weight(), expected_grad_weight) < GRAD_RTOL


@pytest.mark.parametrize("lost, stage", [
    ("forward", True),    # the staging forward's answer: its retry stages nothing twice
    ("backward", True),   # the backward's commit: its retry is answered as a replay
    ("forward", False),   # the accumulating forward's answer
    ("backward", False),  # the backward's correction call
])
def test_remote_head_retries_a_lost_answer_without_counting_twice(server, head, lost, stage):
    """A RemoteHead training step whose forward call, or backward call, loses its answer after
    the server took it: hidden.grad and the server's dL/dW are still those of one
    loss.backward()."""
    hidden, labels = random_batch(30)
    upstream = scalar_times(2.5)  # a commit with a scale, or a correction call
    _, expected_grad_hidden, expected_grad_weight = torch_reference(
        hidden, head.fetch_weight(), labels, "mean", upstream)
    with HoldingRelay(server.port) as relay:
        policy = lossd.RetryPolicy(initial_backoff=0.02, on_retry=lambda *failure: relay.release())
        with lossd.Client(relay.address, timeout=600, retry=policy, shared_memory=False,
                          compute_socket=False) as client:  # rows through the relay, over gRPC
            remote = RemoteHead(client, head.head, stage_grad_weight=stage)
            remote.info()
            remote_hidden = hidden.clone().requires_grad_()
            if lost == "forward":
                relay.hold()
                # Staged, the forward's gradient waits on the server; else it is committed.
                drop_once(relay, head, committed=0 if stage else 1, staged=1 if stage else 0)
            loss = remote(remote_hidden, labels)
            if lost == "backward":
                relay.hold()
                drop_once(relay, head, committed=1 if stage else 2)
            upstream(loss).backward()
    # Staged: one commit of the forward's gradient; else the forward's and its correction's.
    assert head.info().accumulated_calls == (1 if stage else 2)
    assert relative_error(remote_hidden.grad, expected_grad_hidden) < GRAD_RTOL
    assert relative_error(head.fetch_grad_weight(), expected_grad_weight) < GRAD_RTOL


# Shared memory ------------------------------------------------------------------------------------

ALL_OUTPUTS = ["token_loss", "logprob", "lse", "entropy", "argmax", "grad_hidden"]


def hidden_as(hidden, dtype_name):
    """hidden as the numpy array compute() sends in dtype_name (bfloat16: uint16 bits)."""
    if dtype_name == "bfloat16":
        return lossd.float32_to_bfloat16_bits(hidden.numpy())
    return hidden.numpy()


def compute_both_ways(client, head, hidden, labels, **kwargs):
    """(through messages, through shared memory): the same call twice, each accumulating dL/dW
    on a zeroed accumulator; each result has its dL/dW as .grad_weight."""
    results = []
    for shared_memory in (False, True):
        head.zero_grad()
        result = client.compute(head.head, hidden, labels, accumulate_grad_weight=True,
                                shared_memory=shared_memory, **kwargs)
        result.grad_weight = head.fetch_grad_weight()
        results.append(result)
    return results


def assert_bitwise_equal(by_messages, by_shared_memory, names):
    for name in names:
        assert np.array_equal(getattr(by_messages, name), getattr(by_shared_memory, name)), name
    assert by_messages.loss == by_shared_memory.loss
    assert by_messages.loss_sum == by_shared_memory.loss_sum
    assert by_messages.counted_tokens == by_shared_memory.counted_tokens
    assert by_messages.correct_tokens == by_shared_memory.correct_tokens


# The transfer must not change a single bit of any result, for rows and dL/dh of either size and
# over several engine chunks (301 tokens under the fixture's 1 MiB workspace).
@pytest.mark.parametrize("hidden_dtype,grad_dtype", [("float32", "float32"),
                                                     ("bfloat16", "bfloat16"),
                                                     ("bfloat16", "float32")])
def test_shared_memory_gives_the_same_bits_as_messages(client, head, hidden_dtype, grad_dtype):
    hidden, labels = random_batch(301, ignored=20)
    weights = np.random.default_rng().uniform(-0.5, 1.5, 301).astype(np.float32)
    by_messages, by_shared_memory = compute_both_ways(
        client, head, hidden_as(hidden, hidden_dtype), labels.numpy(), weights=weights,
        label_smoothing=0.1, outputs=ALL_OUTPUTS, top_k=3, grad_hidden_dtype=grad_dtype)
    assert by_shared_memory.grad_hidden.dtype == lossd.client._tensors.numpy_dtype(grad_dtype)
    assert by_shared_memory.grad_hidden.shape == (301, HIDDEN)
    assert by_shared_memory.grad_weight_accumulated
    assert_bitwise_equal(by_messages, by_shared_memory,
                         ALL_OUTPUTS + ["top_k_logprob", "top_k_token", "grad_weight"])
    assert by_shared_memory.grad_weight.any()


# Rows copied into shared memory after the start, piece by piece, each announced once in place
# (SharedMemory.rows_follow), give the bits of messages: pieces of 7 rows make 301 rows into
# many, most ending inside the server's engine chunks (about 80 rows).
@pytest.mark.parametrize("hidden_dtype", ["float32", "bfloat16"])
def test_rows_that_follow_the_start_give_the_same_bits(client, head, hidden_dtype, monkeypatch):
    sent = []
    original_messages = _shared_memory._FollowingRows.messages

    def recorded_messages(self, start_message):
        for message in original_messages(self, start_message):
            sent.append(pb.ComputeRequest.FromString(message))
            yield message

    monkeypatch.setattr(_shared_memory._FollowingRows, "messages", recorded_messages)
    hidden, labels = random_batch(301, ignored=20)
    by_messages, by_shared_memory = compute_both_ways(
        client, head, hidden_as(hidden, hidden_dtype), labels.numpy(), outputs=ALL_OUTPUTS,
        shared_rows_per_piece=7)
    assert_bitwise_equal(by_messages, by_shared_memory, ALL_OUTPUTS + ["grad_weight"])
    assert sent[0].start.shared_memory.rows_follow
    assert [message.chunk.shared_rows for message in sent[1:]] == list(range(7, 301, 7)) + [301]


# The CPU server computes on the host's cores, which a client's copy would share: it says rows
# that follow the start do not pay there, and calls copy every row first unless they say.
def test_a_cpu_server_has_rows_copied_before_the_start(client, head, monkeypatch):
    assert not client._handover_connection().rows_follow_pays
    monkeypatch.setattr(_shared_memory, "_FOLLOWING_PIECE_BYTES", 1000)
    started = []
    original_messages = _shared_memory._FollowingRows.messages

    def recorded_messages(self, start_message):
        started.append(True)
        yield from original_messages(self, start_message)

    monkeypatch.setattr(_shared_memory._FollowingRows, "messages", recorded_messages)
    hidden, labels = random_batch(301)
    client.compute(head.head, hidden.numpy(), labels.numpy(), shared_memory=True)
    assert started == []
    with pytest.raises(ValueError, match="shared_rows_per_piece: expected a positive count"):
        client.compute(head.head, hidden.numpy(), labels.numpy(), shared_memory=True,
                       shared_rows_per_piece=0)


# A call whose rows follow its start and that fails once the server has taken some (pinned to a
# version W is not at, checked once its first chunk is in) stops copying and drops its memfd.
def test_a_failed_call_whose_rows_follow_drops_its_memfd(client, head):
    hidden, labels = random_batch(301)
    client.compute(head.head, hidden.numpy(), labels.numpy(), shared_memory=True)
    pool = client._shared_buffers
    idle = list(pool._idle)
    with pytest.raises(lossd.LossdError) as error:
        client.compute(head.head, hidden.numpy(), labels.numpy(), shared_memory=True,
                       head_version=head.info().version + 1, shared_rows_per_piece=3)
    assert error.value.code == "FAILED_PRECONDITION"
    dropped = [buffer for buffer in idle if buffer not in pool._idle]
    assert len(dropped) == 1 and dropped[0].closed


# The smallest layouts: no rows (nothing for the server to map) and a single row.
@pytest.mark.parametrize("num_tokens", [0, 1])
def test_shared_memory_with_no_rows_or_one_row(client, head, num_tokens):
    hidden, labels = random_batch(num_tokens)
    by_messages, by_shared_memory = compute_both_ways(
        client, head, hidden.numpy(), labels.numpy(), reduction="sum", outputs=ALL_OUTPUTS)
    assert by_shared_memory.grad_hidden.shape == (num_tokens, HIDDEN)
    assert_bitwise_equal(by_messages, by_shared_memory, ALL_OUTPUTS + ["grad_weight"])
    expected_loss, expected_grad_hidden, expected_grad_weight = torch_reference(
        hidden, head.fetch_weight(), labels, "sum", scalar_times(1.0))
    if num_tokens == 0:
        assert by_shared_memory.loss == 0 and not by_shared_memory.grad_weight.any()
    else:
        assert relative_error(by_shared_memory.loss, expected_loss) < LOSS_RTOL
        assert relative_error(by_shared_memory.grad_hidden, expected_grad_hidden) < GRAD_RTOL
        assert relative_error(by_shared_memory.grad_weight, expected_grad_weight) < GRAD_RTOL


# A server that sends dL/dh bytes it should not (shared memory), or rows of the wrong size, is
# caught instead of being read as results.
@pytest.mark.parametrize("in_messages,grad_bytes", [(False, 4 * HIDDEN), (True, 4 * HIDDEN - 4)])
def test_results_with_grad_hidden_of_the_wrong_size_are_refused(in_messages, grad_bytes):
    responses = [pb.ComputeResponse(result=pb.ComputeResult(row_offset=0, num_rows=1,
                                                            grad_hidden=bytes(grad_bytes))),
                 pb.ComputeResponse(summary=pb.ComputeSummary())]
    decoded = [_wire.decode_response(r.SerializeToString()) for r in responses]
    with pytest.raises(lossd.LossdError) as error:
        lossd.client._assemble(iter(decoded), {"grad_hidden"}, 0, 1, HIDDEN, "float32",
                               grad_hidden_in_messages=in_messages)
    assert error.value.code == "INTERNAL" and "grad_hidden" in error.value.message


def test_options_as_objects_and_as_keywords_are_the_same_call(client, head):
    """compute(options=LossOptions(...)) and compute(**keywords) send the same start: the same
    results, bit for bit, for a PPO call with a KL penalty."""
    hidden, labels = random_batch(40, ignored=5)
    rng = np.random.default_rng(3)
    inputs = dict(sampling_logprobs=rng.normal(-3, 1, 40).astype(np.float32),
                  advantages=rng.normal(0, 1, 40).astype(np.float32),
                  reference_logprobs=rng.normal(-3, 1, 40).astype(np.float32))
    as_object = lossd.LossOptions(
        reduction="sum", objective="ppo",
        policy=lossd.PolicyOptions(clip_high=0.28, dual_clip=3.0, kl_estimator="k3",
                                   kl_coef=0.01))
    by_object = client.compute(head.head, hidden.numpy(), labels.numpy(), options=as_object,
                               outputs=["token_loss", "ratio", "clip", "kl"], **inputs)
    by_keywords = client.compute(head.head, hidden.numpy(), labels.numpy(), reduction="sum",
                                 objective="ppo", clip_high=0.28, dual_clip=3.0,
                                 kl_estimator="k3", kl_coef=0.01,
                                 outputs=["token_loss", "ratio", "clip", "kl"], **inputs)
    assert by_object.loss == by_keywords.loss and by_object.mean_kl == by_keywords.mean_kl
    for name in ("token_loss", "ratio", "clip", "kl"):
        np.testing.assert_array_equal(getattr(by_object, name), getattr(by_keywords, name))


def test_tensor_messages_encoded_by_hand_are_protobufs_messages():
    """Compute's messages skip protobuf objects for their tensor fields: protobuf itself reads
    what the client writes, and the client reads what protobuf writes, every field."""
    rng = np.random.default_rng()
    hidden = rng.standard_normal((3, 5), dtype=np.float32)
    teacher = rng.standard_normal((3, 7), dtype=np.float32)
    request = pb.ComputeRequest.FromString(_wire.encode_chunk({"hidden": hidden,
                                                               "teacher_hidden": teacher}))
    assert request.chunk.hidden == hidden.tobytes()
    assert request.chunk.teacher_hidden == teacher.tobytes()
    assert pb.ComputeRequest.FromString(_wire.encode_chunk({"hidden": hidden[:0]})) \
        .HasField("chunk")
    result = pb.ComputeResult(row_offset=300, num_rows=3, token_loss=[1.5, -2.0, 3.25],
                              argmax=[7, 0, 2**30], top_k_logprob=[-0.5] * 6,
                              top_k_token=[1, 2, 3, 4, 5, 6], grad_hidden=hidden.tobytes(),
                              grad_hidden_dtype=pb.DTYPE_FLOAT32, clip=[0, 1, 3], kd=[0.5] * 3)
    decoded = _wire.decode_response(pb.ComputeResponse(result=result).SerializeToString())
    assert bytes(decoded.grad_hidden) == hidden.tobytes()
    without_grad = pb.ComputeResult()
    without_grad.CopyFrom(result)
    without_grad.ClearField("grad_hidden")
    assert decoded.message == without_grad
    summary = pb.ComputeSummary(loss=1.25, counted_tokens=2**40, backend="cpu", replayed=True)
    assert _wire.decode_response(pb.ComputeResponse(summary=summary).SerializeToString()) == \
        summary


def server_style_result(result, grad_hidden):
    """A ComputeResponse's bytes as the server writes a result: its small fields, then dL/dh."""
    small = result.SerializeToString()
    tail = _wire._key(10, 2) + _wire._varint(len(grad_hidden)) + grad_hidden
    return _wire._key(1, 2) + _wire._varint(len(small) + len(tail)) + small + tail


# A reader that takes a result's first bytes finds where its dL/dh starts when dL/dh is its last
# field (as the server writes it), and declines (None: read it whole) in every other layout.
@pytest.mark.parametrize("layout", [
    "server_style",  # small fields, then dL/dh: found
    "head_ends_inside_grad_hidden",  # only the first bytes of dL/dh are in the head: found
    "protobuf_order",  # protobuf puts fields numbered above dL/dh's after it: declined
    "head_ends_before_grad_key",  # the small fields outrun the head: declined
    "head_ends_inside_grad_length",  # a varint cut by the head: declined
    "no_grad_hidden",  # nothing to place
    "summary",  # not a result
    "bytes_after_the_result",  # the result is not the whole message: declined
])
def test_where_a_results_grad_hidden_starts(layout):
    rng = np.random.default_rng()
    grad = rng.standard_normal((4, 5), dtype=np.float32).tobytes()
    small = pb.ComputeResult(row_offset=17, num_rows=4, token_loss=[0.5, 1.5, 2.5, 3.5],
                             grad_hidden_dtype=pb.DTYPE_FLOAT32, kd=[0.25] * 4)
    data = server_style_result(small, grad)
    grad_start = len(data) - len(grad)
    grad_key_start = grad_start - 2
    head_bytes = len(data)
    if layout == "protobuf_order":
        whole = pb.ComputeResult()
        whole.CopyFrom(small)
        whole.grad_hidden = grad
        data = pb.ComputeResponse(result=whole).SerializeToString()
        head_bytes = len(data)
    elif layout == "head_ends_inside_grad_hidden":
        head_bytes = grad_start + 3
    elif layout == "head_ends_before_grad_key":
        head_bytes = grad_key_start - 1
    elif layout == "head_ends_inside_grad_length":
        data = server_style_result(small, grad * 8)  # 640 bytes: a two-byte length
        grad_start = len(data) - 8 * len(grad)
        head_bytes = grad_start - 1
    elif layout == "no_grad_hidden":
        data = pb.ComputeResponse(result=small).SerializeToString()
        head_bytes = len(data)
    elif layout == "summary":
        data = pb.ComputeResponse(summary=pb.ComputeSummary(loss=2.0)).SerializeToString()
        head_bytes = len(data)
    elif layout == "bytes_after_the_result":
        data += _wire._key(2, 2) + _wire._varint(0)
        head_bytes = len(data)
    split = _wire.split_result(memoryview(data)[:head_bytes], len(data))
    if layout in ("server_style", "head_ends_inside_grad_hidden"):
        message, start = split
        assert message == small and start == grad_start and data[start:] == grad
    else:
        assert split is None


# A server run with --shared_memory=false refuses it by name, and the same client goes on with
# messages; the refused call's memfd is dropped, not pooled.
def test_shared_memory_refused_by_a_server_without_it():
    with ServerProcess("--device=cpu", "--demo_vocab_size=100", "--demo_hidden_size=8",
                       "--shared_memory=false", metrics=False) as server, \
            lossd.Client(server.address, timeout=600) as client:
        hidden = np.random.default_rng().standard_normal((5, 8), dtype=np.float32)
        labels = np.arange(5)
        with pytest.raises(lossd.LossdError) as error:
            client.compute("demo", hidden, labels, outputs=["grad_hidden"], shared_memory=True)
        assert error.value.code == "FAILED_PRECONDITION"
        assert "shared_memory" in error.value.message
        assert client._shared_buffers._idle == []
        result = client.compute("demo", hidden, labels, outputs=["grad_hidden"])
        assert result.counted_tokens == 5 and result.grad_hidden.shape == (5, 8)


def compute_with_layout(client, head, shared_memory, num_tokens=4, grad_hidden=True):
    """A Compute call whose start names a memfd layout built by hand (no rows in messages)."""
    start = pb.ComputeStart(
        head=head, num_tokens=num_tokens, hidden_size=HIDDEN, hidden_dtype=pb.DTYPE_FLOAT32,
        labels=list(range(num_tokens)), outputs=pb.OutputSelection(grad_hidden=grad_hidden),
        shared_memory=shared_memory)
    call = client._call("Compute", iter([_wire.encode_start(start)]))
    return list(client._responses("Compute", call))


# The server checks the layout a client names before it maps anything, and says which field is at
# fault; none of those refusals may spoil the client's next shared-memory call.
def test_shared_memory_layout_errors_name_the_field(client, head):
    rows_bytes = 4 * HIDDEN * 4
    handover = client._handover_connection()
    sealed = _shared_memory._SharedBuffer(2 * rows_bytes + 64)
    try:
        handle = sealed.handle_on(handover)
        layouts = [
            ("INVALID_ARGUMENT", "shared_memory.hidden_offset",
             pb.SharedMemory(handle=handle, hidden_offset=8, grad_hidden_offset=rows_bytes + 64)),
            ("INVALID_ARGUMENT", "shared_memory.grad_hidden_offset",
             pb.SharedMemory(handle=handle, grad_hidden_offset=rows_bytes - 64)),
            # The memfd is too small for the layout.
            ("INVALID_ARGUMENT", "shared_memory.handle: expected a memfd of at least",
             pb.SharedMemory(handle=handle, grad_hidden_offset=2 * rows_bytes)),
            ("INVALID_ARGUMENT", "shared_memory.handle: expected the 16-byte handle",
             pb.SharedMemory(handle=handle[:8], grad_hidden_offset=rows_bytes)),
            ("NOT_FOUND", "shared_memory.handle: expected a handle registered",
             pb.SharedMemory(handle=os.urandom(16), grad_hidden_offset=rows_bytes)),
        ]
        for code, expected, layout in layouts:
            with pytest.raises(lossd.LossdError) as error:
                compute_with_layout(client, head.head, layout)
            assert error.value.code == code, expected
            assert expected in error.value.message, (expected, error.value.message)
    finally:
        sealed.close()
    # A memfd that could shrink under the server's mapping is refused when it is handed over.
    unsealed_fd = os.memfd_create("lossd-test-unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(unsealed_fd, rows_bytes)
        with pytest.raises(lossd.LossdError) as error:
            handover.register(unsealed_fd)
        assert error.value.code == "INVALID_ARGUMENT"
        assert "register_memfd: expected a memfd sealed against shrinking" in error.value.message
        assert "got a memfd without F_SEAL_SHRINK" in error.value.message
    finally:
        os.close(unsealed_fd)
    hidden, labels = random_batch(4)
    assert client.compute(head.head, hidden.numpy(), labels.numpy(),
                          shared_memory=True).counted_tokens == 4


# The split copy into and out of shared memory is exact however the rows divide among threads.
@pytest.mark.parametrize("rows,cols", [
    (3, 5),  # small: one thread
    (1, 10 << 20),  # large but one row: nothing to split
    (5, 4 << 20),  # rows that do not divide evenly among the threads
    (4097, 4096),  # many rows, an odd count
])
def test_copy_rows_is_exact(rows, cols):
    source = np.random.default_rng().standard_normal((rows, cols), dtype=np.float32)
    target = np.zeros_like(source)
    _shared_memory.copy_rows(target, source)
    assert np.array_equal(target, source)


def lent_buffer(array):
    """The pooled buffer an array returned by compute() was lent from, or None for a copy."""
    base = array.base
    return base.buffer if isinstance(base, _shared_memory._Lease) else None


# The pool: a memfd serves call after call under the handle it got once; a call's dL/dh is lent
# where the server wrote it and its memfd serves no other call until the caller lets go (the
# values it holds never change under it); beyond the lending limit dL/dh is copied out; a failed
# call drops its memfd (a server finishing a cancelled call may still write into it), and close()
# closes the rest.
def test_shared_buffer_pool_lends_dl_dh_and_drops_failed_buffers(server, head):
    with lossd.Client(server.address, timeout=600) as client:
        pool = client._shared_buffers
        first_hidden, labels = random_batch(100)
        first = client.compute(head.head, first_hidden.numpy(), labels.numpy(),
                               outputs=["grad_hidden"], shared_memory=True)
        assert pool._idle == [] and pool._lent == 1, "dL/dh lent, its memfd out of the pool"
        first_buffer = lent_buffer(first.grad_hidden)
        handle = first_buffer._handle
        assert len(handle) == 16 and first_buffer._registered_on is client._handover
        first_grad_hidden = first.grad_hidden.copy()
        first_tensor = torch.from_numpy(first.grad_hidden)
        assert first_tensor.data_ptr() == first.grad_hidden.ctypes.data
        second_hidden, _ = random_batch(100)
        second = client.compute(head.head, second_hidden.numpy(), labels.numpy(),
                                outputs=["grad_hidden"], shared_memory=True)
        # The second call could not use the lent memfd: it wrote elsewhere.
        assert lent_buffer(second.grad_hidden) is not first_buffer
        assert np.array_equal(first.grad_hidden, first_grad_hidden)
        assert not np.array_equal(second.grad_hidden, first_grad_hidden)

        # A tensor made from the array keeps it lent; once everything is gone, the memfd is back
        # and serves the next call under the same handle.
        first = second = None
        gc.collect()
        assert pool._lent == 2, "the torch tensor still holds the first dL/dh"
        del first_tensor
        gc.collect()
        third = client.compute(head.head, first_hidden[:10].numpy(), labels[:10].numpy(),
                               outputs=["grad_hidden"], shared_memory=True)
        assert pool._lent == 1 and len(pool._idle) == 1
        assert first_buffer in pool._idle or \
            lent_buffer(third.grad_hidden) is first_buffer
        assert first_buffer._handle == handle and not first_buffer.closed
        third = None
        gc.collect()

        # Beyond the lending limit, dL/dh is an ordinary copy and the memfd goes back at once.
        kept = [client.compute(head.head, first_hidden.numpy(), labels.numpy(),
                               outputs=["grad_hidden"], shared_memory=True)
                for _ in range(pool._MAX_LENT + 1)]
        assert pool._lent == pool._MAX_LENT
        assert lent_buffer(kept[-1].grad_hidden) is None
        assert all(np.array_equal(result.grad_hidden, kept[0].grad_hidden) for result in kept)
        kept = None
        gc.collect()

        # Fails after the server has mapped the memfd: pinned to a version W is not at.
        client.compute(head.head, first_hidden.numpy(), labels.numpy(), shared_memory=True)
        idle = list(pool._idle)
        with pytest.raises(lossd.LossdError) as error:
            client.compute(head.head, first_hidden.numpy(), labels.numpy(),
                           outputs=["grad_hidden"], shared_memory=True,
                           head_version=head.info().version + 1)
        assert error.value.code == "FAILED_PRECONDITION"
        dropped = [buffer for buffer in idle if buffer not in pool._idle]
        assert len(dropped) == 1 and dropped[0].closed
        remaining = list(pool._idle)
    assert remaining and all(buffer.closed for buffer in remaining) and pool._idle == []


# A lent dL/dh outlives its client: still readable after close(), and its memfd is closed once
# the array goes.
def test_lent_dl_dh_outlives_its_client(server, head):
    hidden, labels = random_batch(50)
    client = lossd.Client(server.address, timeout=600)
    result = client.compute(head.head, hidden.numpy(), labels.numpy(), outputs=["grad_hidden"],
                            shared_memory=True)
    expected = client.compute(head.head, hidden.numpy(), labels.numpy(), outputs=["grad_hidden"],
                              shared_memory=False).grad_hidden
    buffer = lent_buffer(result.grad_hidden)
    assert buffer is not None
    client.close()
    assert np.array_equal(result.grad_hidden, expected)
    fd = buffer.fd
    inode = os.fstat(fd).st_ino  # still open while the array lives
    result = buffer = None
    gc.collect()
    try:
        reused = os.fstat(fd).st_ino  # the number may have gone to another descriptor since
    except OSError:
        reused = None
    assert reused != inode, "the memfd is still open"


# A shared array's rows are read where they lie: the call names its memfd and copies nothing into
# a pooled one; dL/dh comes back in a memfd of its own. Results match the same rows sent as
# messages bit for bit, for the whole array, an aligned slice of rows, and bfloat16; a slice off
# the alignment is copied and still right; the memfd closes once the array is gone.
def test_shared_array_rows_are_read_where_they_lie(server, head):
    with lossd.Client(server.address, timeout=600) as client:
        pool = client._shared_buffers
        hidden, labels = random_batch(96, ignored=7)
        shared = client.shared_array(hidden.shape)
        assert shared.dtype == np.float32 and shared.shape == (96, HIDDEN) and not shared.any()
        shared[:] = hidden.numpy()
        expected = client.compute(head.head, hidden.numpy(), labels.numpy(),
                                  outputs=["token_loss", "grad_hidden"], shared_memory=False,
                                  reduction="sum")
        copies = []
        original_array = _shared_memory._SharedBuffer.array

        def counting_array(buffer, offset, dtype, shape):
            copies.append(shape)
            return original_array(buffer, offset, dtype, shape)

        _shared_memory._SharedBuffer.array = counting_array
        try:
            in_place = client.compute(head.head, shared, labels.numpy(),
                                      outputs=["token_loss", "grad_hidden"], shared_memory=True,
                                      reduction="sum")
            # Rows 32.. start at 32 * HIDDEN * 4 bytes, a multiple of 64.
            tail = client.compute(head.head, torch.from_numpy(shared)[32:], labels[32:].numpy(),
                                  outputs=["token_loss", "grad_hidden"], shared_memory=True,
                                      reduction="sum")
            assert copies == [], "rows in a shared array were copied"
            # Row 1 starts HIDDEN * 4 bytes in: off the alignment unless HIDDEN is a multiple of 16.
            off = client.compute(head.head, shared[1:], labels[1:].numpy(),
                                 outputs=["token_loss", "grad_hidden"], shared_memory=True,
                                 reduction="sum")
        finally:
            _shared_memory._SharedBuffer.array = original_array
        assert np.array_equal(in_place.token_loss, expected.token_loss)
        assert np.array_equal(in_place.grad_hidden, expected.grad_hidden)
        # The engine's blocking follows the call's row count: slices against the same slice.
        for result, first in ((tail, 32), (off, 1)):
            sent = client.compute(head.head, hidden[first:].numpy(), labels[first:].numpy(),
                                  outputs=["token_loss", "grad_hidden"], shared_memory=False,
                                  reduction="sum")
            assert np.array_equal(result.token_loss, sent.token_loss)
            assert np.array_equal(result.grad_hidden, sent.grad_hidden)
        assert (HIDDEN * 4) % 64 == 0 or copies, "the unaligned slice was not copied"
        assert np.array_equal(shared, hidden.numpy()), "the server changed the rows"

        bf16 = client.shared_array(hidden.shape, "bfloat16")
        bf16[:] = lossd.float32_to_bfloat16_bits(hidden.numpy())
        by_messages = client.compute(head.head, bf16.copy(), labels.numpy(),
                                     outputs=["grad_hidden"], shared_memory=False)
        in_memory = client.compute(head.head, bf16, labels.numpy(), outputs=["grad_hidden"],
                                   shared_memory=True)
        assert np.array_equal(in_memory.grad_hidden, by_messages.grad_hidden)

        buffers = [buffer for _, buffer in pool._shared_arrays]
        assert len(buffers) == 2 and not any(buffer.closed for buffer in buffers)
        shared = bf16 = None
        gc.collect()
        client.compute(head.head, hidden.numpy(), labels.numpy(), shared_memory=True)
        assert all(buffer.closed for buffer in buffers) and pool._shared_arrays == []


# A server that restarts has closed the handover connection and forgotten every handle: the
# client notices, asks the new server for its socket and hands its pooled memfd over again.
def test_shared_memory_survives_a_server_restart():
    hidden = np.random.default_rng().standard_normal((6, 8), dtype=np.float32)
    labels = np.arange(6)
    first = ServerProcess("--device=cpu", "--demo_vocab_size=100", "--demo_hidden_size=8",
                          metrics=False)
    port = first.port
    try:
        with lossd.Client(first.address, timeout=600) as client:
            before = client.compute("demo", hidden, labels, outputs=["token_loss"],
                                    shared_memory=True)
            old_connection = client._handover
            first.stop()
            with ServerProcess("--device=cpu", "--demo_vocab_size=100", "--demo_hidden_size=8",
                               f"--listen=127.0.0.1:{port}", metrics=False) as second:
                assert second.port == port
                after = client.compute("demo", hidden, labels, outputs=["token_loss"],
                                       shared_memory=True)
                assert client._handover is not old_connection
                assert np.array_equal(before.token_loss, after.token_loss)
    finally:
        first.stop()
        os.unlink(first.log.name)


# One Client's pool is shared by the threads that use it: no call may see another's rows or dL/dh.
def test_shared_memory_from_several_threads(client, head):
    batches = [random_batch(50 + 30 * i) for i in range(4)]
    expected = [client.compute(head.head, hidden.numpy(), labels.numpy(), outputs=ALL_OUTPUTS)
                for hidden, labels in batches]
    failures = []

    def run(i):
        hidden, labels = batches[i]
        for _ in range(3):
            result = client.compute(head.head, hidden.numpy(), labels.numpy(),
                                    outputs=ALL_OUTPUTS, shared_memory=True)
            for name in ALL_OUTPUTS:
                if not np.array_equal(getattr(result, name), getattr(expected[i], name)):
                    failures.append((i, name))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batches))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_upload_fetch_round_trip(client):
    name = f"upload-{uuid.uuid4().hex[:12]}"
    weight = np.random.default_rng().standard_normal((517, 48), dtype=np.float32)
    info = client.upload_head(name, weight)
    assert (info.vocab_size, info.hidden_size, info.dtype) == (517, 48, "float32")
    assert np.array_equal(client.fetch_weight(name), weight)
    assert np.array_equal(client.fetch_weight(name, "float16"), weight.astype(np.float16))
    assert np.array_equal(client.fetch_weight(name, "bfloat16"),
                          lossd.float32_to_bfloat16_bits(weight))
    with pytest.raises(lossd.LossdError) as error:
        client.upload_head(name, weight)
    assert error.value.code == "ALREADY_EXISTS"

    replaced = client.upload_head(name, weight * 2, storage_dtype="bfloat16", replace=True)
    assert replaced.dtype == "bfloat16" and replaced.version > info.version
    stored = lossd.bfloat16_bits_to_float32(lossd.float32_to_bfloat16_bits(weight * 2))
    assert np.array_equal(client.fetch_weight(name), stored)
    assert name in [h.name for h in client.list_heads()]


def accumulate_random_gradient(head):
    hidden, labels = random_batch(200)
    head(hidden.requires_grad_(), labels).backward()
    return head.fetch_grad_weight()


@pytest.mark.parametrize("optimizer,settings", [
    ("sgd", dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    ("adamw", dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)),
    # torch.optim.AdamW's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01.
    ("adamw", dict()),
    # torch.optim.SGD's: lr 1e-3 (torch 2's; 1.13 has none), momentum 0, weight_decay 0.
    ("sgd", dict()),
], ids=["sgd", "adamw", "adamw-defaults", "sgd-defaults"])
def test_step_matches_torch_optimizer(head, optimizer, settings):
    parameter = torch.nn.Parameter(head.fetch_weight())
    optimizer_class = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
    reference = optimizer_class([parameter], **(dict(lr=1e-3) | settings))
    for _ in range(2):  # the second step uses the optimizer state of the first
        parameter.grad = accumulate_random_gradient(head)
        info = head.step(optimizer, **settings)
        reference.step()
        assert info.grad_norm == pytest.approx(parameter.grad.double().norm().item(), rel=1e-6)
        assert not head.fetch_grad_weight().any()
        torch.testing.assert_close(head.fetch_weight(), parameter.detach(), rtol=1e-5, atol=1e-6)
    assert head.info().steps == 2 and head.info().optimizer == optimizer


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_wire_defaults_are_torchs(client, head, optimizer):
    """A step request with nothing set is torch.optim's defaults, for any client: AdamW's lr 1e-3,
    betas (0.9, 0.999), eps 1e-8, weight decay 0.01; SGD's lr 1e-3, no momentum or decay."""
    parameter = torch.nn.Parameter(head.fetch_weight())
    if optimizer == "adamw":
        reference = torch.optim.AdamW([parameter])
        request = pb.StepRequest(head=head.head, adamw=pb.AdamWConfig())
    else:
        reference = torch.optim.SGD([parameter], lr=1e-3)  # torch 1.13's SGD has no default lr
        request = pb.StepRequest(head=head.head, sgd=pb.SgdConfig())
    parameter.grad = accumulate_random_gradient(head)
    client._stub.Step(request, timeout=600)
    reference.step()
    torch.testing.assert_close(head.fetch_weight(), parameter.detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError):
        head.step(lr=0.1)  # no optimizer named: neither SGD nor AdamW is assumed
    assert head.info().steps == 1


def test_tls_and_bearer_token(tmp_path):
    cert, key, token = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "token"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    token.write_text("s3cret\n")
    with ServerProcess("--device=cpu", "--demo_vocab_size=100", "--demo_hidden_size=8",
                       f"--tls_cert_file={cert}", f"--tls_key_file={key}", f"--token_file={token}",
                       metrics=False) as s:
        with lossd.Client(s.address, token="s3cret", tls_root_cert=str(cert)) as authorized:
            assert [h.name for h in authorized.list_heads()] == ["demo"]
        with lossd.Client(s.address, tls_root_cert=cert.read_bytes()) as anonymous:
            with pytest.raises(lossd.LossdError) as error:
                anonymous.list_heads()
            assert error.value.code == "UNAUTHENTICATED"


def test_sigterm_finishes_running_calls_refuses_new_ones_and_ignores_idle_clients():
    """A call in flight at SIGTERM is finished, new calls are refused, and an idle connection does
    not hold the exit. The call is kept in flight by its client, which holds back its last rows
    until the drain has begun, so nothing here depends on how fast the machine computes; the drain
    limit is far beyond what the call needs."""
    vocab, hidden_size, tokens, drain = 3000, 64, 2048, 600
    rng = np.random.default_rng()
    hidden = rng.standard_normal((tokens, hidden_size), dtype=np.float32)
    labels = rng.integers(0, vocab, tokens)
    with ServerProcess("--device=cpu", f"--demo_vocab_size={vocab}",
                       f"--demo_hidden_size={hidden_size}", f"--drain_seconds={drain}") as server, \
            lossd.Client(server.address, timeout=2 * drain) as idle, \
            lossd.Client(server.address, timeout=2 * drain) as busy:
        idle.list_heads()  # a connection that stays open and idle through the shutdown
        last_rows = threading.Event()
        outcome = {}

        def requests():
            yield pb.ComputeRequest(start=pb.ComputeStart(
                head="demo", num_tokens=tokens, hidden_size=hidden_size,
                hidden_dtype=pb.DTYPE_FLOAT32, labels=labels.tolist(),
                outputs=pb.OutputSelection(grad_hidden=True)))
            half = tokens // 2
            yield pb.ComputeRequest(chunk=pb.ComputeChunk(hidden=hidden[:half].tobytes()))
            last_rows.wait()
            yield pb.ComputeRequest(chunk=pb.ComputeChunk(hidden=hidden[half:].tobytes()))

        def call():
            try:
                grad_rows = 0
                for response in busy._stub.Compute(requests(), timeout=2 * drain):
                    if response.HasField("result"):
                        grad_rows += response.result.num_rows
                outcome["grad_rows"] = grad_rows
            except Exception as error:  # grpc.RpcError, reported below
                outcome["error"] = error
            outcome["ended"] = time.monotonic()

        caller = threading.Thread(target=call)
        caller.start()
        # In flight: the server has read the call's first rows (a stream whose start has not been
        # read yet is ended at once by a shutdown: it is no call to drain).
        while server.metric("lossd_received_bytes_total") == 0:
            time.sleep(0.01)
        server.process.send_signal(signal.SIGTERM)
        while "draining in-flight calls" not in server.output():
            time.sleep(0.01)
        # The server refuses what reaches it, reads and changes alike (a client of one server on
        # this host does not watch its health: there is no other replica to turn to).
        for refused_call in (lambda: idle.zero_grad("demo"), idle.list_heads):
            with pytest.raises(lossd.LossdError) as refused:
                refused_call()
            assert refused.value.code == "UNAVAILABLE"
            assert "shutting down" in refused.value.message
        assert "ended" not in outcome, "the call ended before its last rows were sent"
        last_rows.set()
        caller.join()
        assert server.process.wait(timeout=2 * drain) == 0
        exited = time.monotonic()
        assert "error" not in outcome, outcome.get("error")
        assert outcome["grad_rows"] == tokens
        # The idle connection does not hold the exit: the server would otherwise wait out its
        # drain limit.
        assert exited - outcome["ended"] < drain / 2


# dL/dh into the caller's array, both ways: the same bits as a fresh result, the array itself
# returned; a failed call leaves it as it was; a misfit array is refused naming the argument.
@pytest.mark.parametrize("shared_memory", [False, True])
def test_grad_hidden_out_is_written_only_when_the_call_succeeds(client, head, shared_memory):
    hidden, labels = random_batch(301, ignored=10)
    hidden = hidden.numpy()
    fresh = client.compute(head.head, hidden, labels.numpy(), outputs=["grad_hidden"])
    out = np.full((301, HIDDEN), 7.0, np.float32)
    result = client.compute(head.head, hidden, labels.numpy(), outputs=["grad_hidden"],
                            grad_hidden_out=out, shared_memory=shared_memory)
    assert result.grad_hidden is out
    assert np.array_equal(out, fresh.grad_hidden)

    out[:] = 7.0
    poisoned = hidden.copy()
    poisoned[200, 0] = np.nan  # in a later engine chunk than the first
    with pytest.raises(lossd.LossdError) as failure:
        client.compute(head.head, poisoned, labels.numpy(), outputs=["grad_hidden"],
                       grad_hidden_out=out, shared_memory=shared_memory)
    assert failure.value.code == "INVALID_ARGUMENT"
    assert (out == 7.0).all()

    for misfit in (np.zeros((300, HIDDEN), np.float32), np.zeros((301, HIDDEN), np.float64),
                   np.zeros((HIDDEN, 301), np.float32).T):
        with pytest.raises(ValueError, match="grad_hidden_out"):
            client.compute(head.head, hidden, labels.numpy(), outputs=["grad_hidden"],
                           grad_hidden_out=misfit, shared_memory=shared_memory)
