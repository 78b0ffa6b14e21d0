"""PyTorch layer of the lossd client: RemoteHead, an lm_head whose W [V, H] lives on a server.

    head = RemoteHead(lossd.Client("127.0.0.1:50051"), "main")
    loss = head(hidden, labels)      # hidden [..., H] from the model body, labels [...]
    loss.backward()                  # hidden.grad = dL/dh; dL/dW accumulates on the server
    body_optimizer.step()
    head.step("adamw", lr=3e-4)      # the server steps W with its own AdamW state

The loss is torch.nn.functional.cross_entropy(hidden @ W.T, labels, ...) with the same options
(plus per-token weights, z-loss, logit soft cap and temperature, see the lossd engine), computed on
the server without the [N, V] logits ever existing anywhere. The same call computes the RL
objectives by name, in one pass:

    loss = head(hidden, sampled_tokens, objective="ppo", sampling_logprobs=q, advantages=a,
                reference_logprobs=ref, kl_estimator="k3", kl_coef=0.01,
                reduction="seq-mean-token-mean", sequence_lengths=lengths)
    loss.backward()                  # head.last_result: clip_fraction, mean_kl, per-token ratio

and any other loss of the log-probabilities through RemoteLogprobs (two calls: the
log-probabilities forward, dL/dlogp backward):

    logp = lossd.torch.RemoteLogprobs(client, "main")(hidden, tokens)   # differentiable
    my_loss(logp).backward()         # hidden.grad, and dL/dW on the server

Distillation against a teacher head served beside the student (or a sparse top-k of cached
teacher outputs) goes through RemoteDistill, with the same backward semantics:

    loss = lossd.torch.RemoteDistill(client, student="main", teacher="big", beta=0.5)(
        hidden, teacher_hidden, labels)
    loss.backward()                  # hidden.grad; the teacher gets nothing

Backward semantics
------------------
* Under autograd (torch.is_grad_enabled() and hidden.requires_grad), forward asks the server for
  dL/dh and adds dL/dW for an upstream gradient of 1 to the head's accumulator, in the same call
  (accumulate_grad_weight). backward(g) returns g * dL/dh (reduction "none": g[i] * dL/dh_i per
  row). When g is not exactly 1 (all ones for "none"), backward makes ONE correction call with the
  same hidden rows that accumulates only dL/dW: grad_scale = g - 1 for "mean"/"sum", per-token
  weights w_i * (g_i - 1) for "none". dL/dW is linear in the upstream gradient, so afterwards both
  hidden.grad and the server's dL/dW equal what torch computes for the same loss times g, up to
  float32 rounding. The correction is pinned to the head version the forward used; if W was
  stepped in between, backward fails with FAILED_PRECONDITION. Backward through the same graph a
  second time (retain_graph=True) accumulates g2 * dL/dW in full, as torch would.
* Without autograd (inside torch.no_grad(), or hidden.requires_grad False) forward is a plain
  scoring call: no gradients, nothing accumulated on the server.
* A forward under autograd whose backward is never called has still accumulated its dL/dW (for
  upstream 1). Call head.zero_grad() (ZeroGradWeight on the server) after such a forward, and run
  evaluation under torch.no_grad(). model.zero_grad() on a parent module does not reach the server;
  head.step() zeroes the server's gradient after the step (unless keep_grad=True).
* The correction adds (g - 1) * dL/dW to the float32 accumulator that already holds 1 * dL/dW, so
  its absolute rounding is about 6e-8 * |dL/dW|: relative to g * dL/dW that is fine for g of order
  1 or larger (loss scaling), poorer for |g| << 0.01. For gradient accumulation prefer
  mean_denominator (the whole batch's token count, the same for every micro-batch) over dividing
  the loss: the upstream gradient then stays 1 and no correction call is made.

* Forward's call and backward's correction call each carry a fresh call_id, and the Client
  retries them after UNAVAILABLE or DEADLINE_EXCEEDED under that id (its RetryPolicy): a call the
  server committed before its answer was lost is answered again without its dL/dW being added a
  second time, so a retried step still accumulates exactly one loss.backward(). If the head was
  stepped with keep_grad between the lost answer and the retry, the retry fails with
  ALREADY_EXISTS (the gradient is on the server, dL/dh cannot be had again).

Training only W on fixed hidden states (no autograd on hidden) is a Client.compute call with
accumulate_grad_weight=True followed by head.step().

Dtypes: float32 and float64 hidden states travel as float32, bfloat16 and float16 as themselves.
dL/dh comes back in bfloat16 for bfloat16 inputs and in float32 otherwise (float16 would flush the
small per-token gradients of a large mean to zero), and hidden.grad has hidden's dtype. The loss is
float64 for float64 inputs, float32 otherwise.
"""
import dataclasses
from typing import Optional

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from lossd.client import Client, HeadInfo, StepInfo

_WIRE_NAME_OF_TORCH_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                             torch.float16: "float16"}


def _wire_array(tensor):
    """A CPU numpy array of a float tensor in the dtype it travels in (bfloat16 as uint16 bits)."""
    tensor = tensor.detach()
    if tensor.dtype == torch.float64:
        tensor = tensor.float()
    if tensor.dtype not in _WIRE_NAME_OF_TORCH_DTYPE:
        raise TypeError(f"hidden: expected a float32, float64, bfloat16 or float16 tensor, got "
                        f"{tensor.dtype}")
    tensor = tensor.cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def _tensor_from_wire(array, dtype_name):
    """The torch tensor of a numpy array received as dtype_name (bfloat16: uint16 bits)."""
    if dtype_name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _wire_dtype_name(dtype):
    if dtype not in _WIRE_NAME_OF_TORCH_DTYPE:
        raise TypeError(f"dtype: expected torch.float32, torch.bfloat16 or torch.float16, got "
                        f"{dtype}")
    return _WIRE_NAME_OF_TORCH_DTYPE[dtype]


def _token_ids(values, field):
    """values (a tensor, array or list of ids) as a flat CPU int64 numpy array; anything but
    integers is refused, as Client.compute does, rather than truncated."""
    ids = torch.as_tensor(values).detach()
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{field}: expected integer token ids, got {ids.dtype} values; cast "
                        f"them with .long() if they are ids")
    return ids.reshape(-1).to("cpu", torch.int64).numpy()


def _grad_hidden_wire_dtype(hidden_dtype):
    return "bfloat16" if hidden_dtype == torch.bfloat16 else "float32"


def _loss_dtype(hidden_dtype):
    return torch.float64 if hidden_dtype == torch.float64 else torch.float32


@dataclasses.dataclass
class _LossCall:
    """What a forward sent, kept for the calls its backward may make."""
    client: Client
    head: str
    labels: Optional[np.ndarray]   # [N] int64, or None (distill without labels)
    weights: Optional[np.ndarray]  # [N] float32 or None
    reduction: str
    options: dict                  # the remaining Client.compute arguments (loss options, transfer)
    token_inputs: dict = dataclasses.field(default_factory=dict)  # name -> [N] float32
    # Client.compute arguments with a row per row of hidden, sent beside it (a teacher's).
    side: dict = dataclasses.field(default_factory=dict)
    result: object = None          # the forward's LossResult

    def compute(self, hidden, **kwargs):
        return self.client.compute(self.head, _wire_array(hidden), self.labels,
                                   weights=self.weights, reduction=self.reduction,
                                   **{**self.options, **self.token_inputs, **self.side,
                                      **kwargs})

    def counted(self):
        """[N] bool: the rows whose label is not ignore_index (all of them without labels)."""
        if self.labels is None:
            return np.ones(len(self.weights) if self.weights is not None else self.num_rows(),
                           bool)
        return self.labels != self.options["ignore_index"]

    def num_rows(self):
        for values in (self.labels, *self.side.values(), *self.token_inputs.values()):
            if values is not None:
                return len(values)
        raise ValueError("the call's rows cannot be counted")

    def rows(self, rows, **replace):
        """The same call on a subset of its rows (numpy indices): labels, per-token inputs and a
        teacher's rows taken along, sequences dropped."""
        fields = dict(
            labels=None if self.labels is None else self.labels[rows],
            options={k: v for k, v in self.options.items() if k != "sequence_lengths"},
            weights=None if self.weights is None else self.weights[rows],
            token_inputs={name: values[rows] for name, values in self.token_inputs.items()},
            side={name: values[rows] for name, values in self.side.items()})
        return dataclasses.replace(self, **{**fields, **replace})


def _as_numpy(values, dtype, name, count):
    """A flat CPU numpy array of a tensor, array or sequence; `count` entries unless None."""
    if values is None:
        return None
    array = torch.as_tensor(values).detach().reshape(-1).to("cpu", dtype).numpy()
    if count is not None and array.shape[0] != count:
        raise ValueError(f"{name}: expected {count} entries (the rows of hidden), got "
                         f"{array.shape[0]}")
    return array


class _RemoteLoss(torch.autograd.Function):
    """loss(hidden [N, H]) with dL/dh from the server; dL/dW accumulates on the server."""

    @staticmethod
    def forward(ctx, hidden, call):
        result = call.compute(
            hidden, outputs=["grad_hidden"] + _result_outputs(call),
            grad_hidden_dtype=_grad_hidden_wire_dtype(hidden.dtype), accumulate_grad_weight=True)
        call.result = result
        ctx.save_for_backward(hidden)
        ctx.call = call
        ctx.head_version = result.head_version
        ctx.teacher_head_version = result.teacher_head_version
        ctx.grad_hidden = _tensor_from_wire(result.grad_hidden,
                                            _grad_hidden_wire_dtype(hidden.dtype))
        # The forward's own accumulation stands for an upstream gradient of 1 until a backward
        # corrects it; later backwards through the same graph accumulate in full.
        ctx.accumulated_upstream = 1.0
        return _loss_tensor(result, call.reduction, hidden)

    @staticmethod
    @once_differentiable
    def backward(ctx, upstream):
        hidden, = ctx.saved_tensors
        call = ctx.call
        math_dtype = _loss_dtype(hidden.dtype)
        grad_hidden = ctx.grad_hidden.to(device=hidden.device, dtype=math_dtype)
        upstream = upstream.detach().to(math_dtype)
        if call.reduction == "none":
            grad_hidden = grad_hidden * upstream.reshape(-1, 1)
        else:
            grad_hidden = grad_hidden * upstream
        _accumulate_grad_weight_correction(ctx, hidden, upstream.cpu())
        return grad_hidden.to(hidden.dtype), None


def _accumulate_grad_weight_correction(ctx, hidden, upstream):
    """Brings the server's dL/dW from ctx.accumulated_upstream times this call's dL/dW to
    `upstream` times it more, with one call that accumulates only dL/dW (it is linear in the
    upstream gradient)."""
    call = ctx.call
    already = ctx.accumulated_upstream
    ctx.accumulated_upstream = 0.0
    # The correction reads the heads the forward read, or fails (FAILED_PRECONDITION).
    pinned = dict(head_version=ctx.head_version)
    if call.options.get("teacher_head") is not None:
        pinned["teacher_head_version"] = ctx.teacher_head_version
    if call.reduction != "none":
        scale = float(upstream) - already
        if scale != 0.0:
            call.compute(hidden, grad_scale=scale, accumulate_grad_weight=True, **pinned)
        return
    counted = call.counted()
    weights = np.ones(len(counted)) if call.weights is None else call.weights.astype(np.float64)
    correction = weights * (upstream.reshape(-1).numpy() - already)
    if call.options.get("shift_labels"):
        # Row i predicts the label of row i + 1: the rows cannot be picked apart from their
        # neighbours, so all of them go, weighted.
        if np.any(correction != 0.0):
            partial = dataclasses.replace(call, weights=correction.astype(np.float32))
            partial.compute(hidden, accumulate_grad_weight=True, head_version=ctx.head_version)
        return
    # Rows with a zero correction or an ignored label add nothing: send only the others.
    rows = np.flatnonzero((correction != 0.0) & counted)
    if rows.size == 0:
        return
    partial = call.rows(rows, weights=correction[rows].astype(np.float32))
    partial.compute(hidden[torch.from_numpy(rows).to(hidden.device)], accumulate_grad_weight=True,
                    **pinned)


def _result_outputs(call):
    """The per-token outputs a forward asks for beside dL/dh: the per-token loss for "none", the
    policy objectives' ratio, clip state and KL estimate, and distillation's KD and CE terms."""
    outputs = ["token_loss"] if call.reduction == "none" else []
    objective = call.options.get("objective", "cross_entropy")
    if objective == "distill":
        return outputs + ["kd"] + (["ce"] if call.labels is not None else [])
    if objective != "cross_entropy" or call.options.get("kl_estimator") is not None:
        outputs += ["ratio", "clip", "kl"]
    return outputs


class _RemoteLogprobs(torch.autograd.Function):
    """log p(labels) (hidden [N, H]) scored on the server; backward sends dL/dlogp back as the
    logprob_gradient objective, which returns dL/dh and accumulates dL/dW."""

    @staticmethod
    def forward(ctx, hidden, call):
        result = call.compute(hidden, outputs=["logprob"])
        ctx.save_for_backward(hidden)
        ctx.call = call
        ctx.head_version = result.head_version
        return torch.from_numpy(result.logprob).to(device=hidden.device,
                                                   dtype=_loss_dtype(hidden.dtype))

    @staticmethod
    @once_differentiable
    def backward(ctx, upstream):
        hidden, = ctx.saved_tensors
        call = ctx.call
        math_dtype = _loss_dtype(hidden.dtype)
        grad_hidden = torch.zeros(hidden.shape, dtype=math_dtype, device=hidden.device)
        upstream = upstream.detach().reshape(-1).to("cpu", torch.float32).numpy()
        # Ignored rows and rows without a gradient add nothing: send only the others.
        rows = np.flatnonzero((upstream != 0.0) & (call.labels != call.options["ignore_index"]))
        if rows.size == 0:
            return grad_hidden.to(hidden.dtype), None
        grad_dtype = _grad_hidden_wire_dtype(hidden.dtype)
        device_rows = torch.from_numpy(rows).to(hidden.device)
        result = call.rows(rows).compute(
            hidden[device_rows], objective="logprob_gradient", logprob_grads=upstream[rows],
            outputs=["grad_hidden"], grad_hidden_dtype=grad_dtype, accumulate_grad_weight=True,
            head_version=ctx.head_version)
        grad_hidden[device_rows] = _tensor_from_wire(result.grad_hidden, grad_dtype).to(
            device=hidden.device, dtype=math_dtype)
        return grad_hidden.to(hidden.dtype), None


def _run(call, flat_hidden, hidden):
    """The call's loss under autograd (_RemoteLoss: dL/dh now, dL/dW on the server) or as a plain
    scoring call without it, and its LossResult; the loss shaped for the reduction."""
    if torch.is_grad_enabled() and hidden.requires_grad:
        loss = _RemoteLoss.apply(flat_hidden, call)
        result = call.result
    else:
        result = call.compute(flat_hidden, outputs=_result_outputs(call))
        loss = _loss_tensor(result, call.reduction, hidden)
    return (loss.reshape(hidden.shape[:-1]) if call.reduction == "none" else loss), result


def _loss_tensor(result, reduction, hidden):
    dtype = _loss_dtype(hidden.dtype)
    if reduction == "none":
        return torch.from_numpy(result.token_loss).to(device=hidden.device, dtype=dtype)
    return torch.tensor(result.loss, dtype=dtype, device=hidden.device)


@dataclasses.dataclass
class Scores:
    """Per-token scores of RemoteHead.score, shaped like token_ids (top-k: plus a last dim k)."""
    logprob: torch.Tensor                    # log p(token_ids), float32
    top_k_logprob: Optional[torch.Tensor]    # [..., k] float32, best first; None when k = 0
    top_k_token: Optional[torch.Tensor]      # [..., k] int64
    entropy: Optional[torch.Tensor]          # float32; None unless asked


class RemoteHead(torch.nn.Module):
    """The lm_head W [V, H] named `head` on a lossd server, as a loss module (see the module
    docstring for what forward and backward do). client: a lossd.Client or an address (a gRPC
    target: several replicas score, one server trains). The head must exist: construction asks
    the server (GetHead), so a wrong name fails here with NOT_FOUND and the names the server has,
    not at the first forward. shared_memory: forward and backward hand the rows and dL/dh over in
    memory shared with a server on this host (Client.compute's shared_memory) instead of messages.
    weight_sha256: every call is pinned to W with this SHA-256 (see pin_weights)."""

    def __init__(self, client, head, shared_memory=False, weight_sha256=None):
        super().__init__()
        self.client = client if isinstance(client, Client) else Client(client)
        self.client.get_head(head)
        self.head = head
        self.shared_memory = shared_memory
        self.weight_sha256 = weight_sha256
        self.last_result = None

    def pin_weights(self):
        """Pins this module's calls to W as the server (one replica, over several) reports it now,
        and returns its SHA-256: for a scoring session over replicas, a replica with another W (an
        update rolled out half way) then refuses calls with FAILED_PRECONDITION instead of mixing
        two heads in one evaluation. A step moves W: set weight_sha256 to None to train on."""
        self.weight_sha256 = self.client.get_head(self.head).weight_sha256
        return self.weight_sha256

    @classmethod
    def upload(cls, client, head, weight, storage_dtype="float32", replace=False,
               shared_memory=False, tied_embeddings=False, logit_softcap=0.0):
        """Creates head `head` on the server with W = weight [V, H] and returns its RemoteHead.
        tied_embeddings and logit_softcap describe the model (Client.upload_head)."""
        client = client if isinstance(client, Client) else Client(client)
        client.upload_head(head, _wire_array(weight), storage_dtype=storage_dtype,
                           replace=replace, tied_embeddings=tied_embeddings,
                           logit_softcap=logit_softcap)
        return cls(client, head, shared_memory=shared_memory)

    def extra_repr(self):
        return f"head={self.head!r}, address={self.client.address!r}"

    def forward(self, hidden, labels, *, weights=None, reduction="mean", ignore_index=-100,
                label_smoothing=0.0, z_loss_scale=0.0, logit_softcap=None, temperature=1.0,
                mean_denominator=0, shift_labels=False, objective="cross_entropy",
                sampling_logprobs=None, advantages=None, reference_logprobs=None,
                sequence_lengths=None, clip_low=0.2, clip_high=0.2, dual_clip=0.0,
                kl_estimator=None, kl_coef=0.0, entropy_coef=0.0):
        """The loss of hidden [..., H] with labels [...]: a scalar for "mean", "sum" and the
        sequence reductions, labels' shape for "none". weights [...] multiply each token's loss
        and gradient and do not enter the mean's denominator (the count of non-ignored tokens,
        or mean_denominator when > 0). logit_softcap None applies the head's soft cap
        (HeadInfo.logit_softcap), 0 none, a value > 0 that cap.

        shift_labels=True gives a causal LM's next-token loss, as transformers' models and Cut
        Cross-Entropy's shift compute it: position t of a sequence is scored against the label
        at t + 1 and the last position of each sequence is ignored, without copying hidden.
        The sequences are the rows of labels' last dimension ([B, T] labels: B sequences of T),
        or sequence_lengths (consecutive lengths summing to labels.numel()) when given. Weights
        and the objectives' per-token inputs stay with their rows.

        objective is "cross_entropy" (torch's F.cross_entropy), or an RL objective of the
        log-probabilities of labels (the sampled tokens; ignore_index masks prompt and padding):
        "importance_sampling", "ppo" or "cispo" with sampling_logprobs [...] and advantages
        [...], clip_low/clip_high (eps), dual_clip; kl_estimator ("k1", "k2", "k3") with
        reference_logprobs [...] and kl_coef; entropy_coef; reductions "seq-mean-token-sum" and
        "seq-mean-token-mean" with sequence_lengths. See Client.compute. After the call,
        self.last_result holds its LossResult (clip_fraction, mean_kl, per-token ratio, clip
        and kl for the RL objectives)."""
        labels = torch.as_tensor(labels)
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])
        labels_shape = labels.shape
        count = flat_hidden.shape[0]
        if shift_labels and sequence_lengths is None and labels.numel() > 0:
            length = labels_shape[-1] if labels.dim() > 0 else 1
            sequence_lengths = [length] * (labels.numel() // length)
        call = _LossCall(
            client=self.client, head=self.head, labels=_token_ids(labels, "labels"),
            weights=_as_numpy(weights, torch.float32, "weights", count),
            reduction=reduction,
            options=dict(ignore_index=ignore_index, label_smoothing=label_smoothing,
                         z_loss_scale=z_loss_scale, logit_softcap=logit_softcap,
                         temperature=temperature, mean_denominator=mean_denominator,
                         shift_labels=shift_labels, shared_memory=self.shared_memory,
                         objective=objective,
                         clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
                         kl_estimator=kl_estimator, kl_coef=kl_coef, entropy_coef=entropy_coef,
                         weight_sha256=self.weight_sha256,
                         sequence_lengths=_as_numpy(sequence_lengths, torch.int64,
                                                    "sequence_lengths", None)),
            token_inputs={name: _as_numpy(values, torch.float32, name, count)
                          for name, values in (("sampling_logprobs", sampling_logprobs),
                                               ("advantages", advantages),
                                               ("reference_logprobs", reference_logprobs))
                          if values is not None})
        if len(call.labels) != count:
            raise ValueError(f"labels: expected {count} entries (the rows of "
                             f"hidden {tuple(hidden.shape)}), got shape {tuple(labels_shape)}")
        loss, self.last_result = _run(call, flat_hidden, hidden)
        return loss.reshape(labels_shape) if reduction == "none" else loss

    def logprobs(self, hidden, tokens, **kwargs):
        """log p(tokens) for hidden [..., H], differentiable: RemoteLogprobs on this head."""
        return RemoteLogprobs(self.client, self.head, shared_memory=self.shared_memory,
                              weight_sha256=self.weight_sha256)(hidden, tokens, **kwargs)

    @torch.no_grad()
    def score(self, hidden, token_ids, top_k=0, entropy=False, temperature=1.0,
              logit_softcap=None):
        """log p(token_ids) under the head for hidden [..., H], with the top_k most likely tokens
        and the entropy when asked (logit_softcap as in forward). Nothing is accumulated on the
        server."""
        token_ids = torch.as_tensor(token_ids)
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])
        ids = _token_ids(token_ids, "token_ids")
        result = self.client.score(self.head, _wire_array(flat_hidden), ids, top_k=top_k,
                                   entropy=entropy, temperature=temperature,
                                   logit_softcap=logit_softcap, weight_sha256=self.weight_sha256)
        shape = tuple(token_ids.shape)
        device = hidden.device

        def as_tensor(array, dtype, extra_shape=()):
            tensor = torch.from_numpy(array).to(device=device, dtype=dtype)
            return tensor.reshape(shape + extra_shape)

        return Scores(
            logprob=as_tensor(result.logprob, torch.float32),
            top_k_logprob=(as_tensor(result.top_k_logprob, torch.float32, (top_k,))
                           if top_k else None),
            top_k_token=as_tensor(result.top_k_token, torch.int64, (top_k,)) if top_k else None,
            entropy=as_tensor(result.entropy, torch.float32) if entropy else None)

    def info(self) -> HeadInfo:
        return self.client.get_head(self.head)

    def zero_grad(self, set_to_none=True):
        """Zeroes dL/dW on the server. The module has no local parameters; set_to_none is
        accepted for nn.Module compatibility."""
        self.client.zero_grad(self.head)

    def step(self, optimizer, **kwargs) -> StepInfo:
        """An optimizer step on the server: "sgd" or "adamw", with torch.optim's defaults; the
        arguments are Client.step's (lr, momentum, betas, eps, weight_decay, max_grad_norm,
        keep_grad, head_version)."""
        return self.client.step(self.head, optimizer, **kwargs)

    def fetch_weight(self, dtype=torch.float32) -> torch.Tensor:
        """W [V, H] as a CPU tensor of dtype (float32, bfloat16 or float16)."""
        name = _wire_dtype_name(dtype)
        return _tensor_from_wire(self.client.fetch_weight(self.head, name), name)

    def fetch_grad_weight(self, dtype=torch.float32) -> torch.Tensor:
        """The accumulated dL/dW [V, H] as a CPU tensor of dtype."""
        name = _wire_dtype_name(dtype)
        return _tensor_from_wire(self.client.fetch_grad_weight(self.head, name), name)


class RemoteLogprobs(torch.nn.Module):
    """log p(tokens) under the head `head` on a lossd server, as a differentiable tensor: any torch
    function of it is a loss whose backward reaches hidden (and dL/dW on the server).

        logp = RemoteLogprobs(client, "main")(hidden, tokens)   # [...] like tokens
        loss = -F.logsigmoid(beta * (logp[chosen].sum() - logp[rejected].sum()))   # DPO, say
        loss.backward()

    forward scores the tokens (no gradient on the server); backward sends dL/dlogp per token as
    the logprob_gradient objective, in one call over the rows whose dL/dlogp is not zero, which
    returns dL/dh and adds dL/dW to the head's accumulator (pinned to the version the forward
    used: FAILED_PRECONDITION if W was stepped in between). Tokens at ignore_index get log p 0
    and no gradient. Without autograd it is a plain scoring call. The log-probabilities come
    back in float32 (float64 for float64 hidden, from float32 values)."""

    def __init__(self, client, head, shared_memory=False, weight_sha256=None):
        super().__init__()
        self.client = client if isinstance(client, Client) else Client(client)
        self.client.get_head(head)  # a wrong name fails here, as RemoteHead's does
        self.head = head
        self.shared_memory = shared_memory
        self.weight_sha256 = weight_sha256  # pins every call to this W (RemoteHead.pin_weights)

    def forward(self, hidden, tokens, *, ignore_index=-100, temperature=1.0, logit_softcap=None):
        tokens = torch.as_tensor(tokens)
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])
        call = _LossCall(
            client=self.client, head=self.head,
            labels=_token_ids(tokens, "tokens"), weights=None,
            reduction="sum",
            options=dict(ignore_index=ignore_index, temperature=temperature,
                         logit_softcap=logit_softcap, shared_memory=self.shared_memory,
                         weight_sha256=self.weight_sha256))
        if len(call.labels) != flat_hidden.shape[0]:
            raise ValueError(f"tokens: expected {flat_hidden.shape[0]} entries (the rows of "
                             f"hidden {tuple(hidden.shape)}), got shape {tuple(tokens.shape)}")
        if torch.is_grad_enabled() and hidden.requires_grad:
            logprobs = _RemoteLogprobs.apply(flat_hidden, call)
        else:
            result = call.compute(flat_hidden, outputs=["logprob"])
            logprobs = torch.from_numpy(result.logprob).to(device=hidden.device,
                                                           dtype=_loss_dtype(hidden.dtype))
        return logprobs.reshape(tokens.shape)


class RemoteDistill(torch.nn.Module):
    """Distillation of the student head `student` towards a teacher, both served by lossd, as a
    loss module (the server's "distill" objective, lossd.v1.DistillOptions):

        distill = RemoteDistill(client, student="s", teacher="t", beta=0.5, alpha=0.1,
                                temperature=2.0)
        loss = distill(h_student, h_teacher, labels)   # [..., H] and [..., H_t] for the same tokens
        loss.backward()                                # h_student.grad; dL/dW of "s" on the server

    With q = softmax(z_s / temperature) of the student's logits and p = softmax(z_t / temperature)
    of the teacher's (each after its head's own soft cap and temperature): beta 0 is the forward
    KL(p || q) of classic distillation, 1 the reverse KL(q || p) of on-policy distillation,
    between them the generalized JSD beta KL(p || m) + (1 - beta) KL(q || m),
    m = beta p + (1 - beta) q, as TRL's generalized_jsd_loss defines it. KD = temperature^2 * D
    (Hinton's scaling; TRL and Liger-Kernel leave it out), and the loss per token is
    alpha * CE(labels) + (1 - alpha) * KD, reduced as RemoteHead's loss is. labels may be None
    when alpha is 0 (every token counts). teacher=None takes a sparse teacher instead, the top-k
    of cached teacher log-probabilities per token (teacher_top_k_tokens, teacher_top_k_logprobs
    in forward; sparse_teacher_mass "renormalize" or "spread" says what becomes of the rest).

    Backward gives the student's hidden states dL/dh and accumulates the student head's dL/dW on
    the server exactly as RemoteHead does (the same upstream-gradient correction, call ids and
    retries); the teacher's hidden states get no gradient, and the teacher head is never changed.
    Without autograd (torch.no_grad(), or h_student not requiring grad) forward only scores.
    self.last_result holds the call's LossResult: kd and ce per token, mean_kd, mean_ce."""

    def __init__(self, client, student, teacher=None, *, beta=0.0, alpha=0.0, temperature=1.0,
                 teacher_temperature=1.0, teacher_logit_softcap=0.0,
                 sparse_teacher_mass="renormalize"):
        super().__init__()
        self.client = client if isinstance(client, Client) else Client(client)
        self.student = student
        self.teacher = teacher
        self.options = dict(distill_beta=beta, distill_alpha=alpha,
                            distill_temperature=temperature,
                            teacher_temperature=teacher_temperature,
                            teacher_logit_softcap=teacher_logit_softcap,
                            sparse_teacher_mass=sparse_teacher_mass)
        self.last_result = None

    def extra_repr(self):
        return (f"student={self.student!r}, teacher={self.teacher!r}, "
                f"address={self.client.address!r}")

    def forward(self, hidden, teacher_hidden=None, labels=None, *, teacher_top_k_tokens=None,
                teacher_top_k_logprobs=None, weights=None, reduction="mean", ignore_index=-100,
                label_smoothing=0.0, z_loss_scale=0.0, logit_softcap=0.0, student_temperature=1.0,
                mean_denominator=0, sequence_lengths=None):
        """The loss of the student's hidden [..., H] against the teacher's teacher_hidden
        [..., H_t] for the same tokens (or the sparse teacher's [..., k] top-k), with labels
        [...] (or None): a scalar, or labels' shape for reduction "none". The student head's own
        logit_softcap and student_temperature apply before the distillation temperature."""
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])
        count = flat_hidden.shape[0]
        side = {}
        if self.teacher is not None:
            if teacher_hidden is None:
                raise ValueError("teacher_hidden: expected the teacher's rows for the tokens of "
                                 "hidden")
            side["teacher_hidden"] = _wire_array(
                teacher_hidden.reshape(-1, teacher_hidden.shape[-1]))
        else:
            if teacher_top_k_tokens is None or teacher_top_k_logprobs is None:
                raise ValueError("teacher_top_k_tokens, teacher_top_k_logprobs: expected a "
                                 "sparse teacher, or a teacher head")
            k = torch.as_tensor(teacher_top_k_tokens).shape[-1]
            side["teacher_top_k_tokens"] = torch.as_tensor(teacher_top_k_tokens).detach().reshape(
                -1, k).to("cpu", torch.int32).numpy()
            side["teacher_top_k_logprobs"] = torch.as_tensor(
                teacher_top_k_logprobs).detach().reshape(-1, k).to("cpu", torch.float32).numpy()
        for name, rows in side.items():
            if rows.shape[0] != count:
                raise ValueError(f"{name}: expected a row for each of the {count} tokens of "
                                 f"hidden {tuple(hidden.shape)}, got {rows.shape[0]}")
        label_array = None
        if labels is not None:
            label_array = torch.as_tensor(labels).detach().reshape(-1).to(
                "cpu", torch.int64).numpy()
            if len(label_array) != count:
                raise ValueError(f"labels: expected {count} entries (the tokens of hidden "
                                 f"{tuple(hidden.shape)}), got {len(label_array)}")
        options = dict(ignore_index=ignore_index, label_smoothing=label_smoothing,
                       z_loss_scale=z_loss_scale, logit_softcap=logit_softcap,
                       temperature=student_temperature, mean_denominator=mean_denominator,
                       objective="distill", teacher_head=self.teacher,
                       sequence_lengths=_as_numpy(sequence_lengths, torch.int64,
                                                  "sequence_lengths", None),
                       **self.options)
        call = _LossCall(client=self.client, head=self.student, labels=label_array,
                         weights=_as_numpy(weights, torch.float32, "weights", count),
                         reduction=reduction, options=options, side=side)
        loss, self.last_result = _run(call, flat_hidden, hidden)
        return loss
