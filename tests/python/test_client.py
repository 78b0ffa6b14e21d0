"""The Python client (lossd.Client, lossd.torch.RemoteHead) against a real lossd_server on loopback.

References are torch's own float64 computations on W fetched from the server. Bounds are the
engine's: loss relative error 1e-6, gradients relative Frobenius error 2e-5 (the server computes in
float32 from float32 inputs).
"""
import signal
import subprocess
import threading
import time
import uuid

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from server_process import ServerProcess, ensure_python_client

ensure_python_client()
import lossd  # noqa: E402
from lossd.torch import RemoteHead  # noqa: E402

VOCAB, HIDDEN = 3001, 64
LOSS_RTOL = 1e-6
GRAD_RTOL = 2e-5


@pytest.fixture(scope="module")
def server():
    # A 1 MiB workspace makes the engine compute a few hundred tokens in several chunks, so
    # results come back in several messages that the client puts together by row offset.
    with ServerProcess("--device=cpu", f"--demo_vocab_size={VOCAB}",
                       f"--demo_hidden_size={HIDDEN}", "--workspace_budget_mib=1",
                       metrics=False) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with lossd.Client(server.address, timeout=120) as c:
        yield c


@pytest.fixture
def head(client):
    """A fresh head with a random W, so that no test sees another's gradient or steps."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    weight = np.random.default_rng().standard_normal((VOCAB, HIDDEN), dtype=np.float32) * 0.3
    return RemoteHead.upload(client, name, torch.from_numpy(weight))


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


@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradients_match_torch(client, head, case):
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
    loss = head(remote_hidden, labels, weights=weights, reduction=spec["reduction"],
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


def test_forward_without_backward_has_accumulated_until_zero_grad(head):
    hidden, labels = random_batch(100)
    head(hidden.clone().requires_grad_(), labels)
    _, _, expected_grad_weight = torch_reference(hidden, head.fetch_weight(), labels, "mean",
                                                 scalar_times(1.0))
    assert relative_error(head.fetch_grad_weight(), expected_grad_weight) < GRAD_RTOL
    assert head.info().accumulated_tokens == 100
    head.zero_grad()
    assert not head.fetch_grad_weight().any()
    assert head.info().accumulated_tokens == 0


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
    assert error.value.code == "NOT_FOUND"
    with pytest.raises(lossd.LossdError) as error:
        client.compute(head.head, hidden.numpy(), labels.numpy(),
                       head_version=head.info().version + 1)
    assert error.value.code == "FAILED_PRECONDITION"


def test_backward_after_a_step_is_refused(head):
    """The correction call is pinned to the W its forward used."""
    hidden, labels = random_batch(50)
    loss = head(hidden.clone().requires_grad_(), labels)
    head.step("sgd", lr=0.1)
    with pytest.raises(lossd.LossdError) as error:
        (loss * 0.5).backward()
    assert error.value.code == "FAILED_PRECONDITION"


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


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_step_matches_torch_optimizer(head, optimizer):
    parameter = torch.nn.Parameter(head.fetch_weight())
    if optimizer == "sgd":
        settings = dict(lr=0.1, momentum=0.9, weight_decay=0.01)
        reference = torch.optim.SGD([parameter], **settings)
    else:
        settings = dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
        reference = torch.optim.AdamW([parameter], **settings)
    for _ in range(2):  # the second step uses the optimizer state of the first
        parameter.grad = accumulate_random_gradient(head)
        info = head.step(optimizer, **settings)
        reference.step()
        assert info.grad_norm == pytest.approx(parameter.grad.double().norm().item(), rel=1e-6)
        assert not head.fetch_grad_weight().any()
        torch.testing.assert_close(head.fetch_weight(), parameter.detach(), rtol=1e-5, atol=1e-6)
    assert head.info().steps == 2 and head.info().optimizer == optimizer


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
    vocab, hidden_size, tokens = 32000, 256, 16384  # a call of a few seconds on 2 cores
    rng = np.random.default_rng()
    hidden = rng.standard_normal((tokens, hidden_size), dtype=np.float32)
    labels = rng.integers(0, vocab, tokens)
    with ServerProcess("--device=cpu", f"--demo_vocab_size={vocab}",
                       f"--demo_hidden_size={hidden_size}", metrics=False) as server, \
            lossd.Client(server.address, timeout=120) as idle, \
            lossd.Client(server.address, timeout=120) as busy:
        idle.list_heads()  # a connection that stays open and idle through the shutdown
        outcome = {}

        def call():
            try:
                outcome["result"] = busy.compute("demo", hidden, labels, outputs=["grad_hidden"])
            except lossd.LossdError as error:
                outcome["error"] = error
            outcome["ended"] = time.monotonic()

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(0.5)
        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while "draining in-flight calls" not in server.output() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert "ended" not in outcome, "the call ended before the signal: make it longer"
        with pytest.raises(lossd.LossdError) as refused:
            idle.list_heads()
        assert refused.value.code == "UNAVAILABLE"
        assert "shutting down" in refused.value.message
        caller.join()
        assert server.process.wait(timeout=30) == 0
        exited = time.monotonic()
        assert "error" not in outcome, outcome.get("error")
        assert outcome["result"].grad_hidden.shape == (tokens, hidden_size)
        # The idle connection does not hold the exit: it follows the last call at once.
        assert exited - outcome["ended"] < 2.0
