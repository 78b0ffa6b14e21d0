"""PyTorch layer of the lossd client: RemoteHead, an lm_head whose W [V, H] lives on a server,
and RemoteEmbedding, the input embedding of a tied head.

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
  dL/dh and stages dL/dW for an upstream gradient of 1 under the call's id
  (stage_grad_weight), without adding it. backward(g) returns g * dL/dh (reduction "none":
  g[i] * dL/dh_i per row) and commits the staged dL/dW times g / world_size: one small call, no
  recomputation. So a forward whose backward never runs (an evaluation forward in model.eval()
  without torch.no_grad(), a loss computed and dropped) adds nothing: its staged gradient is
  dropped by the next step, or after the server's --staged_grad_seconds. Where the server had no
  room to stage it (the forward then added dL/dW for an upstream of 1), where the staged gradient
  was pushed out before the backward came, and for reduction "none" with upstream gradients that
  differ between rows, backward makes ONE correction call with the same hidden rows that
  accumulates only dL/dW (grad_scale = g - 1 for "mean"/"sum", per-token weights w_i * (g_i - 1)
  for "none"; dL/dW is linear in the upstream gradient). Either way both hidden.grad and the
  server's dL/dW equal what torch computes for the same loss times g, up to float32 rounding. The
  correction is pinned to the head version the forward used; if W was stepped in between,
  backward fails with FAILED_PRECONDITION. Backward through the same graph a second time
  (retain_graph=True) accumulates g2 * dL/dW in full, as torch would.
* Without autograd (inside torch.no_grad(), or hidden.requires_grad False) forward is a plain
  scoring call: no gradients, nothing staged or accumulated on the server.
* Data parallel: under torch.distributed (or with world_size given) every rank's commit is
  divided by the world size, as DDP averages the body's gradients over ranks, and step() is
  collective: each rank calls it after its backward, the server steps once. zero_grad() of one
  rank of several drops only that rank's staged forwards (one rank zeroing the shared
  accumulator would drop the others' gradients); a step zeroes it.
* The correction adds (g - 1) * dL/dW to the float32 accumulator that already holds 1 * dL/dW, so
  its absolute rounding is about 6e-8 * |dL/dW|: relative to g * dL/dW that is fine for g of order
  1 or larger (loss scaling), poorer for |g| << 0.01. A commit scales the staged gradient itself
  and has no such rounding.

* Forward's call and backward's correction call each carry a fresh call_id, and the Client
  retries them after UNAVAILABLE or DEADLINE_EXCEEDED under that id (its RetryPolicy): a call the
  server committed before its answer was lost is answered again without its dL/dW being added a
  second time, so a retried step still accumulates exactly one loss.backward(). If the head was
  stepped (or its gradient zeroed) between the lost answer and the retry, the retry fails with
  ALREADY_EXISTS (the gradient was counted once, dL/dh cannot be had again).

Training only W on fixed hidden states (no autograd on hidden) is a Client.compute call with
accumulate_grad_weight=True followed by head.step().

torch.compile
-------------
With torch >= 2.4 RemoteHead's call to the server is a custom operator (torch.library.custom_op,
lossd::cross_entropy and lossd::cross_entropy_backward) with a fake implementation, so that a
model using RemoteHead compiles whole (fullgraph; tested with the eager and aot_eager backends)
and the server call stays one opaque node of the graph. Older torch gets the same computation as
a plain torch.autograd.Function. RemoteEmbedding's lookup and gradient are lossd::embedding_lookup
and lossd::embedding_backward. RemoteLogprobs and RemoteDistill remain
autograd.Functions: a model using them does not compile whole.

Dtypes: float32 and float64 hidden states travel as float32, bfloat16 and float16 as themselves.
dL/dh comes back in bfloat16 for bfloat16 inputs and in float32 otherwise (float16 would flush the
small per-token gradients of a large mean to zero), and hidden.grad has hidden's dtype. The loss is
float64 for float64 inputs, float32 otherwise.
"""
import collections
import dataclasses
import itertools
import weakref
from typing import Optional, Tuple

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from lossd._address import replica_group
from lossd.client import (DEFAULT_IGNORE_INDEX, Client, GradNormInfo, HeadInfo, LossdError,
                          StepInfo)
from lossd.options import (REDUCTIONS, LossOptions, _enum_name, options_from_keywords)
from lossd.v1 import lossd_pb2 as pb

_WIRE_NAME_OF_TORCH_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                             torch.float16: "float16"}
_TORCH_DTYPE_OF_WIRE_NAME = {name: dtype for dtype, name in _WIRE_NAME_OF_TORCH_DTYPE.items()}
# torch.library.custom_op and register_fake arrived in torch 2.4.
_CUSTOM_OPS = hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_fake")


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


def _check_token_ids(ids, field):
    """Refuses a tensor of anything but integer ids, as Client.compute does, rather than
    truncating it."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{field}: expected integer token ids, got {ids.dtype} values; cast "
                        f"them with .long() if they are ids")


def _token_ids(values, field):
    """values (a tensor, array or list of ids) as a flat CPU int64 numpy array."""
    ids = torch.as_tensor(values).detach()
    _check_token_ids(ids, field)
    return ids.reshape(-1).to("cpu", torch.int64).numpy()


def _grad_hidden_wire_dtype(hidden_dtype):
    return "bfloat16" if hidden_dtype == torch.bfloat16 else "float32"


def _loss_dtype(hidden_dtype):
    return torch.float64 if hidden_dtype == torch.float64 else torch.float32


def _numpy(tensor, dtype):
    return None if tensor is None else tensor.detach().reshape(-1).to("cpu", dtype).numpy()


# The operators below take plain values, not Python objects: a module is named by an id in this
# registry, which holds it weakly.
_MODULES = weakref.WeakValueDictionary()
_MODULE_IDS = itertools.count(1)


def _register(module):
    module_id = next(_MODULE_IDS)
    _MODULES[module_id] = module
    return module_id


def _module(module_id):
    module = _MODULES.get(module_id)
    if module is None:
        raise RuntimeError(f"lossd: module {module_id} of this computation no longer exists")
    return module


@dataclasses.dataclass
class _Forward:
    """A training forward whose dL/dW awaits its first backward: staged on the server under
    call_id (committed by the backward times its upstream gradient), or, where the server had no
    room to stage it, already accumulated for an upstream gradient of 1."""
    call_id: str
    staged: bool


# Training forwards whose first backward has yet to run, by forward id. A forward whose backward
# never comes leaves its entry here (and its staged gradient on the server until a step, a
# discard or its expiry drops it); the oldest go past this many.
_AWAITING_BACKWARD = collections.OrderedDict()
_MAX_AWAITING_BACKWARD = 1 << 20
_CALL_IDS = itertools.count(1)


def _await_backward(result):
    """Records a training forward's result; returns the id its backward will name."""
    forward_id = next(_CALL_IDS)
    _AWAITING_BACKWARD[forward_id] = _Forward(result.call_id, result.grad_weight_staged)
    while len(_AWAITING_BACKWARD) > _MAX_AWAITING_BACKWARD:
        _AWAITING_BACKWARD.popitem(last=False)
    return forward_id


def data_parallel_world(process_group=None):
    """(world size, rank) of the data-parallel job this process belongs to: process_group's, or
    torch.distributed's default group when it is initialized, else (1, 0)."""
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        if process_group is not None:
            raise ValueError("process_group: given, but torch.distributed is not initialized")
        return 1, 0
    return (distributed.get_world_size(process_group), distributed.get_rank(process_group))


def _sequence_lengths(lengths, shift_labels, row_length, num_tokens):
    """The sequences of a call: those given; for a shifted call without them, the rows of
    labels' last dimension; else none."""
    if lengths is not None:
        return _numpy(lengths, torch.int64)
    if not shift_labels or num_tokens == 0:
        return None
    return np.full(num_tokens // row_length, row_length, dtype=np.int64)


# The objectives' per-token inputs, tensors of the operators after the sequence lengths.
_TOKEN_INPUT_NAMES = ("sampling_logprobs", "advantages", "reference_logprobs", "rollout_logprobs")
# The cross-entropy operator's tensor arguments, in order.
_OPERATOR_TENSORS = ("hidden", "labels", "weights", "sequence_lengths", *_TOKEN_INPUT_NAMES)


def _pack_options(options):
    """A LossOptions as the operators take it: its proto's deterministic bytes, in hex (a string
    argument, a constant that torch.compile guards on)."""
    return options.to_proto().SerializeToString(deterministic=True).hex()


def _packed_keywords(options, **keywords):
    """_pack_options of options_from_keywords: under torch.compile a constant computed when the
    graph is traced (the options are Python values, not tensors), so that building them stays
    out of the graph."""
    return _pack_options(options_from_keywords(options, **keywords))


if hasattr(getattr(torch, "compiler", None), "assume_constant_result"):
    _packed_keywords = torch.compiler.assume_constant_result(_packed_keywords)


def _unpack_options(packed):
    return LossOptions.from_proto(pb.LossOptions.FromString(bytes.fromhex(packed)))


def _reduction(options):
    """The reduction's own name (verl's aliases resolved)."""
    return _enum_name(pb.Reduction.DESCRIPTOR, REDUCTIONS[options.reduction])


def _result_outputs(call):
    """The per-token outputs a forward asks for beside dL/dh: the per-token loss for "none", the
    policy objectives' ratio, clip state and KL estimate, and distillation's KD and CE terms."""
    outputs = ["token_loss"] if call.reduction == "none" else []
    if call.loss.objective == "distill":
        return outputs + ["kd"] + (["ce"] if call.labels is not None else [])
    if call.loss.objective != "cross_entropy" or call.loss.policy.kl_estimator not in (None,
                                                                                        "none"):
        outputs += ["ratio", "clip", "kl"]
    return outputs


@dataclasses.dataclass
class _LossCall:
    """What a forward sent, kept for the calls its backward may make."""
    client: Client
    head: str
    labels: Optional[np.ndarray]   # [N] int64, or None (distill without labels)
    weights: Optional[np.ndarray]  # [N] float32 or None
    loss: LossOptions              # the loss, its objective and their options
    # The remaining Client.compute arguments (sequences, shift_labels, transfer, pins, teacher).
    extra: dict = dataclasses.field(default_factory=dict)
    token_inputs: dict = dataclasses.field(default_factory=dict)  # name -> [N] float32
    # Client.compute arguments with a row per row of hidden, sent beside it (a teacher's).
    side: dict = dataclasses.field(default_factory=dict)
    result: object = None          # the forward's LossResult
    world_size: int = 1            # ranks whose gradients the head averages (DDP)

    @property
    def reduction(self):
        return _reduction(self.loss)

    @property
    def ignore_index(self):
        return DEFAULT_IGNORE_INDEX if self.loss.ignore_index is None else self.loss.ignore_index

    def compute(self, hidden, **kwargs):
        """Client.compute of this call; keywords that name options change them (grad_scale, an
        objective), the others are compute's own."""
        return self.client.compute(self.head, _wire_array(hidden), self.labels,
                                   weights=self.weights, options=self.loss,
                                   **{**self.extra, **self.token_inputs, **self.side, **kwargs})

    def counted(self):
        """[N] bool: the rows whose label is not ignore_index (all of them without labels)."""
        if self.labels is None:
            return np.ones(len(self.weights) if self.weights is not None else self.num_rows(),
                           bool)
        return self.labels != self.ignore_index

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
            extra={k: v for k, v in self.extra.items() if k != "sequence_lengths"},
            weights=None if self.weights is None else self.weights[rows],
            token_inputs={name: values[rows] for name, values in self.token_inputs.items()},
            side={name: values[rows] for name, values in self.side.items()})
        return dataclasses.replace(self, **{**fields, **replace})


def _operator_call(labels, weights, sequence_lengths, token_inputs, head_id, options,
                   shift_labels, row_length):
    """The _LossCall of RemoteHead's operators, from their values (options packed by
    _pack_options; row_length: the length of labels' last dimension, a shifted call's
    sequences when none are given)."""
    head = _module(head_id)
    labels = _numpy(labels, torch.int64)
    extra = dict(shift_labels=shift_labels, shared_memory=head.shared_memory,
                 weight_sha256=head.weight_sha256,
                 sequence_lengths=_sequence_lengths(sequence_lengths, shift_labels, row_length,
                                                    labels.shape[0]))
    return _LossCall(client=head.client, head=head.head, labels=labels,
                     weights=_numpy(weights, torch.float32), loss=_unpack_options(options),
                     extra=extra,
                     token_inputs={name: _numpy(values, torch.float32)
                                   for name, values in zip(_TOKEN_INPUT_NAMES, token_inputs)
                                   if values is not None},
                     world_size=head.world()[0])


def _correct_grad_weight(call, hidden, upstream, already, pinned):
    """Brings the server's dL/dW from `already` times this call's dL/dW to `upstream` (a CPU
    tensor: a scalar, or [N] for reduction "none") times it, with at most one call that
    accumulates only dL/dW (it is linear in the upstream gradient). hidden: the call's rows
    [N, H]. pinned: the versions of the heads the forward read; the correction reads them too,
    or fails (FAILED_PRECONDITION)."""
    correct = dict(accumulate_grad_weight=True, **pinned)
    if call.reduction != "none":
        scale = float(upstream) - already
        if scale != 0.0:
            call.compute(hidden, grad_scale=scale, **correct)
        return
    counted = call.counted()
    weights = np.ones(len(counted)) if call.weights is None else call.weights.astype(np.float64)
    correction = weights * (upstream.reshape(-1).numpy() - already)
    if call.extra.get("shift_labels"):
        # Row i predicts the label of row i + 1: the rows cannot be picked apart from their
        # neighbours, so all of them go, weighted.
        if np.any(correction != 0.0):
            dataclasses.replace(call, weights=correction.astype(np.float32)).compute(
                hidden, **correct)
        return
    # Rows with a zero correction or an ignored label add nothing: send only the others.
    rows = np.flatnonzero((correction != 0.0) & counted)
    if rows.size:
        call.rows(rows, weights=correction[rows].astype(np.float32)).compute(
            hidden[torch.from_numpy(rows).to(hidden.device)], **correct)


def _commit_backward(call, hidden, upstream, forward, pinned):
    """Brings the head's accumulated dL/dW to upstream / world size (a CPU tensor: a scalar, or
    [N] for reduction "none") times this call's, as DDP averages gradients over ranks: a
    staged forward is committed times that scale (no second call); one whose gradient the server
    accumulated for an upstream of 1, or whose staged gradient is gone (evicted, expired), or a
    second backward through the same graph (forward None), gets a correction call."""
    upstream = upstream / call.world_size
    already = 0.0
    if forward is not None and forward.staged:
        values = upstream.reshape(-1)
        if values.numel() > 0 and bool((values == values[0]).all()):
            try:
                call.client.commit_grad_weight(call.head, forward.call_id, float(values[0]))
                return
            except LossdError as error:
                if error.code != "NOT_FOUND":
                    raise
        else:
            call.client.discard_grad_weight(call.head, [forward.call_id])
    elif forward is not None:
        already = 1.0
    _correct_grad_weight(call, hidden, upstream, already, pinned)


def _loss_tensor(result, reduction, hidden):
    dtype = _loss_dtype(hidden.dtype)
    if reduction == "none":
        return torch.from_numpy(result.token_loss).to(device=hidden.device, dtype=dtype)
    return torch.tensor(result.loss, dtype=dtype, device=hidden.device)


def _cross_entropy_forward(hidden, labels, weights, sequence_lengths, sampling_logprobs,
                           advantages, reference_logprobs, rollout_logprobs, head_id,
                           *options_and_train):
    """The server call of a forward: (loss, dL/dh in the wire's dtype (empty unless training),
    state [call id, head version]). The head keeps the LossResult as last_result."""
    *options, train = options_and_train
    call = _operator_call(labels, weights, sequence_lengths,
                          (sampling_logprobs, advantages, reference_logprobs, rollout_logprobs),
                          head_id, *options)
    module = _module(head_id)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    outputs = _result_outputs(call)
    grad_dtype = _grad_hidden_wire_dtype(hidden.dtype)
    if train:
        result = module._tracked(lambda pin: call.compute(
            flat_hidden, outputs=outputs + ["grad_hidden"], grad_hidden_dtype=grad_dtype,
            accumulate_grad_weight=True, stage_grad_weight=module.stage_grad_weight,
            head_version=pin), train=True)
        grad_hidden = _tensor_from_wire(result.grad_hidden, grad_dtype)
        grad_hidden = grad_hidden.to(hidden.device).view(hidden.shape)
        call_id = _await_backward(result)
        # The result lives on as last_result; dL/dh lives on in the graph, as it must, and
        # nowhere else once backward has run.
        result.grad_hidden = None
    else:
        result = module._tracked(lambda pin: call.compute(flat_hidden, outputs=outputs,
                                                          head_version=pin), train=False)
        grad_hidden = torch.empty(0, dtype=_TORCH_DTYPE_OF_WIRE_NAME[grad_dtype],
                                  device=hidden.device)
        call_id = 0
    module.last_result = result
    loss = _loss_tensor(result, call.reduction, hidden)
    if call.reduction == "none":
        loss = loss.view(labels.shape)
    return loss, grad_hidden, torch.tensor([call_id, result.head_version], dtype=torch.int64)


def _cross_entropy_backward(upstream, grad_hidden, hidden, labels, weights, sequence_lengths,
                            sampling_logprobs, advantages, reference_logprobs, rollout_logprobs,
                            state, head_id, *options):
    """upstream * dL/dh, after bringing the server's dL/dW to upstream times this call's (one
    correction call that accumulates only dL/dW, pinned to the forward's head version)."""
    call = _operator_call(labels, weights, sequence_lengths,
                          (sampling_logprobs, advantages, reference_logprobs, rollout_logprobs),
                          head_id, *options)
    call_id, head_version = (int(x) for x in state.tolist())
    # The first backward through the graph commits the forward's dL/dW; later ones add in full.
    forward = _AWAITING_BACKWARD.pop(call_id, None)
    loss_dtype = _loss_dtype(hidden.dtype)
    upstream = upstream.detach().to(device=hidden.device, dtype=loss_dtype)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    grad = grad_hidden.to(device=hidden.device, dtype=loss_dtype).reshape(flat_hidden.shape)
    grad = grad * (upstream.reshape(-1, 1) if call.reduction == "none" else upstream)
    _commit_backward(call, flat_hidden, upstream.cpu(), forward, dict(head_version=head_version))
    return grad.view(hidden.shape).to(hidden.dtype)


def _embedding_lookup(token_ids, anchor, head_id, dtype):
    """(rows [*token_ids.shape, H] in dtype, state [head version]): each distinct id is asked for
    once."""
    module = _module(head_id)
    ids = _numpy(token_ids, torch.int64)
    unique, inverse = np.unique(ids, return_inverse=True)
    looked_up = module.client.lookup_embedding(module.head, unique,
                                               dtype=_WIRE_NAME_OF_TORCH_DTYPE[dtype])
    rows = _tensor_from_wire(looked_up.rows, _WIRE_NAME_OF_TORCH_DTYPE[dtype])
    rows = rows[torch.from_numpy(inverse.reshape(-1))]
    rows = rows.view(tuple(token_ids.shape) + (looked_up.rows.shape[1],)).to(anchor.device)
    return rows, torch.tensor([looked_up.head_version], dtype=torch.int64)


def _embedding_backward(grad, token_ids, state, anchor, head_id, padding_idx):
    """Sends the gradient of the looked-up rows to the server, summed per distinct id (rows of
    padding_idx get none, as in torch.nn.Embedding); returns the anchor's (empty) gradient."""
    module = _module(head_id)
    ids = token_ids.detach().reshape(-1).cpu()
    grad = grad.detach().reshape(ids.shape[0], -1).to("cpu", torch.float32)
    if padding_idx >= 0:
        keep = ids != padding_idx
        ids, grad = ids[keep], grad[keep]
    unique, inverse = torch.unique(ids, return_inverse=True)
    sums = torch.zeros(unique.shape[0], grad.shape[1], dtype=torch.float32)
    sums.index_add_(0, inverse, grad)
    world_size = data_parallel_world(module.process_group)[0]
    if world_size > 1:
        sums /= world_size  # averaged over the ranks, as RemoteHead's dL/dW is
    module.client.accumulate_embedding_grad(module.head, unique.numpy(), sums.numpy(),
                                            head_version=int(state[0]))
    return torch.zeros_like(anchor)


if _CUSTOM_OPS:
    @torch.library.custom_op("lossd::cross_entropy", mutates_args=())
    def _cross_entropy_op(
            hidden: torch.Tensor, labels: torch.Tensor, weights: Optional[torch.Tensor],
            sequence_lengths: Optional[torch.Tensor], sampling_logprobs: Optional[torch.Tensor],
            advantages: Optional[torch.Tensor], reference_logprobs: Optional[torch.Tensor],
            rollout_logprobs: Optional[torch.Tensor], head_id: int, options: str,
            shift_labels: bool, row_length: int,
            train: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _cross_entropy_forward(
            hidden, labels, weights, sequence_lengths, sampling_logprobs, advantages,
            reference_logprobs, rollout_logprobs, head_id, options, shift_labels, row_length,
            train)

    @_cross_entropy_op.register_fake
    def _(hidden, labels, weights, sequence_lengths, sampling_logprobs, advantages,
          reference_logprobs, rollout_logprobs, head_id, options, shift_labels, row_length,
          train):
        loss_shape = labels.shape if _reduction(_unpack_options(options)) == "none" else ()
        loss = hidden.new_empty(loss_shape, dtype=_loss_dtype(hidden.dtype))
        grad_dtype = _TORCH_DTYPE_OF_WIRE_NAME[_grad_hidden_wire_dtype(hidden.dtype)]
        grad_hidden = hidden.new_empty(hidden.shape if train else (0,), dtype=grad_dtype)
        return loss, grad_hidden, hidden.new_empty((2,), dtype=torch.int64, device="cpu")

    @torch.library.custom_op("lossd::cross_entropy_backward", mutates_args=())
    def _cross_entropy_backward_op(
            upstream: torch.Tensor, grad_hidden: torch.Tensor, hidden: torch.Tensor,
            labels: torch.Tensor, weights: Optional[torch.Tensor],
            sequence_lengths: Optional[torch.Tensor], sampling_logprobs: Optional[torch.Tensor],
            advantages: Optional[torch.Tensor], reference_logprobs: Optional[torch.Tensor],
            rollout_logprobs: Optional[torch.Tensor], state: torch.Tensor, head_id: int,
            options: str, shift_labels: bool, row_length: int) -> torch.Tensor:
        return _cross_entropy_backward(
            upstream, grad_hidden, hidden, labels, weights, sequence_lengths, sampling_logprobs,
            advantages, reference_logprobs, rollout_logprobs, state, head_id, options,
            shift_labels, row_length)

    @_cross_entropy_backward_op.register_fake
    def _(upstream, grad_hidden, hidden, *args):
        return torch.empty_like(hidden)

    def _cross_entropy_setup_context(ctx, inputs, output):
        _, grad_hidden, state = output
        tensors = len(_OPERATOR_TENSORS)
        ctx.save_for_backward(grad_hidden, *inputs[:tensors], state)
        ctx.options = inputs[tensors:-1]  # head_id .. row_length; train is always True here
        ctx.module = _module(inputs[tensors])  # the registry's reference is weak: held for backward

    def _cross_entropy_op_backward(ctx, upstream, _grad_of_grad_hidden, _grad_of_state):
        grad_hidden, *tensors, state = ctx.saved_tensors
        grad = _cross_entropy_backward_op(upstream, grad_hidden, *tensors, state, *ctx.options)
        return (grad,) + (None,) * (len(tensors) - 1 + len(ctx.options) + 1)

    _cross_entropy_op.register_autograd(_cross_entropy_op_backward,
                                        setup_context=_cross_entropy_setup_context)

    @torch.library.custom_op("lossd::embedding_lookup", mutates_args=())
    def _embedding_lookup_op(token_ids: torch.Tensor, anchor: torch.Tensor, head_id: int,
                             dtype: torch.dtype, hidden_size: int
                             ) -> Tuple[torch.Tensor, torch.Tensor]:
        return _embedding_lookup(token_ids, anchor, head_id, dtype)

    @_embedding_lookup_op.register_fake
    def _(token_ids, anchor, head_id, dtype, hidden_size):
        rows = anchor.new_empty(tuple(token_ids.shape) + (hidden_size,), dtype=dtype)
        return rows, token_ids.new_empty((1,), dtype=torch.int64, device="cpu")

    @torch.library.custom_op("lossd::embedding_backward", mutates_args=())
    def _embedding_backward_op(grad: torch.Tensor, token_ids: torch.Tensor, state: torch.Tensor,
                               anchor: torch.Tensor, head_id: int,
                               padding_idx: int) -> torch.Tensor:
        return _embedding_backward(grad, token_ids, state, anchor, head_id, padding_idx)

    @_embedding_backward_op.register_fake
    def _(grad, token_ids, state, anchor, head_id, padding_idx):
        return torch.empty_like(anchor)

    def _embedding_setup_context(ctx, inputs, output):
        token_ids, anchor, head_id, _, _ = inputs
        ctx.save_for_backward(token_ids, output[1], anchor)
        ctx.head_id = head_id
        ctx.module = _module(head_id)  # the registry's reference is weak: held for backward

    def _embedding_op_backward(ctx, grad, _grad_of_state):
        token_ids, state, anchor = ctx.saved_tensors
        anchor_grad = _embedding_backward_op(grad, token_ids, state, anchor, ctx.head_id,
                                             ctx.module.padding_idx)
        return None, anchor_grad, None, None, None

    _embedding_lookup_op.register_autograd(_embedding_op_backward,
                                           setup_context=_embedding_setup_context)


def _head_logits(hidden, head_id):
    """hidden [..., H] @ W.T with the head's soft cap, in hidden's dtype, from a copy of W held
    by the module and fetched again when W's version moves."""
    return _module(head_id)._logits(hidden)


if _CUSTOM_OPS:
    @torch.library.custom_op("lossd::head_logits", mutates_args=())
    def _head_logits_op(hidden: torch.Tensor, head_id: int, vocab_size: int) -> torch.Tensor:
        return _head_logits(hidden, head_id)

    @_head_logits_op.register_fake
    def _(hidden, head_id, vocab_size):
        return hidden.new_empty(tuple(hidden.shape[:-1]) + (vocab_size,))


class _CrossEntropyFunction(torch.autograd.Function):
    """lossd::cross_entropy for torch without custom operators: the same server calls."""

    @staticmethod
    def forward(ctx, *inputs):
        tensors, options = inputs[:len(_OPERATOR_TENSORS)], inputs[len(_OPERATOR_TENSORS):]
        loss, grad_hidden, state = _cross_entropy_forward(*tensors, *options, True)
        ctx.save_for_backward(grad_hidden, *tensors, state)
        ctx.options = options
        ctx.module = _module(options[0])  # the registry's reference is weak: held for backward
        return loss

    @staticmethod
    def backward(ctx, upstream):
        grad_hidden, *tensors, state = ctx.saved_tensors
        grad = _cross_entropy_backward(upstream, grad_hidden, *tensors, state, *ctx.options)
        return (grad,) + (None,) * (len(tensors) - 1 + len(ctx.options))


class _EmbeddingFunction(torch.autograd.Function):
    """lossd::embedding_lookup for torch without custom operators."""

    @staticmethod
    def forward(ctx, token_ids, anchor, head_id, dtype, hidden_size):
        rows, state = _embedding_lookup(token_ids, anchor, head_id, dtype)
        ctx.save_for_backward(token_ids, state, anchor)
        ctx.head_id = head_id
        ctx.module = _module(head_id)  # the registry's reference is weak: held for backward
        return rows

    @staticmethod
    def backward(ctx, grad):
        token_ids, state, anchor = ctx.saved_tensors
        anchor_grad = _embedding_backward(grad, token_ids, state, anchor, ctx.head_id,
                                          ctx.module.padding_idx)
        return None, anchor_grad, None, None, None


def _cross_entropy(tensors, options, train):
    """The loss of RemoteHead.forward through the custom operator, or the autograd.Function."""
    if _CUSTOM_OPS:
        loss, _, _ = torch.ops.lossd.cross_entropy(*tensors, *options, train)
        return loss
    if train:
        return _CrossEntropyFunction.apply(*tensors, *options)
    return _cross_entropy_forward(*tensors, *options, False)[0]


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
    """loss(hidden [N, H]) with dL/dh from the server; dL/dW accumulates on the server. The same
    computation as lossd::cross_entropy, for calls the operator does not take (a teacher's)."""

    @staticmethod
    def forward(ctx, hidden, call):
        result = call.compute(
            hidden, outputs=["grad_hidden"] + _result_outputs(call),
            grad_hidden_dtype=_grad_hidden_wire_dtype(hidden.dtype), accumulate_grad_weight=True,
            stage_grad_weight=True)
        call.result = result
        ctx.save_for_backward(hidden)
        ctx.call = call
        ctx.pinned = dict(head_version=result.head_version)
        if call.extra.get("teacher_head") is not None:
            ctx.pinned["teacher_head_version"] = result.teacher_head_version
        ctx.grad_hidden = _tensor_from_wire(result.grad_hidden,
                                            _grad_hidden_wire_dtype(hidden.dtype))
        result.grad_hidden = None  # lives on in ctx until backward, not in the result
        # The first backward commits the forward's dL/dW; later ones add in full.
        ctx.forward = _Forward(result.call_id, result.grad_weight_staged)
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
        _commit_backward(call, hidden, upstream.cpu(), ctx.forward, ctx.pinned)
        ctx.forward = None
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
        rows = np.flatnonzero((upstream != 0.0) & (call.labels != call.ignore_index))
        if rows.size == 0:
            return grad_hidden.to(hidden.dtype), None
        grad_dtype = _grad_hidden_wire_dtype(hidden.dtype)
        device_rows = torch.from_numpy(rows).to(hidden.device)
        gradient_call = call.rows(rows)
        gradient_call.loss = gradient_call.loss.replace(objective="logprob_gradient")
        gradient_call.token_inputs = dict(logprob_grads=upstream[rows])
        pinned = dict(head_version=ctx.head_version)
        result = gradient_call.compute(
            hidden[device_rows], outputs=["grad_hidden"], grad_hidden_dtype=grad_dtype,
            accumulate_grad_weight=True, stage_grad_weight=True, **pinned)
        # dL/dlogp carries the upstream gradient: the commit only averages over ranks.
        _commit_backward(gradient_call, hidden[device_rows], torch.tensor(1.0),
                         _Forward(result.call_id, result.grad_weight_staged), pinned)
        grad_hidden[device_rows] = _tensor_from_wire(result.grad_hidden, grad_dtype).to(
            device=hidden.device, dtype=math_dtype)
        return grad_hidden.to(hidden.dtype), None


class HeadMovedError(LossdError):
    """W on the server is not at the version this module trained it to: the server restarted
    without its checkpoint, or another client stepped or replaced the head. Training on would
    train another W. known: the version this module last saw; server: the server's now (None
    when it could not be asked)."""

    def __init__(self, head, known, server, why):
        super().__init__("Compute", "FAILED_PRECONDITION", f"head {head!r}: {why}")
        self.head, self.known_version, self.server_version = head, known, server


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
    not at the first forward. shared_memory: whether forward and backward hand the rows and dL/dh
    over in memory shared with a server on this host (Client.compute's shared_memory) instead of
    messages; None, the default, leaves it to the Client (which does for a local server).
    weight_sha256: every call is pinned to W with this SHA-256 (see pin_weights).

    Data-parallel training (DDP, FSDP, the Trainer on several processes): every rank holds a
    RemoteHead on the same server head. dL/dW is averaged over the ranks as DDP averages the
    body's gradients (each rank commits its share divided by the world size), and step() is
    collective: every rank calls it after its backward, and the server steps W once. The world
    is process_group's, or torch.distributed's default group when it is initialized (at each
    call), or world_size and rank when given; without torch.distributed it is this process alone.

    Several servers can train one head as a replica group (lossd_server --replicas=R): trainer
    rank r then talks to replica r % R (lossd.replica_address picks its address), and
    replicas=R tells this module so. Its commits still average over the whole world; its step()
    and grad_norm() meet the ranks of its replica (world size: the ranks that replica serves,
    rank: r // R), and the replicas all-reduce their gradients before W steps everywhere.

    The module keeps the version of W it trains (version): once it has trained, every call is
    pinned to it, so that a W that moved under it (a server restarted without its checkpoint,
    another client's step or upload) raises HeadMovedError naming both versions instead of
    training on. track_version=False turns that off (a head that others step on purpose).
    stage_grad_weight=False makes a forward accumulate dL/dW at once, for an upstream gradient of
    1, as servers without staged gradients do (see the module docstring)."""

    def __init__(self, client, head, shared_memory=None, weight_sha256=None, *,
                 world_size=None, rank=None, process_group=None, track_version=True,
                 stage_grad_weight=True, replicas=None):
        super().__init__()
        self.client = client if isinstance(client, Client) else Client(client)
        info = self.client.get_head(head)
        self.head = head
        self.shared_memory = shared_memory
        self.weight_sha256 = weight_sha256
        self.last_result = None
        if (world_size is None) != (rank is None):
            raise ValueError("world_size, rank: give both or neither")
        if world_size is not None and not 0 <= rank < world_size:
            raise ValueError(f"rank: expected 0 to {world_size - 1}, got {rank}")
        self.world_size, self.rank, self.process_group = world_size, rank, process_group
        if replicas is not None and not (isinstance(replicas, int) and replicas >= 1):
            raise ValueError(f"replicas: expected an int >= 1 (the servers of the replica "
                             f"group), got {replicas!r}")
        self.replicas = replicas
        self.track_version = track_version
        self.stage_grad_weight = stage_grad_weight
        self.version = info.version  # of W as this module last saw it
        self.trained = False         # whether this module has trained W (pins calls once it has)
        self.vocab_size = info.vocab_size
        self.logit_softcap = info.logit_softcap
        self._weight_copy = None     # (version, W) for logits
        self._id = _register(self)

    def world(self):
        """(world size, rank) whose gradients this head averages and whose steps are one."""
        if self.world_size is not None:
            return self.world_size, self.rank
        return data_parallel_world(self.process_group)

    def step_group(self):
        """(world size, rank) of the ranks that meet on this module's server for step() and
        grad_norm(): the whole world, or with replicas the ranks of this rank's replica."""
        world_size, rank = self.world()
        if self.replicas is None:
            return world_size, rank
        return replica_group(world_size, rank, self.replicas)

    def _tracked(self, call, train):
        """call(pin) with pin the version this module trained W to (None before it trained, or
        without tracking); remembers the version the server reports, and turns a refusal of the
        pinned version into a HeadMovedError that says what happened."""
        pin = self.version if self.track_version and self.trained else None
        try:
            result = call(pin)
        except LossdError as error:
            if pin is not None and error.reason == "HEAD_MOVED" and \
                    error.field == "head_version":
                raise self._moved(error) from None
            raise
        self.version = result.head_version
        self.trained = self.trained or train
        return result

    def _moved(self, error):
        """The HeadMovedError of a call refused because W is not at self.version."""
        try:
            info = self.client.get_head(self.head)
        except LossdError:
            return HeadMovedError(self.head, self.version, None, error.message)
        if info.version < self.version:
            why = (f"the server's version went back from {self.version} to {info.version}: it "
                   f"restarted without this head's latest checkpoint (start it with "
                   f"--checkpoint_dir and save checkpoints as you train), or the head was "
                   f"replaced; W is now {info.source!r}. Resume from the checkpoint that matches "
                   f"the server's version, or restart training")
        else:
            why = (f"W moved from version {self.version} to {info.version} without this "
                   f"module's step (another client stepped or replaced it). If that is meant, "
                   f"set track_version=False, or reload the version with head.follow()")
        return HeadMovedError(self.head, self.version, info.version, why)

    def logits(self, hidden):
        """hidden [..., H] @ W.T, with the head's soft cap, in hidden's dtype: the logits a local
        lm_head would give, for generation and inspection. They carry no gradient to W (train
        through forward); asked under autograd for hidden that requires grad, they are refused.
        Computed here from a copy of W fetched once per version of W (under torch.compile, an
        opaque custom operator)."""
        if torch.is_grad_enabled() and hidden.requires_grad:
            raise RuntimeError(
                "RemoteHead.logits: the logits come from a copy of W and carry no gradient to W "
                "on the server; train through forward (the loss), or ask for logits under "
                "torch.no_grad()")
        if _CUSTOM_OPS:
            return torch.ops.lossd.head_logits(hidden, self._id, self.vocab_size)
        return _head_logits(hidden, self._id)

    def _logits(self, hidden):
        # A module that trains W here knows its version; one that does not follows the server.
        version = self.version if self.trained else self.client.get_head(self.head).version
        copy = self._weight_copy
        if copy is None or copy[0] != version or copy[1].dtype != hidden.dtype or \
                copy[1].device != hidden.device:
            copy = (version, self.fetch_weight(torch.float32).to(hidden.device, hidden.dtype))
            self._weight_copy = copy
        logits = hidden @ copy[1].T
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def norm_proxy(self):
        """A parameter [1] of this module whose gradient stands for W's (trainer integrations,
        lossd.hf.Trainer): set to |dL/dW| before the model's gradients are clipped, it puts W in
        clip_grad_norm_'s global norm and the logged grad_norm, and clipping scales it by the
        multiplier W's step must take. It does not require grad, so optimizers and DDP leave it
        alone."""
        if not hasattr(self, "grad_norm_proxy"):
            self.grad_norm_proxy = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        return self.grad_norm_proxy

    def follow(self):
        """Takes the server's current version of W as this module's, after a move that was
        meant (see HeadMovedError); returns it."""
        self.version = self.client.get_head(self.head).version
        return self.version

    def pin_weights(self):
        """Pins this module's calls to W as the server (one replica, over several) reports it now,
        and returns its SHA-256: for a scoring session over replicas, a replica with another W (an
        update rolled out half way) then refuses calls with FAILED_PRECONDITION instead of mixing
        two heads in one evaluation. A step moves W: set weight_sha256 to None to train on."""
        self.weight_sha256 = self.client.get_head(self.head).weight_sha256
        return self.weight_sha256

    @classmethod
    def upload(cls, client, head, weight, storage_dtype="float32", replace=False,
               shared_memory=None, tied_embeddings=False, logit_softcap=0.0):
        """Creates head `head` on the server with W = weight [V, H] and returns its RemoteHead.
        tied_embeddings and logit_softcap describe the model (Client.upload_head)."""
        client = client if isinstance(client, Client) else Client(client)
        client.upload_head(head, _wire_array(weight), storage_dtype=storage_dtype,
                           replace=replace, tied_embeddings=tied_embeddings,
                           logit_softcap=logit_softcap)
        return cls(client, head, shared_memory=shared_memory)

    def extra_repr(self):
        return f"head={self.head!r}, address={self.client.address!r}"

    def forward(self, hidden, labels, *, options=None, weights=None, shift_labels=False,
                sequence_lengths=None, sampling_logprobs=None, advantages=None,
                reference_logprobs=None, rollout_logprobs=None, **option_keywords):
        """The loss of hidden [..., H] with labels [...]: a scalar for "mean", "sum" and the
        sequence reductions, labels' shape for "none". options (a lossd.LossOptions) and
        keywords that name its fields (reduction, ignore_index, label_smoothing, z_loss_scale,
        logit_softcap, temperature, mean_denominator, objective, clip_low, clip_high, dual_clip,
        kl_estimator, kl_coef, entropy_coef, ...: see lossd.options and Client.compute) set the
        loss. weights [...] multiply each token's loss and gradient and do not enter the mean's
        denominator (the count of non-ignored tokens, or mean_denominator when > 0).
        logit_softcap None applies the head's soft cap (HeadInfo.logit_softcap), 0 none, a value
        > 0 that cap.

        shift_labels=True gives a causal LM's next-token loss, as transformers' models and Cut
        Cross-Entropy's shift compute it: position t of a sequence is scored against the label
        at t + 1 and the last position of each sequence is ignored, without copying hidden.
        The sequences are the rows of labels' last dimension ([B, T] labels: B sequences of T),
        or sequence_lengths (consecutive lengths summing to labels.numel()) when given. Weights
        and the objectives' per-token inputs stay with their rows.

        objective is "cross_entropy" (torch's F.cross_entropy), or an RL objective of the
        log-probabilities of labels (the sampled tokens; ignore_index masks prompt and padding):
        "importance_sampling", "ppo" or "cispo" with sampling_logprobs [...] and advantages
        [...] (also "dro", "sapo", and "gspo" with sequence_lengths: ppo with each sequence's
        ratio); rollout_correction ("token", "sequence", "geometric") with
        rollout_logprobs [...], the inference engine's, weights each token's policy term by the
        truncated ratio min(exp(sampling_logprobs - rollout_logprobs), rollout_is_cap) (verl's
        rollout_is); kl_estimator ("k1", "k2", "k3") with reference_logprobs [...] and kl_coef;
        entropy_coef; reductions "seq-mean-token-sum" and "seq-mean-token-mean" with
        sequence_lengths. After the call, self.last_result holds its LossResult
        (clip_fraction, mean_kl, per-token ratio, clip and kl for the RL objectives)."""
        packed_options = _packed_keywords(options, **option_keywords)
        labels = torch.as_tensor(labels)
        _check_token_ids(labels, "labels")
        count = hidden.numel() // hidden.shape[-1]
        if labels.numel() != count:
            raise ValueError(f"labels: expected {count} entries (the rows of hidden "
                             f"{tuple(hidden.shape)}), got shape {tuple(labels.shape)}")
        per_token = {"weights": weights, "sampling_logprobs": sampling_logprobs,
                     "advantages": advantages, "reference_logprobs": reference_logprobs,
                     "rollout_logprobs": rollout_logprobs}
        for name, values in per_token.items():
            if values is not None:
                values = per_token[name] = torch.as_tensor(values)
                if values.numel() != count:
                    raise ValueError(f"{name}: expected {count} entries (the rows of hidden), got "
                                     f"{values.numel()}")
        if sequence_lengths is not None:
            sequence_lengths = torch.as_tensor(sequence_lengths, dtype=torch.int64)
        tensors = (hidden, labels, per_token["weights"], sequence_lengths,
                   *(per_token[name] for name in _TOKEN_INPUT_NAMES))
        operator_options = (self._id, packed_options, bool(shift_labels),
                            labels.shape[-1] if labels.dim() > 0 else 1)
        return _cross_entropy(tensors, operator_options,
                              torch.is_grad_enabled() and hidden.requires_grad)

    def logprobs(self, hidden, tokens, **kwargs):
        """log p(tokens) for hidden [..., H], differentiable: RemoteLogprobs on this head."""
        return RemoteLogprobs(self.client, self.head, shared_memory=self.shared_memory,
                              weight_sha256=self.weight_sha256,
                              process_group=self.process_group)(hidden, tokens, **kwargs)

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
        """Zeroes dL/dW on the server, as a local head's zero_grad() would. Several ranks share
        the server's accumulator, and one rank's zeroing would drop the others' gradients: with
        a world of more than one, only this rank's forwards still awaiting their backward are
        dropped (the step zeroes the accumulator). set_to_none is accepted for nn.Module
        compatibility."""
        if self.world()[0] > 1:
            self._discard_awaiting()
            return
        self._discard_awaiting()
        self.client.zero_grad(self.head)

    def _discard_awaiting(self):
        """Forgets this process's forwards that await their backward, and drops their staged
        dL/dW on the server: a backward that still runs then adds its gradient in full."""
        staged = [forward.call_id for forward in _AWAITING_BACKWARD.values()
                  if forward is not None and forward.staged]
        _AWAITING_BACKWARD.clear()
        if staged:
            self.client.discard_grad_weight(self.head, staged)

    def step(self, optimizer, **kwargs) -> StepInfo:
        """An optimizer step on the server: "sgd" or "adamw", with torch.optim's defaults; the
        arguments are Client.step's (lr, momentum, betas, eps, weight_decay, max_grad_norm,
        keep_grad, grad_multiplier, skip_nonfinite). Collective over this head's world (see
        the class docstring): every rank calls it, W steps once. The step is pinned to the
        version this module trained (HeadMovedError if W moved under it)."""
        world_size, rank = self.step_group()
        kwargs.setdefault("world_size", world_size)
        kwargs.setdefault("rank", rank)
        kwargs.setdefault("replicated", self.replicas is not None)
        tracked = self.track_version and "head_version" not in kwargs
        if tracked:
            kwargs["head_version"] = self.version
        info = self._tracked_step(lambda: self.client.step(self.head, optimizer, **kwargs),
                                  tracked)
        self.version = info.head_version
        self.trained = True
        return info

    def grad_norm(self, grad_multiplier=None) -> GradNormInfo:
        """The norm of W's accumulated gradient once every rank has sent its part (collective,
        as step() is): for clipping a whole model, W included, by one norm."""
        world_size, rank = self.step_group()
        return self._tracked_step(
            lambda: self.client.grad_weight_norm(self.head, head_version=self.version,
                                                 world_size=world_size, rank=rank,
                                                 grad_multiplier=grad_multiplier,
                                                 replicated=self.replicas is not None), True)

    def _tracked_step(self, call, tracked):
        try:
            return call()
        except LossdError as error:
            if tracked and error.reason == "HEAD_MOVED" and \
                    error.field == "head_version":
                raise self._moved(error) from None
            raise

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

    def __init__(self, client, head, shared_memory=None, weight_sha256=None,
                 process_group=None):
        super().__init__()
        self.client = client if isinstance(client, Client) else Client(client)
        self.client.get_head(head)  # a wrong name fails here, as RemoteHead's does
        self.head = head
        self.shared_memory = shared_memory
        self.weight_sha256 = weight_sha256  # pins every call to this W (RemoteHead.pin_weights)
        self.process_group = process_group  # dL/dW averaged over its ranks (RemoteHead's)

    def forward(self, hidden, tokens, *, ignore_index=-100, temperature=1.0, logit_softcap=None):
        tokens = torch.as_tensor(tokens)
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])
        call = _LossCall(
            client=self.client, head=self.head,
            labels=_token_ids(tokens, "tokens"), weights=None,
            loss=options_from_keywords(reduction="sum", ignore_index=ignore_index,
                                       temperature=temperature, logit_softcap=logit_softcap),
            extra=dict(shared_memory=self.shared_memory, weight_sha256=self.weight_sha256),
            world_size=data_parallel_world(self.process_group)[0])
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
    in forward; sparse_teacher_mass, lossd.v1.SparseTeacherMass by its lower-case name, says what
    becomes of the rest: renormalized away, spread, or kept as a tail bucket).

    Backward gives the student's hidden states dL/dh and accumulates the student head's dL/dW on
    the server exactly as RemoteHead does (the same upstream-gradient correction, call ids and
    retries); the teacher's hidden states get no gradient, and the teacher head is never changed.
    Without autograd (torch.no_grad(), or h_student not requiring grad) forward only scores.
    self.last_result holds the call's LossResult: kd and ce per token, mean_kd, mean_ce."""

    def __init__(self, client, student, teacher=None, *, beta=0.0, alpha=0.0, temperature=1.0,
                 teacher_temperature=1.0, teacher_logit_softcap=None,
                 sparse_teacher_mass="renormalize", process_group=None):
        super().__init__()
        self.client = client if isinstance(client, Client) else Client(client)
        self.student = student
        self.teacher = teacher
        self.process_group = process_group  # dL/dW averaged over its ranks (RemoteHead's)
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
                label_smoothing=0.0, z_loss_scale=0.0, logit_softcap=None,
                student_temperature=1.0, mean_denominator=0, sequence_lengths=None):
        """The loss of the student's hidden [..., H] against the teacher's teacher_hidden
        [..., H_t] for the same tokens (or the sparse teacher's [..., k] top-k), with labels
        [...] (or None): a scalar, or labels' shape for reduction "none". The student head's own
        logit_softcap and student_temperature apply before the distillation temperature;
        logit_softcap and teacher_logit_softcap None take each head's cap
        (HeadInfo.logit_softcap), 0 none."""
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
        loss = options_from_keywords(
            reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing,
            z_loss_scale=z_loss_scale, logit_softcap=logit_softcap,
            temperature=student_temperature, mean_denominator=mean_denominator,
            objective="distill", **self.options)
        extra = dict(teacher_head=self.teacher,
                     sequence_lengths=_as_numpy(sequence_lengths, torch.int64,
                                                "sequence_lengths", None))
        call = _LossCall(client=self.client, head=self.student, labels=label_array,
                         weights=_as_numpy(weights, torch.float32, "weights", count),
                         loss=loss, extra=extra, side=side,
                         world_size=data_parallel_world(self.process_group)[0])
        loss, self.last_result = _run(call, flat_hidden, hidden)
        return loss


class RemoteEmbedding(torch.nn.Module):
    """The input embedding of a tied head (HeadInfo.tied_embeddings), as a stand-in for the
    model's torch.nn.Embedding: forward looks the rows of its token ids up in W on the server
    (each distinct id once) and backward sends their gradient into W's accumulator on the
    server, pinned to the version the rows came from, where the head's own dL/dW goes. One
    head.step() then updates the one matrix both ends of the model use.

    padding_idx: as torch.nn.Embedding's, its rows get no gradient. embed_scale: a factor the
    rows are multiplied by, in their dtype (Gemma's scaled word embeddings). The rows come in the
    dtype and on the device of grad_anchor, an empty parameter that only carries autograd to the
    lookup (the rows live on the server), and that follows the model's .to(...) like its other
    parameters; it takes no part in any update. The gradient call carries no call id and is not
    retried: a failed one raises from backward, and the head's gradient should then be zeroed."""

    def __init__(self, client, head, hidden_size, padding_idx=None, dtype=torch.float32,
                 device=None, embed_scale=None, process_group=None):
        super().__init__()
        _wire_dtype_name(dtype)
        self.client = client if isinstance(client, Client) else Client(client)
        self.head = head
        self.process_group = process_group  # gradients averaged over its ranks, as RemoteHead's
        self.hidden_size = hidden_size
        self.padding_idx = -1 if padding_idx is None else padding_idx
        self.grad_anchor = torch.nn.Parameter(torch.zeros(0, dtype=dtype, device=device))
        self.register_buffer("embed_scale", None if embed_scale is None else
                             torch.as_tensor(embed_scale, dtype=torch.float32).to(device),
                             persistent=False)
        self._id = _register(self)

    def extra_repr(self):
        return f"head={self.head!r}, hidden_size={self.hidden_size}"

    def forward(self, token_ids):
        _check_token_ids(token_ids, "token_ids")
        dtype = self.grad_anchor.dtype
        if _CUSTOM_OPS:
            rows, _ = torch.ops.lossd.embedding_lookup(token_ids, self.grad_anchor, self._id,
                                                       dtype, self.hidden_size)
        elif torch.is_grad_enabled():
            rows = _EmbeddingFunction.apply(token_ids, self.grad_anchor, self._id, dtype,
                                            self.hidden_size)
        else:
            rows = _embedding_lookup(token_ids, self.grad_anchor, self._id, dtype)[0]
        return rows if self.embed_scale is None else rows * self.embed_scale.to(dtype)
