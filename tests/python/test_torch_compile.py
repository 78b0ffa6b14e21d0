"""torch.compile over models that use lossd: RemoteHead and RemoteEmbedding are custom operators
(torch >= 2.4) that compile whole (fullgraph) and give what eager mode gives.

Needs torch >= 2.4 and transformers (scripts/python_env.sh's environment).
"""
import numpy as np
import pytest
import torch
import transformers

from server_process import ServerProcess, ensure_python_client

ensure_python_client()
import lossd  # noqa: E402
import lossd.hf  # noqa: E402
from lossd.torch import RemoteHead  # noqa: E402

transformers.logging.set_verbosity_error()

VOCAB, HIDDEN = 211, 24
# What compiling may change: the order of a few float32 sums in the body.
RTOL = 1e-6
BACKENDS = ["eager", "aot_eager"]


@pytest.fixture(scope="module")
def client():
    with ServerProcess("--device=cpu", "--demo_vocab_size=16", "--demo_hidden_size=8",
                       metrics=False) as server, lossd.Client(server.address, timeout=600) as c:
        yield c


def relative_error(actual, expected):
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    return ((actual - expected).norm() / expected.norm()).item()


class TinyLM(torch.nn.Module):
    """Embedding, one tanh layer and a RemoteHead."""

    def __init__(self, head):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.body = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = head

    def forward(self, ids, labels, reduction):
        hidden = torch.tanh(self.body(self.embed(ids)))
        return self.head(hidden, labels, reduction=reduction, shift_labels=True)


def train_step(call, model, head, ids, labels, reduction, upstream):
    """Loss and gradients of one step through `call` (the model, or it compiled), the server's
    dL/dW among them."""
    head.zero_grad()
    model.zero_grad()
    loss = call(ids, labels, reduction)
    (loss * upstream).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.detach(), grads, head.fetch_grad_weight()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_remote_head_compiles_whole_and_matches_eager(client, backend, reduction):
    """fullgraph=True: no graph break, the server calls are opaque operators. "none" with a
    random upstream gradient runs backward's correction call inside the compiled backward."""
    torch.manual_seed(0)
    head = RemoteHead.upload(client, f"compiled-{backend}-{reduction}",
                             torch.randn(VOCAB, HIDDEN) * 0.3, replace=True)
    model = TinyLM(head)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for step in range(2):  # a second batch runs the compiled graph again
        ids = torch.randint(0, VOCAB, (3, 10))
        labels = ids.clone()
        labels[0, :3] = -100
        upstream = torch.randn(3, 10) if reduction == "none" else torch.tensor(0.7)
        expected = train_step(model, model, head, ids, labels, reduction, upstream)
        actual = train_step(compiled, model, head, ids, labels, reduction, upstream)
        assert relative_error(actual[0], expected[0]) < RTOL, step
        for name, grad in expected[1].items():
            assert relative_error(actual[1][name], grad) < RTOL, (step, name)
        assert relative_error(actual[2], expected[2]) < RTOL, step

        # And eager mode against torch's own loss on the fetched W.
        weight = head.fetch_weight().double().requires_grad_()
        hidden = torch.tanh(model.body(model.embed(ids))).detach().double()
        shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        per_token = torch.nn.functional.cross_entropy(
            (hidden @ weight.T).reshape(-1, VOCAB), shifted.reshape(-1), reduction="none")
        reference = (per_token.view(3, 10) * upstream.double()).sum() if reduction == "none" \
            else per_token.sum() / (shifted != -100).sum() * upstream.double()
        reference.backward()
        assert relative_error(expected[2], weight.grad) < 2e-5, step


@pytest.mark.parametrize("backend", BACKENDS)
def test_tied_hf_model_compiles_and_matches_eager(client, backend):
    """A tied Qwen2-style model through lossd.hf: the embedding lookup and its gradient are
    operators too."""
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=True)
    config._attn_implementation = "eager"
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config)
    head = lossd.hf.offload_head(model, client, head=f"tied-{backend}", upload=True)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ids = torch.randint(1, VOCAB, (2, 12))

    def run(m):
        head.zero_grad()
        model.zero_grad()
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                if p.grad is not None}, head.fetch_grad_weight())

    expected, actual = run(model), run(compiled)
    assert relative_error(actual[0], expected[0]) < RTOL
    assert expected[1].keys() == actual[1].keys()
    for name, grad in expected[1].items():
        if grad.numel():
            assert relative_error(actual[1][name], grad) < RTOL, name
    assert relative_error(actual[2], expected[2]) < RTOL
    assert np.any(actual[2].numpy() != 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_offloaded_model_evaluates_and_generates_compiled_whole(client, backend):
    """Evaluation with labels, logits without them and generate() through a forward compiled
    whole (fullgraph) give what eager mode gives: the logits come from an operator over a copy
    of W, the head's version read outside the graph."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    torch._dynamo.reset()  # the other backend's run compiled the same forward
    torch.manual_seed(2)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    lossd.hf.offload_head(model, client, head=f"generate-{backend}", upload=True)
    ids = torch.randint(1, VOCAB, (2, 9))
    with torch.no_grad():
        eager_loss = model(input_ids=ids, labels=ids).loss
        eager_logits = model(input_ids=ids).logits
        eager_tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
        # dynamic: one graph for every length generate() feeds it.
        model.forward = torch.compile(model.forward, backend=backend, fullgraph=True,
                                      dynamic=True)
        compiled_loss = model(input_ids=ids, labels=ids).loss
        compiled_logits = model(input_ids=ids).logits
        compiled_tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert relative_error(compiled_loss, eager_loss) < RTOL
    assert relative_error(compiled_logits, eager_logits) < RTOL
    assert torch.equal(compiled_tokens, eager_tokens)
