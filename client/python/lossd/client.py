"""The numpy-level client of a lossd server: one method per RPC of lossd/v1/lossd.proto.

Arrays go in and come out as numpy arrays. bfloat16 tensors are uint16 arrays of bit patterns
(see lossd._tensors); float64 inputs are rounded to float32 before they are sent.
"""
import dataclasses
import functools
import json
import logging
import random
import socket
import threading
import time
import uuid
from typing import Callable, Iterable, List, Optional

import grpc
import numpy as np

from lossd import _address, _compute_socket, _tensors, _wire
from lossd._errors import LossdError  # noqa: F401  (public here too)
from lossd._shared_memory import (_SHARED_MEMORY_ALIGNMENT, _FollowingRows, _HandoverConnection,
                                  _SharedBufferPool, copy_rows)
from lossd import options as _options
from lossd.v1 import lossd_pb2 as pb
from lossd.v1 import lossd_pb2_grpc as pb_grpc

_MIB = 1 << 20
_COMPUTE_METHOD = "/lossd.v1.LossService/Compute"
# Room for a message's framing and non-tensor fields beside its tensor bytes.
_MESSAGE_OVERHEAD_BYTES = 64 * 1024
# Messages of a few MiB keep a stream moving: the server computes the first rows while later
# ones are still in flight, and each message stays far from any size limit.
_TARGET_MESSAGE_BYTES = 4 * _MIB

# The per-token inputs of the objectives (ComputeStart), float32 on the wire.
TOKEN_INPUT_NAMES = ("sampling_logprobs", "advantages", "reference_logprobs", "logprob_grads",
                     "rollout_logprobs")
_OPTIMIZER_NAMES = {
    pb.OptimizerState.KIND_NONE: "none",
    pb.OptimizerState.KIND_SGD: "sgd",
    pb.OptimizerState.KIND_ADAMW: "adamw",
}
# The per-token outputs compute() can ask for by name (lossd.options: from lossd.proto); top-k has
# its own argument.
OUTPUT_NAMES = _options.OUTPUT_NAMES
_PER_TOKEN_NAMES = frozenset(_options.ROW_OUTPUT_NAMES + _options.TOP_K_OUTPUT_NAMES)
OBJECTIVES = _options.OBJECTIVES
SPARSE_TEACHER_MASSES = _options.SPARSE_TEACHER_MASSES
# lossd.proto's default of LossOptions.ignore_index, which the clients read to mask rows.
DEFAULT_IGNORE_INDEX = -100
# ComputeResult.clip values (lossd.v1.ClipState).
CLIP_NONE, CLIP_HIGH, CLIP_LOW, CLIP_DUAL = (pb.CLIP_NONE, pb.CLIP_HIGH, pb.CLIP_LOW,
                                             pb.CLIP_DUAL)
# Failures after which the client cannot know whether the server committed the call.
_RETRYABLE_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED")
# What lives in one process, by RPC: these go to one server (pick_first), and a target that lists
# several servers is refused for them, naming what (see Client). Compute joins them when it
# accumulates dL/dW or uses shared memory.
_ONE_SERVER_CALLS = {
    "UploadHead": "an upload", "FetchGradWeight": "the accumulated dL/dW",
    "ZeroGradWeight": "zeroing the gradient", "Step": "an optimizer step",
    "SaveCheckpoint": "a checkpoint", "GetSharedMemorySocket": "shared memory",
    "AccumulateEmbeddingGrad": "an embedding gradient", "GradWeightNorm": "the gradient's norm",
    "CommitGradWeight": "a staged gradient", "DiscardGradWeight": "a staged gradient",
    "GetComputeSocket": "the Compute socket",
}
# Read-only calls of one request message, which gRPC's own retryPolicy may send again whole.
_GRPC_RETRIED_CALLS = ("ListHeads", "GetHead", "FetchWeight", "FetchGradWeight",
                       "GetSharedMemorySocket", "LookupEmbedding")
_GRPC_MAX_ATTEMPTS = 5  # gRPC clamps retryPolicy.maxAttempts to it

_log = logging.getLogger("lossd")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How Client.compute retries a call that failed with UNAVAILABLE (no connection, a server
    shutting down) or DEADLINE_EXCEEDED. The client cannot know whether the server committed such
    a call, so it sends the same call again, rows and all, under the same call_id, and the server
    answers a repeat of a committed call as a replay without adding its dL/dW again. A scoring
    call changes nothing on the server and is simply sent again: over replicas, to the next server
    in the rotation. Other codes are the server's answer and are raised as they are.

    Compute is retried by the client, not by gRPC: gRPC replays a stream only while all it sent
    fits its per-call retry buffer (256 KiB) and before any response, so a call that failed after
    sending its rows, or while its results were streaming back (a replica killed mid-call), would
    not be replayed. The read-only calls of one message (list_heads, get_head, fetch_weight,
    fetch_grad_weight) are retried on UNAVAILABLE by gRPC's own retryPolicy in the channel's
    service config, with these attempts (at most 5, gRPC's cap) and backoff; calls that change a
    head (step, zero_grad, upload_head, save_checkpoint) are made once, since a lost answer cannot
    say whether they took effect.

    max_attempts counts every attempt (1 turns retrying off). The wait before the n-th retry is
    initial_backoff * backoff_multiplier ** (n - 1) seconds, at most max_backoff, times a random
    factor in [0.5, 1] so that clients that failed together do not retry together. max_elapsed,
    when set, ends the retries once that many seconds have passed since the first attempt began:
    RetryPolicy(max_attempts=10**6, max_elapsed=300) rides out a server that restarts from its
    checkpoint within five minutes (the default gives up after about 1.5 s of waits). Each retry
    is logged as a warning on the "lossd" logger, and on_retry(error, attempt, wait), when given,
    is called before the wait. Step, GradWeightNorm and CommitGradWeight of a training run are
    retried the same way."""
    max_attempts: int = 4
    initial_backoff: float = 0.2
    max_backoff: float = 5.0
    backoff_multiplier: float = 2.0
    on_retry: Optional[Callable[["LossdError", int, float], None]] = None
    max_elapsed: Optional[float] = None

    def __post_init__(self):
        if not (isinstance(self.max_attempts, int) and self.max_attempts >= 1):
            raise ValueError(f"max_attempts: expected an int >= 1, got {self.max_attempts!r}")
        if not 0 <= self.initial_backoff <= self.max_backoff < float("inf"):
            raise ValueError(f"initial_backoff, max_backoff: expected finite seconds with "
                             f"0 <= initial_backoff <= max_backoff, got {self.initial_backoff!r}, "
                             f"{self.max_backoff!r}")
        if self.max_elapsed is not None and not 0 <= self.max_elapsed < float("inf"):
            raise ValueError(f"max_elapsed: expected finite seconds >= 0 or None, got "
                             f"{self.max_elapsed!r}")
        if not 1 <= self.backoff_multiplier < float("inf"):
            raise ValueError(f"backoff_multiplier: expected a finite value >= 1, got "
                             f"{self.backoff_multiplier!r}")


@dataclasses.dataclass(frozen=True)
class HeadInfo:
    name: str
    vocab_size: int
    hidden_size: int
    dtype: str                # storage dtype of W on the server
    version: int              # increases with every step and upload
    source: str
    accumulated_tokens: int   # tokens in the gradient accumulator since it was zeroed
    accumulated_calls: int
    optimizer: str            # "none", "sgd" or "adamw": the optimizer state the server holds
    steps: int
    tied_embeddings: bool     # W is also the model's input embedding
    logit_softcap: float      # applied by calls that do not set their own; 0: none
    # SHA-256 of W at `version` (HeadInfo.weight_sha256 in lossd.proto), equal on replicas that
    # serve the same W; get_head always fills it, list_heads only where the server knows it.
    weight_sha256: str = ""
    # A 16-bit W stepped from fp32 master weights (fetch_weight(master=True) reads them).
    master_weights: bool = False
    staged_gradients: int = 0  # dL/dW staged by calls, waiting for their commit

    @classmethod
    def from_proto(cls, info):
        return cls(name=info.name, vocab_size=info.vocab_size, hidden_size=info.hidden_size,
                   dtype=_tensors.dtype_name(info.dtype), version=info.version, source=info.source,
                   accumulated_tokens=info.accumulated_tokens,
                   accumulated_calls=info.accumulated_calls,
                   optimizer=_OPTIMIZER_NAMES.get(info.optimizer, str(info.optimizer)),
                   steps=info.steps, tied_embeddings=info.tied_embeddings,
                   logit_softcap=info.logit_softcap, weight_sha256=info.weight_sha256,
                   master_weights=info.master_weights, staged_gradients=info.staged_gradients)


class LossResult:
    """One compute() call's answer: every field of its lossd.v1.ComputeSummary as an attribute
    (loss, loss_sum, counted_tokens, head_version, grad_weight_accumulated, replayed,
    clip_fraction, mean_kl, mean_kd, ...), and every per-token output by its name in
    lossd.v1.ComputeResult: an array of num_tokens values (top_k_*: [num_tokens, k]) when the
    call asked for it, else None. grad_hidden is dL/dh [N, H] in grad_hidden_dtype (bfloat16:
    uint16 bits), or None. call_id is the id sent ("" for none), attempts how many it took;
    transport how the rows and dL/dh travelled: "grpc", "compute_socket" or "shared_memory"."""

    def __init__(self, summary, outputs, grad_hidden=None, call_id="", attempts=1,
                 transport="grpc"):
        self.summary = summary
        self.outputs = outputs
        self.grad_hidden = grad_hidden
        self.call_id = call_id
        self.attempts = attempts
        self.transport = transport

    def __getattr__(self, name):
        # Only names not set on the instance reach here.
        if name in _PER_TOKEN_NAMES:
            return self.outputs.get(name)
        summary = self.__dict__.get("summary")
        if summary is not None and name in summary.DESCRIPTOR.fields_by_name:
            return getattr(summary, name)
        raise AttributeError(f"LossResult has no {name!r}")

    @property
    def accuracy(self):
        return self.correct_tokens / self.counted_tokens if self.counted_tokens else 0.0

    def __repr__(self):
        outputs = ", ".join(f"{name}[{len(array)}]" for name, array in self.outputs.items())
        return (f"LossResult(loss={self.loss!r}, counted_tokens={self.counted_tokens}, "
                f"head_version={self.head_version}, outputs=[{outputs}], "
                f"call_id={self.call_id!r})")


@dataclasses.dataclass
class EmbeddingRows:
    """Rows of a tied head's W for a list of token ids (Client.lookup_embedding)."""
    rows: np.ndarray          # [N, H] in the dtype asked for (bfloat16: uint16 bits)
    head_version: int         # the version of W they are from


@dataclasses.dataclass(frozen=True)
class StepInfo:
    head_version: int
    grad_norm: float          # of the accumulated gradient (times grad_multiplier), before clipping
    clip_multiplier: float    # 1 when not clipped
    accumulated_tokens: int
    skipped: bool = False     # skip_nonfinite met a non-finite gradient: nothing stepped


@dataclasses.dataclass(frozen=True)
class GradNormInfo:
    head_version: int
    grad_norm: float          # of the accumulated gradient times grad_multiplier
    accumulated_tokens: int
    accumulated_calls: int


def _service_config(retry, round_robin, health_check=True):
    """A channel's service config, as gRPC's JSON. Round robin checks each server's health
    (grpc.health.v1), so that a replica draining after SIGTERM (NOT_SERVING) leaves the rotation at
    once; gRPC retries the read-only calls of one message (see RetryPolicy)."""
    config = {}
    if round_robin:
        config["loadBalancingConfig"] = [{"round_robin": {}}]
        if health_check:
            config["healthCheckConfig"] = {"serviceName": ""}
    attempts = min(retry.max_attempts, _GRPC_MAX_ATTEMPTS)
    if attempts >= 2:
        def seconds(value):  # gRPC wants backoffs above 0
            return f"{max(value, 1e-3):.6f}s"
        config["methodConfig"] = [{
            "name": [{"service": "lossd.v1.LossService", "method": method}
                     for method in _GRPC_RETRIED_CALLS],
            "retryPolicy": {"maxAttempts": attempts,
                            "initialBackoff": seconds(retry.initial_backoff),
                            "maxBackoff": seconds(retry.max_backoff),
                            "backoffMultiplier": retry.backoff_multiplier,
                            "retryableStatusCodes": ["UNAVAILABLE"]}}]
    return json.dumps(config)


class Client:
    """A connection to a lossd server, or to replicas of one.

    address: "host:port" (lossd_server listens on 50051 by default), or a gRPC target URI such as
    "dns:///lossd-scoring:50051" (a headless Service), "ipv4:10.0.0.1:50051,10.0.0.2:50051" or
    "unix:path" (lossd.parse_target); a host without a port, or a URL such as "http://host:port",
    is refused with a ValueError that says what to give instead. Scoring calls and reads spread
    over every address the target resolves to (gRPC's round_robin, which skips servers that are
    down or draining), and a scoring call that fails with UNAVAILABLE is sent again to the next
    one. What lives in one process (calls that accumulate dL/dW, steps, the gradient, uploads,
    checkpoints, shared memory) goes to one server, and a target that lists several is refused
    for it (FAILED_PRECONDITION) before anything is sent. token: the bearer token the server was
    started with (--token_file). tls_root_cert: PEM bytes, or the path of a PEM file, of the CA
    that signed the server's certificate; turns TLS on. max_message_bytes bounds every message
    sent or received (gRPC's own default of 4 MiB is too small for tensors). timeout: seconds
    each call (each attempt of a compute call) may take, None for no deadline. retry: how
    compute() retries UNAVAILABLE and DEADLINE_EXCEEDED (a RetryPolicy; RetryPolicy(max_attempts=1)
    turns it off), and the read-only calls' retryPolicy in gRPC. shared_memory: whether compute()
    hands rows and dL/dh over in memory shared with the server by default (its shared_memory
    argument): "auto" (the default) does for a server on this host (a loopback address or a
    Unix socket) that offers it, and sends messages otherwise or when the handover fails.
    compute_socket: whether compute() calls that send their rows in messages send them over the
    server's Compute socket (lossd_server --compute_socket_listen: the same messages on a plain
    TCP connection of their own, around gRPC's HTTP/2 transport: 1.6x faster calls where the
    transport bounds them) by default (its compute_socket argument): "auto" (the default) does
    for a server that offers one, reached without TLS at an address that names one server
    (HOST:PORT whose host resolves to one address, or a one-entry ipv4:/ipv6: target), and keeps
    to gRPC otherwise, and for a call the socket cannot take (full, or out of reach).
    compute_socket_lanes: how many connections (1 to 8) one call over the Compute socket may
    spread its messages over, for a network where one TCP flow cannot carry what the link does
    (flows capped one by one, a long path with a small window); a call uses at most one per
    message of rows. One connection fills a loopback or LAN link, so the default is 1.
    """

    def __init__(self, address, token=None, tls_root_cert=None, max_message_bytes=256 * _MIB,
                 timeout=None, retry=RetryPolicy(), shared_memory="auto", compute_socket="auto",
                 compute_socket_lanes=1):
        self.target = _address.parse_target(address)
        if shared_memory not in ("auto", True, False):
            raise ValueError(f"shared_memory: expected 'auto', True or False, got "
                             f"{shared_memory!r}")
        if compute_socket not in ("auto", True, False):
            raise ValueError(f"compute_socket: expected 'auto', True or False, got "
                             f"{compute_socket!r}")
        if (not isinstance(compute_socket_lanes, (int, np.integer)) or
                isinstance(compute_socket_lanes, bool) or
                not 1 <= compute_socket_lanes <= _compute_socket.MAX_LANES):
            raise ValueError(f"compute_socket_lanes: expected 1 to {_compute_socket.MAX_LANES} "
                             f"connections, got {compute_socket_lanes!r}")
        self._compute_socket_lanes = int(compute_socket_lanes)
        if compute_socket is True and tls_root_cert is not None:
            raise ValueError("compute_socket: not with tls_root_cert (the Compute socket carries "
                             "rows and the token in the clear; servers with TLS offer none)")
        self._shared_memory = shared_memory
        self._compute_socket_choice = compute_socket
        self._tls = tls_root_cert is not None
        self._token = token
        if not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry: expected a lossd.RetryPolicy, got {type(retry).__name__}")
        if isinstance(tls_root_cert, str):
            with open(tls_root_cert, "rb") as f:
                tls_root_cert = f.read()

        def channel(round_robin):
            options = [("grpc.max_send_message_length", max_message_bytes),
                       ("grpc.max_receive_message_length", max_message_bytes),
                       # grpcio 1.51 (Debian 12's) crashes the process when a round-robin
                       # channel with health checking dials a server that a pick_first channel
                       # of the same process failed to reach. A server on this host is one
                       # server, with no replicas to steer round: it goes without.
                       ("grpc.service_config",
                        _service_config(retry, round_robin, not self.target.local)),
                       # The balancing is the client's: a DNS TXT record cannot replace it.
                       ("grpc.service_config_disable_resolution", 1),
                       ("grpc.enable_retries", 1)]
            if tls_root_cert is None:
                return grpc.insecure_channel(self.target.uri, options=options)
            credentials = grpc.ssl_channel_credentials(root_certificates=tls_root_cert)
            return grpc.secure_channel(self.target.uri, credentials, options=options)

        # Scoring and reads over every address; what belongs to one server, on one (pick_first).
        self._channel = channel(round_robin=True)
        self._one_server_channel = channel(round_robin=False)
        self._stub = pb_grpc.LossServiceStub(self._channel)
        self._one_server_stub = pb_grpc.LossServiceStub(self._one_server_channel)
        # Compute over each channel with its tensor fields encoded and decoded by hand (_wire).
        self._raw_compute = {
            id(stub): channel.stream_stream(_COMPUTE_METHOD, request_serializer=bytes,
                                            response_deserializer=_wire.decode_response)
            for stub, channel in ((self._stub, self._channel),
                                  (self._one_server_stub, self._one_server_channel))}
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._max_message_bytes = max_message_bytes
        self._timeout = timeout
        self._retry = retry
        self._shared_buffers = _SharedBufferPool()
        self._shared_memory_works = None  # "auto": decided at the first call that could use it
        self._handover = None  # the _HandoverConnection the pool's memfds are registered on
        self._handover_lock = threading.Lock()
        # A _compute_socket.ComputeSocket, found on first use; False: none to use.
        self._compute_socket = None
        self._compute_socket_lock = threading.Lock()
        self._compute_socket_probing = False  # a call is asking the server now
        self._compute_socket_probe_again = 0.0  # time.monotonic() before which none asks
        self.address = address

    def close(self):
        with self._handover_lock:
            if self._handover is not None:
                # Revokes every handle at once: the buffers need not release theirs one by one.
                self._handover.close()
        self._shared_buffers.close()
        with self._compute_socket_lock:
            if self._compute_socket:
                self._compute_socket.close()
        self._channel.close()
        self._one_server_channel.close()

    def _use_shared_memory(self, asked):
        """Whether a call that asked for `asked` (True, False, "auto", or None: the client's
        default) hands its rows over in shared memory. "auto" tries the handover once, on first
        use, and keeps to messages if the server is not on this host or does not offer it."""
        asked = self._shared_memory if asked is None else asked
        if asked != "auto":
            return bool(asked)
        if self._shared_memory_works is None:
            works = self.target.local
            if works:
                try:
                    self._handover_connection(timeout=self._PROBE_SECONDS)
                except LossdError as error:
                    _log.debug("shared memory unavailable, sending messages: %s", error)
                    works = False
            self._shared_memory_works = works
        return self._shared_memory_works

    # How long "auto" waits for a local server to name its handover socket before it keeps to
    # messages: the answer comes within milliseconds from a server that is up, and a probe that
    # waited the call's whole timeout would hold the call that triggered it as long.
    _PROBE_SECONDS = 10

    def _handover_connection(self, timeout=None):
        """The open handover connection, opened on first use and again once the server has
        closed it (a restart)."""
        with self._handover_lock:
            if self._handover is None or not self._handover.is_open():
                named = self._unary("GetSharedMemorySocket", pb.GetSharedMemorySocketRequest(),
                                    timeout=timeout)
                self._handover = _HandoverConnection(named.abstract_name, named.rows_follow_pays)
            return self._handover

    def _use_compute_socket(self, asked):
        """The ComputeSocket a call that asked for `asked` (True, False, "auto", or None: the
        client's default) sends its messages over, or None for gRPC. The server is asked once
        where its socket is; "auto" keeps to gRPC when it offers none, the channel has TLS, or the
        address may reach several servers (the call could land on another one than the client's
        other calls)."""
        asked = self._compute_socket_choice if asked is None else asked
        if asked is False or (asked == "auto" and self._tls):
            return None
        required = asked is True
        with self._compute_socket_lock:
            found = self._compute_socket
            # False: "auto" found none; asked for explicitly, the search says why.
            if found is not None and not (found is False and required):
                return found or None
            if not required and (self._compute_socket_probing or
                                 time.monotonic() < self._compute_socket_probe_again):
                # Another call is asking, or the server could not be asked lately: this one
                # goes over gRPC rather than wait.
                return None
            self._compute_socket_probing = True
        try:
            # Outside the lock: a server slow to answer holds up this call only.
            found = self._find_compute_socket(required)
        finally:
            with self._compute_socket_lock:
                self._compute_socket_probing = False
        with self._compute_socket_lock:
            if found is None:
                self._compute_socket_probe_again = time.monotonic() + self._PROBE_AGAIN_SECONDS
            elif self._compute_socket is None or self._compute_socket is False:
                self._compute_socket = found
            return self._compute_socket or None

    # How long "auto" waits for the server to name its Compute socket before the call goes over
    # gRPC (the answer comes within milliseconds from a server that is up), and how long it then
    # leaves the question before asking again.
    _COMPUTE_SOCKET_PROBE_SECONDS = 5
    _PROBE_AGAIN_SECONDS = 60

    def _find_compute_socket(self, required):
        """A ComputeSocket; False where there is none to use, None where the server could not be
        asked (the next call asks again); LossdError instead of either when `required`."""
        def none(code, message):
            if required:
                raise LossdError("Compute", code, f"compute_socket: {message}")
            _log.debug("no Compute socket, sending over gRPC: %s", message)
            return False

        host = _address.tcp_host(self.target)
        if host is None:
            return none("FAILED_PRECONDITION",
                        f"expected an address that names one TCP server, got {self.address!r}")
        try:
            answer = self._unary("GetComputeSocket", pb.GetComputeSocketRequest(),
                                 timeout=(self._PROBE_SECONDS if required
                                          else self._COMPUTE_SOCKET_PROBE_SECONDS))
        except LossdError as error:
            if required:
                raise
            if error.code not in ("FAILED_PRECONDITION", "UNIMPLEMENTED"):
                return None  # the call goes over gRPC, which reports what is wrong
            return none(error.code, error.message)
        try:
            addresses = {info[4][0] for info in socket.getaddrinfo(
                host, answer.port, type=socket.SOCK_STREAM)}
        except OSError as error:
            return none("UNAVAILABLE", f"cannot resolve {host!r}: {error}")
        if len(addresses) != 1 and not required:
            return none("FAILED_PRECONDITION",
                        f"{host!r} resolves to {len(addresses)} addresses, which may be "
                        f"several servers")
        return _compute_socket.ComputeSocket(host, answer.port, self._token, self._timeout,
                                             self._max_message_bytes)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _stub_for(self, method, one_server_for=None):
        """The stub of the channel `method` goes over: one server for what lives in one process
        (_ONE_SERVER_CALLS, or `one_server_for` naming it), refused for a target that lists
        several; else the round-robin one."""
        what = one_server_for or _ONE_SERVER_CALLS.get(method)
        if what is None:
            return self._stub
        if self.target.listed_addresses > 1:
            raise LossdError(
                method, "FAILED_PRECONDITION",
                f"address: expected one server for {what}, got {self.target.uri!r}, which lists "
                f"{self.target.listed_addresses} addresses. A head's accumulated dL/dW, optimizer "
                f"state, version and shared-memory handles live in one process, and each replica "
                f"has its own: score over replicas, train against one server")
        return self._one_server_stub

    def _unary(self, method, request, timeout=None):
        """`method` called once; `timeout` (seconds) instead of the client's when given."""
        stub = self._stub_for(method)
        if timeout is None or (self._timeout is not None and self._timeout < timeout):
            timeout = self._timeout
        try:
            return getattr(stub, method)(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise LossdError.from_rpc_error(method, error, self.address) from None

    def _call(self, method, request, one_server_for=None):
        """Starts a server-streaming or bidirectional call; the handle can cancel it. Compute
        takes serialized ComputeRequests and yields pb.ComputeSummary and _wire.Result."""
        stub = self._stub_for(method, one_server_for)
        invoke = self._raw_compute[id(stub)] if method == "Compute" else getattr(stub, method)
        return invoke(request, timeout=self._timeout, metadata=self._metadata)

    def _responses(self, method, call):
        """The responses of a started call (see _call), as they arrive."""
        try:
            yield from call
        except grpc.RpcError as error:
            raise LossdError.from_rpc_error(method, error, self.address) from None

    def _rows_per_message(self, row_bytes):
        budget = min(_TARGET_MESSAGE_BYTES, self._max_message_bytes - _MESSAGE_OVERHEAD_BYTES)
        return max(1, budget // max(1, row_bytes))

    # Heads -----------------------------------------------------------------------------------

    def list_heads(self) -> List[HeadInfo]:
        response = self._unary("ListHeads", pb.ListHeadsRequest())
        return [HeadInfo.from_proto(info) for info in response.heads]

    def get_head(self, head) -> HeadInfo:
        return HeadInfo.from_proto(self._unary("GetHead", pb.GetHeadRequest(head=head)))

    def upload_head(self, head, weight, storage_dtype="float32", replace=False,
                    tied_embeddings=False, logit_softcap=0.0) -> HeadInfo:
        """Creates head `head` with W = weight [V, H] (float32/float64/float16, or bfloat16 as
        uint16 bits), stored on the server as storage_dtype. Replacing an existing head must be
        asked for; it zeroes the head's gradient and optimizer state and bumps its version.
        tied_embeddings: W is also the model's input embedding (the embedding RPCs serve it).
        logit_softcap: the model's final logit soft cap, which calls apply unless they set
        their own (0: none)."""
        wire_name, weight = _tensors.as_wire_array(weight)
        if weight.ndim != 2:
            raise ValueError(f"weight: expected a [vocab_size, hidden_size] array, got shape "
                             f"{weight.shape}")
        start = pb.UploadHeadStart(head=head, vocab_size=weight.shape[0],
                                   hidden_size=weight.shape[1],
                                   dtype=_tensors.wire_enum(wire_name),
                                   storage_dtype=_tensors.wire_enum(storage_dtype), replace=replace,
                                   tied_embeddings=tied_embeddings, logit_softcap=logit_softcap)
        return HeadInfo.from_proto(
            self._send_rows("UploadHead", pb.UploadHeadRequest, start, "weight", weight))

    def _send_rows(self, method, request_type, start, field, array):
        """A client-streaming call: `start`, then the rows of array in messages of a few MiB,
        each as the bytes field `field` of request_type. Returns the response."""
        rows = self._rows_per_message(array.shape[1] * array.itemsize)
        stub = self._stub_for(method)

        def requests():
            yield request_type(start=start)
            for r0 in range(0, array.shape[0], rows):
                yield request_type(**{field: array[r0:r0 + rows].tobytes()})

        try:
            return getattr(stub, method)(requests(), timeout=self._timeout,
                                         metadata=self._metadata)
        except grpc.RpcError as error:
            raise LossdError.from_rpc_error(method, error, self.address) from None

    def _receive_rows(self, method, request, dtype, num_rows=None):
        """The rows a server-streaming call sends in chunks (TensorChunk, EmbeddingRows) put
        together by row offset into one array of num_rows (default: the chunks' vocab_size)
        rows, and the last chunk (None when none came)."""
        array = None
        chunk = None
        received = 0
        for chunk in self._responses(method, self._call(method, request)):
            if array is None:
                rows = chunk.vocab_size if num_rows is None else num_rows
                array = np.empty((rows, chunk.hidden_size), dtype=_tensors.numpy_dtype(dtype))
            array[chunk.row_offset:chunk.row_offset + chunk.num_rows] = _tensors.from_wire(
                chunk.data, dtype, (chunk.num_rows, chunk.hidden_size))
            received += chunk.num_rows
        if (array is None and num_rows != 0) or (array is not None and received != array.shape[0]):
            raise LossdError(method, "INTERNAL",
                             f"the server sent {received} rows of a {dtype} array "
                             f"{None if array is None else array.shape}")
        return array, chunk

    def _fetch(self, method, head, dtype, master=False):
        chunk_bytes = min(_TARGET_MESSAGE_BYTES, self._max_message_bytes // 2)
        request = pb.FetchTensorRequest(head=head, dtype=_tensors.wire_enum(dtype),
                                        max_chunk_bytes=chunk_bytes, master=master)
        return self._receive_rows(method, request, dtype)[0]

    def fetch_weight(self, head, dtype="float32", master=False) -> np.ndarray:
        """W [V, H] as dtype ("float32", "float16", or "bfloat16" as uint16 bits). master: a
        16-bit head's fp32 master weights, where it has them (HeadInfo.master_weights)."""
        return self._fetch("FetchWeight", head, dtype, master)

    def fetch_grad_weight(self, head, dtype="float32") -> np.ndarray:
        """The accumulated dL/dW [V, H] as dtype."""
        return self._fetch("FetchGradWeight", head, dtype)

    def zero_grad(self, head) -> int:
        """Zeroes the head's gradient accumulator; returns the head's version."""
        return self._unary("ZeroGradWeight", pb.ZeroGradWeightRequest(head=head)).head_version

    def step(self, head, optimizer, *, lr=None, momentum=0.0, betas=(0.9, 0.999), eps=1e-8,
             weight_decay=None, max_grad_norm=0.0, keep_grad=False,
             head_version=None, world_size=1, rank=0, grad_multiplier=None,
             skip_nonfinite=False, replicated=False) -> StepInfo:
        """One optimizer step on W with the accumulated gradient: optimizer "sgd" or "adamw",
        with the semantics and defaults of torch.optim.SGD and torch.optim.AdamW. lr None is
        torch's 1e-3 for both; weight_decay None is AdamW's 0.01 (decoupled) or SGD's 0 (an L2
        penalty). grad_multiplier multiplies the gradient first (a clip multiplier taken over a
        whole model, 1 / a loss scale). max_grad_norm > 0 clips by the gradient's norm (as
        torch.nn.utils.clip_grad_norm_). The gradient is zeroed afterwards unless keep_grad.
        head_version pins the step: FAILED_PRECONDITION unless the head is at that version.
        skip_nonfinite: a gradient with Inf or NaN skips the step (StepInfo.skipped) instead of
        failing, as torch.amp.GradScaler does.

        world_size > 1: the step is collective (lossd.v1.RankGroup): every rank of a
        data-parallel job calls it with the same arguments but its own rank, after its last
        gradient of the step; the server steps once when all have, and every rank gets the same
        answer. head_version (the version the ranks trained on) is then required; a rank that
        does not come within the server's --step_wait_seconds fails the step on all ranks
        (ABORTED, nothing applied). A collective step is retried after UNAVAILABLE or
        DEADLINE_EXCEEDED like a compute call: the server answers a repeat with the step it
        took, never a second one.

        replicated: the server is a replica of a group (lossd_server --replicas) and the step
        is collective across the replicas whatever world_size (the ranks of this replica:
        lossd.torch.RemoteHead(replicas=...) derives them); head_version is required, and the
        step is retried as a collective one."""
        request = pb.StepRequest(head=head, max_grad_norm=max_grad_norm, keep_grad=keep_grad,
                                 skip_nonfinite=skip_nonfinite,
                                 ranks=_rank_group(world_size, rank))
        if grad_multiplier is not None:
            request.grad_multiplier = grad_multiplier
        if optimizer == "sgd":
            request.sgd.CopyFrom(pb.SgdConfig(
                learning_rate=1e-3 if lr is None else lr, momentum=momentum,
                weight_decay=0.0 if weight_decay is None else weight_decay))
        elif optimizer == "adamw":
            if momentum:
                raise ValueError("momentum: SGD only; AdamW takes betas")
            request.adamw.CopyFrom(pb.AdamWConfig(
                learning_rate=1e-3 if lr is None else lr, beta1=betas[0], beta2=betas[1],
                epsilon=eps, weight_decay=0.01 if weight_decay is None else weight_decay))
        else:
            raise ValueError(f"optimizer: expected 'sgd' or 'adamw', got {optimizer!r}")
        if head_version is not None:
            request.head_version = head_version
        response = self._collective("Step", request, world_size, replicated)
        return StepInfo(head_version=response.head_version, grad_norm=response.grad_norm,
                        clip_multiplier=response.clip_multiplier,
                        accumulated_tokens=response.accumulated_tokens, skipped=response.skipped)

    def grad_weight_norm(self, head, *, head_version=None, world_size=1, rank=0,
                         grad_multiplier=None, replicated=False) -> GradNormInfo:
        """The norm of the head's accumulated gradient (times grad_multiplier), changing
        nothing. world_size > 1: collective as step() is, answered once every rank has called,
        so that each rank can clip its whole model, W included, by one global norm, then step
        with the clip multiplier as grad_multiplier. replicated: as step()'s (the norm is of
        the gradient summed over the replicas)."""
        request = pb.GradWeightNormRequest(head=head, ranks=_rank_group(world_size, rank))
        if head_version is not None:
            request.head_version = head_version
        if grad_multiplier is not None:
            request.grad_multiplier = grad_multiplier
        response = self._collective("GradWeightNorm", request, world_size, replicated)
        return GradNormInfo(head_version=response.head_version, grad_norm=response.grad_norm,
                            accumulated_tokens=response.accumulated_tokens,
                            accumulated_calls=response.accumulated_calls)

    def commit_grad_weight(self, head, call_id, scale=1.0) -> bool:
        """Adds the dL/dW that the compute call `call_id` staged (stage_grad_weight=True) to the
        head's accumulator, times scale (the upstream gradient of its loss); returns whether it
        was a repeat of a commit already made (nothing added again). NOT_FOUND when nothing is
        staged under that id any more (the head stepped, the gradient expired or was discarded).
        Retried after UNAVAILABLE or DEADLINE_EXCEEDED: a repeat is answered as the first."""
        request = pb.CommitGradWeightRequest(head=head, call_id=call_id, scale=scale)
        return self._with_retries(lambda: self._unary("CommitGradWeight", request),
                                  call_id, "CommitGradWeight").replayed

    def discard_grad_weight(self, head, call_ids) -> int:
        """Drops the dL/dW staged under call_ids (forwards whose backward will not run);
        returns how many were still staged."""
        request = pb.DiscardGradWeightRequest(head=head, call_ids=list(call_ids))
        return self._unary("DiscardGradWeight", request).discarded

    def _collective(self, method, request, world_size, replicated=False):
        """A unary call that changes a head once however often it is repeated (a collective one,
        pinned to its version), retried like compute; the others are made once."""
        if world_size <= 1 and not replicated:
            return self._unary(method, request)
        return self._with_retries(lambda: self._unary(method, request), "", method)

    def lookup_embedding(self, head, token_ids, dtype="float32",
                         head_version=None) -> EmbeddingRows:
        """The rows of a tied head's W (its model's input embedding) for token_ids [N], as an
        [N, H] array of dtype. head_version pins the lookup (FAILED_PRECONDITION otherwise); a
        head that moves while the rows stream out fails the call with ABORTED. A head that is
        not tied (HeadInfo.tied_embeddings) refuses with FAILED_PRECONDITION."""
        token_ids = _token_ids(token_ids, "token_ids")
        request = pb.LookupEmbeddingRequest(
            head=head, token_ids=token_ids.tolist(), dtype=_tensors.wire_enum(dtype),
            max_chunk_bytes=min(_TARGET_MESSAGE_BYTES, self._max_message_bytes // 2))
        if head_version is not None:
            request.head_version = head_version
        rows, last = self._receive_rows("LookupEmbedding", request, dtype, token_ids.shape[0])
        if last is None:
            # No ids, no rows: the version comes from the head itself.
            info = self.get_head(head)
            return EmbeddingRows(rows=np.empty((0, info.hidden_size),
                                               dtype=_tensors.numpy_dtype(dtype)),
                                 head_version=info.version)
        return EmbeddingRows(rows=rows, head_version=last.head_version)

    def accumulate_embedding_grad(self, head, token_ids, grad, head_version=None) -> int:
        """Adds grad [N, H] (float32/float64/float16, or bfloat16 as uint16 bits), the gradient
        of the rows of token_ids [N] of a tied head, into the head's gradient accumulator, where
        Compute's dL/dW goes, so that one step updates the one matrix. Rows of repeated ids add
        up. All or nothing: every value and every sum must be finite. head_version, the version
        the rows were looked up at, pins it (FAILED_PRECONDITION once the head has moved).
        Returns the number of distinct rows of W the gradient went to."""
        token_ids = _token_ids(token_ids, "token_ids")
        wire_name, grad = _tensors.as_wire_array(grad)
        if grad.ndim != 2 or grad.shape[0] != token_ids.shape[0]:
            raise ValueError(f"grad: expected a [{token_ids.shape[0]}, hidden_size] array (one "
                             f"row per token id), got shape {grad.shape}")
        start = pb.EmbeddingGradStart(head=head, token_ids=token_ids.tolist(),
                                      hidden_size=grad.shape[1],
                                      dtype=_tensors.wire_enum(wire_name))
        if head_version is not None:
            start.head_version = head_version
        return self._send_rows("AccumulateEmbeddingGrad", pb.AccumulateEmbeddingGradRequest,
                               start, "grad", grad).accumulated_rows

    def save_checkpoint(self, head="") -> List[str]:
        """Writes checkpoints of one head (every head when empty); returns their paths."""
        return list(self._unary("SaveCheckpoint", pb.SaveCheckpointRequest(head=head)).paths)

    # Compute ---------------------------------------------------------------------------------

    def compute(self, head, hidden, labels, *, options=None, outputs: Iterable[str] = (),
                top_k=0, weights=None, grad_hidden_dtype=None, accumulate_grad_weight=False,
                stage_grad_weight=False, head_version=None, weight_sha256=None, call_id=None,
                shift_labels=False, sequence_lengths=None, sampling_logprobs=None,
                advantages=None, reference_logprobs=None, logprob_grads=None,
                rollout_logprobs=None, teacher_head=None,
                teacher_hidden=None, teacher_head_version=None, teacher_top_k_tokens=None,
                teacher_top_k_logprobs=None, rows_per_message=None, shared_memory=None,
                shared_rows_per_piece=None, grad_hidden_out=None, compute_socket=None,
                **option_keywords) -> LossResult:
        """The loss of hidden [N, H] with labels [N] under head `head`: cross-entropy by default.

        options: a lossd.LossOptions (lossd.v1.LossOptions: reduction, ignore_index,
        label_smoothing, z_loss_scale, logit_softcap, temperature, grad_scale,
        mean_denominator, objective, policy, distill, ...); keyword arguments set its fields
        too, flattened (reduction="sum", clip_high=0.28, distill_beta=0.5: see lossd.options).
        They follow torch.nn.functional.cross_entropy; weights [N] multiply each token's loss and
        gradient without entering the mean's denominator, which counts the non-ignored tokens
        (or is mean_denominator when > 0, for one slice of a larger batch). grad_scale multiplies
        dL/dh and dL/dW (the upstream gradient), not the loss. logit_softcap: None applies the
        head's soft cap (HeadInfo.logit_softcap, from the model's config), 0 turns capping off,
        a value > 0 caps at it.

        shift_labels=True computes a causal LM's next-token loss: row i of a sequence is scored
        against labels[i + 1] of the same sequence and the last row of each sequence is ignored,
        without moving any row (the mean counts the shifted labels that are not ignored; weights
        and the objectives' per-token inputs stay with their rows). The sequences are those of
        sequence_lengths (e.g. [T] * B for a [B, T] batch flattened); None: all rows are one.

        objective names the per-token term (lossd.v1.Objective; logp is the log-probability of
        the label, r = exp(logp - sampling_logprobs), clip(r) within [1 - clip_low, 1 + clip_high]):
        "importance_sampling" -r A, "ppo" -min(r A, clip(r) A) (dual_clip c > 1 bounds a negative
        advantage's term by -c A), "cispo" -sg(clip(r)) A logp, all three with advantages A [N]
        and sampling_logprobs [N] ("gspo": ppo with each sequence's ratio, the exponential of the
        mean of logp - q over the sequence, which needs sequence_lengths); log_ratio_clamp c > 0
        clamps log r to [-c, c] before the exponential (verl's 20: r at most e^20, no gradient
        through r where clamped), 0 (the default) keeps r exact and refuses a call whose r
        overflows, naming sampling_logprobs[i]; "logprob_gradient" g logp with logprob_grads g
        [N], the gradient of a loss of the log-probabilities computed elsewhere (use reduction "sum").
        kl_estimator ("k1", "k2", "k3") with reference_logprobs [N] adds kl_coef * KL per token
        and returns the estimate ("kl" output, mean_kl); entropy_coef subtracts entropy_coef * H.
        Labels at ignore_index mask tokens out (prompt and padding). Reductions besides "mean"
        (verl's "token-mean"), "sum" and "none": "sequence_mean_token_sum" and
        "sequence_mean_token_mean" (verl's "seq-mean-token-sum" and "seq-mean-token-mean"), over
        the sequences of sequence_lengths (packed one after another, summing to N); for them
        mean_denominator is the whole batch's number of sequences.

        objective "distill" is knowledge distillation, or the KL of a policy against a reference,
        against a teacher over the same vocabulary (lossd.v1.DistillOptions): the teacher head
        teacher_head (served; another hidden size allowed) with its rows teacher_hidden [N, H_t]
        for the same positions, or a sparse teacher, teacher_top_k_tokens [N, k] int32 and
        teacher_top_k_logprobs [N, k] (cached outputs; sparse_teacher_mass says what becomes of
        the mass outside the top-k: lossd.v1.SparseTeacherMass by its lower-case name). With
        q = softmax(z / tau), p = softmax(z_t / tau), tau = distill_temperature: distill_beta 0
        is KL(p || q), 1 is KL(q || p), between them the generalized JSD (TRL's convention);
        KD = tau^2 D, and the loss per token is distill_alpha * CE + (1 - distill_alpha) * KD.
        teacher_logit_softcap and teacher_temperature are the teacher head's own transform
        (teacher_logit_softcap as logit_softcap: None applies the teacher head's cap). labels
        may be None when distill_alpha is 0 (every row counts). Outputs "kd" and "ce" per token,
        mean_kd and mean_ce in the result; gradients reach the student only. Teacher rows travel
        in messages: shared_memory is refused with a teacher.

        outputs names the per-token results to return, from OUTPUT_NAMES (lossd.v1's
        OutputSelection and ComputeResult); top_k > 0 adds the k most likely tokens and their
        log-probabilities. grad_hidden_dtype (default: the dtype hidden travels in) is the dtype
        of grad_hidden. accumulate_grad_weight adds this call's dL/dW to the head's accumulator,
        all or nothing. head_version pins the call to a version of W (FAILED_PRECONDITION
        otherwise); versions count each server's own uploads and steps, so across replicas pin
        weight_sha256 instead: a HeadInfo.weight_sha256 (say from a first get_head), which a
        server with another W refuses with FAILED_PRECONDITION naming both hashes, so that the
        calls of one scoring session over replicas use one W even while an update rolls out.

        The rows stream to the server in messages of rows_per_message rows (default: a few MiB,
        within max_message_bytes); results stream back per computed chunk while later rows are
        still in flight and are put back together by row offset. compute_socket (None: the
        Client's, "auto" by default) sends those messages over the server's Compute socket
        instead of gRPC (see Client); True fails with FAILED_PRECONDITION where there is none.
        Results are the same either way, bit for bit, and so are errors.

        shared_memory=True, for a client on the server's host (any user, the server's network
        namespace), hands the rows over and takes dL/dh back in a memfd instead of messages (None,
        the default, takes the Client's: "auto" does so for a server on this host that offers
        it, and sends messages otherwise): the
        rows are copied once into the memfd (not at all when hidden lies in a shared_array), the
        server computes on them there and writes dL/dh there, and no tensor bytes cross the socket
        (rows_per_message is then unused). grad_hidden is then an array in that memory, which
        goes back to the client's pool once it and everything made from it (torch tensors too)
        are gone; with a few such arrays alive, further ones are copied out. Each memfd is handed
        over once, on the server's handover socket, for a handle the calls name; the memfds are
        kept between calls (a few per Client) and closed by close(). A server that does not offer
        it (--shared_memory=false), or a client that is not on its host, gets
        FAILED_PRECONDITION. Results are the same either way, bit for bit. Rows copied into the
        memfd go after the call's start where the server says that pays (its engine computes on a
        GPU, not the host's cores), a piece of about 32 MiB at a time, each announced once in
        place (SharedMemory.rows_follow), so that the server computes while the rest are copied;
        shared_rows_per_piece=n > 0 copies and announces n rows at a time whatever the server.

        Over messages too, a grad_hidden of 4 MiB or more is an array lent from that pool, back
        in it once it and everything made from it are gone, so that the next call's dL/dh lands
        in pages already touched instead of fresh ones the kernel must zero (a fifth of the
        client's time at 16,384 x 2048 float32); with a few alive, further ones are fresh arrays.

        grad_hidden_out, a writable C-contiguous [N, H] array of grad_hidden's dtype (uint16 for
        bfloat16), receives dL/dh instead, and is the result's grad_hidden. It is written only
        once the call has succeeded.

        call_id names the call on the server so that a retry cannot add its dL/dW twice (see
        RetryPolicy and ComputeStart.call_id in lossd.proto): None gives a call that accumulates
        a fresh random id (uuid4 hex); a string of up to 64 printable ASCII characters without
        spaces sets it, to repeat a call from another process or after the client gave up.
        UNAVAILABLE and DEADLINE_EXCEEDED are retried as the Client's RetryPolicy says; a repeat
        of a committed call comes back with replayed True. A repeat after the head was stepped
        (with or without keep_grad), replaced or had its gradient zeroed raises ALREADY_EXISTS:
        its dL/dW was counted once, its results cannot be had again.

        stage_grad_weight=True (with accumulate_grad_weight) keeps the call's dL/dW on the server
        under its call_id instead of adding it: commit_grad_weight(head, call_id, scale) adds it
        times scale later (a backward pass's upstream gradient), discard_grad_weight drops it,
        and so does a step. The result's grad_weight_staged says whether it was staged; a
        server without room for it accumulates it at once (grad_weight_accumulated).
        """
        hidden_dtype, hidden = _tensors.as_wire_array(hidden)
        if hidden.ndim != 2:
            raise ValueError(f"hidden: expected a [num_tokens, hidden_size] array, got shape "
                             f"{hidden.shape}")
        num_tokens, hidden_size = hidden.shape
        loss_options = _options.options_from_keywords(options, **option_keywords)
        if labels is None and loss_options.objective != "distill":
            raise ValueError("labels: expected an array of num_tokens token ids (only the "
                             "distill objective, with distill_alpha 0, goes without)")
        labels = np.zeros(0, np.int64) if labels is None else _token_ids(labels, "labels")
        if labels.size and labels.shape[0] != num_tokens:
            raise ValueError(f"labels: expected {num_tokens} entries (rows of hidden), got "
                             f"{labels.shape[0]}")
        side, teacher_fields = _teacher_rows(teacher_head, teacher_hidden, teacher_top_k_tokens,
                                             teacher_top_k_logprobs, num_tokens, hidden_dtype)
        if side and shared_memory is True:
            raise ValueError("shared_memory: not with a teacher (its rows travel in messages)")
        if shared_memory is not True:
            # Chosen for the call: a teacher's rows travel in messages, and a call without rows
            # has nothing to share.
            shared_memory = not side and num_tokens > 0 and self._use_shared_memory(shared_memory)
        wanted = set(outputs)
        unknown = wanted - set(OUTPUT_NAMES)
        if unknown:
            raise ValueError(f"outputs: unknown {sorted(unknown)}; expected names from "
                             f"{', '.join(OUTPUT_NAMES)}")
        grad_dtype = hidden_dtype if grad_hidden_dtype is None else grad_hidden_dtype
        per_token = _per_token_inputs(
            num_tokens, weights=weights, sampling_logprobs=sampling_logprobs,
            advantages=advantages, reference_logprobs=reference_logprobs,
            logprob_grads=logprob_grads, rollout_logprobs=rollout_logprobs)
        selection = pb.OutputSelection(
            top_k=top_k, grad_hidden_dtype=_tensors.wire_enum(grad_dtype),
            accumulate_grad_weight=accumulate_grad_weight,
            **{name: True for name in wanted})
        start = pb.ComputeStart(
            head=head, options=loss_options.to_proto(), outputs=selection,
            shift_labels=shift_labels, num_tokens=num_tokens, hidden_size=hidden_size,
            hidden_dtype=_tensors.wire_enum(hidden_dtype), labels=labels.tolist(),
            sequence_lengths=([] if sequence_lengths is None else np.asarray(
                sequence_lengths, dtype=np.int64).reshape(-1).tolist()),
            weight_sha256=weight_sha256 or "", stage_grad_weight=stage_grad_weight,
            **per_token, **teacher_fields)
        if head_version is not None:
            start.head_version = head_version
        if teacher_head_version is not None:
            start.teacher_head_version = teacher_head_version
        # Refused here, before the first attempt, for a target that lists several servers.
        one_server_for = ("shared memory" if shared_memory else
                          "a call that accumulates dL/dW" if accumulate_grad_weight else None)
        self._stub_for("Compute", one_server_for)
        if call_id is None and accumulate_grad_weight:
            call_id = uuid.uuid4().hex
        start.call_id = call_id or ""
        if grad_hidden_out is not None:
            _check_grad_hidden_out(grad_hidden_out, "grad_hidden" in wanted, num_tokens,
                                   hidden_size, _tensors.numpy_dtype(grad_dtype))
        if shared_rows_per_piece is not None and (
                not isinstance(shared_rows_per_piece, (int, np.integer)) or shared_rows_per_piece < 1):
            raise ValueError(f"shared_rows_per_piece: expected a positive count of rows or None, "
                             f"got {shared_rows_per_piece!r}")
        if shared_memory:
            def attempt():
                return self._compute_shared(start, hidden, wanted, top_k, grad_dtype,
                                            grad_hidden_out, shared_rows_per_piece)
        else:
            row_bytes = hidden_size * hidden.itemsize + sum(
                array.shape[1] * array.itemsize for array in side.values())
            rows = rows_per_message or self._rows_per_message(row_bytes)
            over_socket = self._use_compute_socket(compute_socket)
            lanes = 1
            if over_socket is not None:
                # No more lanes than messages of rows: a lane with none to carry only waits.
                lanes = max(1, min(self._compute_socket_lanes, -(-num_tokens // rows)))
                if lanes > 1 and rows_per_message is None:
                    # A round of messages, one on each lane, holds what one message would, so
                    # that each fits in its socket's buffers and every lane keeps moving while
                    # the server reads the others in turn.
                    rows = -(-rows // lanes)
            # Chosen by the client ("auto"): a socket it cannot use sends the call over gRPC.
            fall_back = (self._compute_socket_choice if compute_socket is None
                         else compute_socket) == "auto"

            def attempt():
                return self._compute_messages(start, hidden, rows, wanted, top_k, grad_dtype,
                                              grad_hidden_out, one_server_for, side, over_socket,
                                              fall_back, lanes)
        result = self._with_retries(attempt, start.call_id)
        result.call_id = start.call_id
        if shared_memory:
            result.transport = "shared_memory"
        return result

    def _with_retries(self, attempt, call_id, method="Compute"):
        """attempt() until it succeeds, fails with a code not worth retrying, or the policy's
        attempts are spent; a compute result records how many it took."""
        policy = self._retry
        backoff = policy.initial_backoff
        started = time.monotonic()
        for number in range(1, policy.max_attempts + 1):
            try:
                result = attempt()
            except LossdError as error:
                if error.code not in _RETRYABLE_CODES or number == policy.max_attempts:
                    raise
                wait = min(backoff, policy.max_backoff) * random.uniform(0.5, 1.0)
                if policy.max_elapsed is not None and \
                        time.monotonic() - started + wait > policy.max_elapsed:
                    raise
                _log.warning("%s attempt %d of %d failed (%s: %s); retrying in %.3f s%s",
                             method, number, policy.max_attempts, error.code, error.message, wait,
                             f" under call_id {call_id}" if call_id else "")
                if policy.on_retry is not None:
                    policy.on_retry(error, number, wait)
                time.sleep(wait)
                backoff = min(backoff * policy.backoff_multiplier, policy.max_backoff)
                continue
            if isinstance(result, LossResult):
                result.attempts = number
            return result
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _compute_messages(self, start, hidden, rows, wanted, top_k, grad_dtype, grad_hidden_out,
                          one_server_for, side=None, over_socket=None, fall_back=True,
                          lanes=1):
        """compute() with the rows sent in chunk messages of `rows` rows (each with the same rows
        of every `side` array, a teacher's, under its ComputeChunk field name), and dL/dh back in
        the result messages; over the Compute socket `over_socket` when given, else (or, with
        fall_back, when that socket cannot be reached or has no room left) over gRPC:
        to one server when one_server_for names why, else to the next replica. Over the socket
        the call spreads over `lanes` connections."""
        num_tokens, hidden_size = hidden.shape
        side = side or {}

        def message_parts():
            yield [_wire.encode_start(start)]
            for r0 in range(0, num_tokens, rows):
                yield _wire.encode_chunk_parts({"hidden": hidden[r0:r0 + rows],
                                                **{name: array[r0:r0 + rows]
                                                   for name, array in side.items()}})

        result = None
        if over_socket is not None:
            try:
                result = _assemble(None, wanted, top_k, num_tokens, hidden_size, grad_dtype,
                                   new_array=self._shared_buffers.new_array,
                                   responses_placing=functools.partial(
                                       over_socket.responses, message_parts, lanes=lanes))
                result.transport = "compute_socket"
            except _compute_socket.SocketUnusable as unusable:
                if not fall_back:
                    raise
                _log.warning("%s; this call goes over gRPC", unusable.message)
        if result is None:
            requests = (b"".join(parts) for parts in message_parts())
            responses = self._responses("Compute",
                                        self._call("Compute", requests, one_server_for))
            result = _assemble(responses, wanted, top_k, num_tokens, hidden_size, grad_dtype,
                               new_array=self._shared_buffers.new_array)
        if grad_hidden_out is not None:
            # Assembled apart as the messages came, so that a failed call left it as it was.
            copy_rows(grad_hidden_out, result.grad_hidden)
            result.grad_hidden = grad_hidden_out
        return result

    def _compute_shared(self, start, hidden, wanted, top_k, grad_dtype, grad_hidden_out,
                        rows_per_piece=None):
        """compute() with the rows and dL/dh in memfds. Rows that lie in a shared array are read
        where they are, and the start message is the whole request; others are copied into a
        pooled memfd, piece by piece after the start when they are large, each piece announced
        once in place (SharedMemory.rows_follow), so that the server computes while the rest are
        copied. dL/dh goes to a pooled memfd (after the copied rows, or one of its own) and
        is returned there, lent (see _SharedBufferPool.lend), or copied out."""
        num_tokens, hidden_size = hidden.shape
        grad_numpy_dtype = _tensors.numpy_dtype(grad_dtype)
        grad_bytes = num_tokens * hidden_size * grad_numpy_dtype.itemsize
        grad_wanted = "grad_hidden" in wanted
        handover = self._handover_connection()
        shared_rows = self._shared_buffers.find(hidden)
        if shared_rows is not None and shared_rows[1] % _SHARED_MEMORY_ALIGNMENT != 0:
            shared_rows = None  # a slice that starts off the server's alignment: copied
        if shared_rows is None:
            grad_offset = _aligned(hidden.nbytes)
            pooled = self._shared_buffers.acquire(grad_offset + (grad_bytes if grad_wanted else 0))
        else:
            grad_offset = 0
            pooled = self._shared_buffers.acquire(grad_bytes) if grad_wanted else None
        call = None
        following = None
        try:
            if shared_rows is None:
                shared = pb.SharedMemory(handle=pooled.handle_on(handover), hidden_offset=0,
                                         grad_hidden_offset=grad_offset)
                piece_rows = _FollowingRows.piece_rows(hidden, handover, rows_per_piece)
                if piece_rows < num_tokens:
                    following = _FollowingRows(pooled, hidden, piece_rows)
                    shared.rows_follow = True
                else:
                    copy_rows(pooled.array(0, hidden.dtype, hidden.shape), hidden)
            else:
                rows_buffer, rows_offset = shared_rows
                shared = pb.SharedMemory(handle=rows_buffer.handle_on(handover),
                                         hidden_offset=rows_offset)
                if pooled is not None:
                    shared.grad_hidden_handle = pooled.handle_on(handover)
            start.shared_memory.CopyFrom(shared)
            start_message = _wire.encode_start(start)
            # One message, then the end of the stream (the server reads nothing more), or the
            # start, then the rows' announcements as they are copied.
            messages = (iter((start_message,)) if following is None
                        else following.messages(start_message))
            call = self._call("Compute", messages, "shared memory")
            result = _assemble(self._responses("Compute", call), wanted, top_k, num_tokens,
                               hidden_size, grad_dtype, grad_hidden_in_messages=False)
            if grad_wanted:
                shape = (num_tokens, hidden_size)
                lent = None if grad_hidden_out is not None else self._shared_buffers.lend(
                    pooled, grad_offset, grad_numpy_dtype, shape)
                if lent is not None:
                    result.grad_hidden = lent
                    pooled = None  # back in the pool once the caller lets go of it
                else:
                    target = grad_hidden_out
                    if target is None:
                        target = np.empty(shape, grad_numpy_dtype)
                    copy_rows(target, pooled.array(grad_offset, grad_numpy_dtype, shape))
                    result.grad_hidden = target
        except BaseException:
            # A failed call drops its pooled buffer instead of keeping it: a server still running
            # a cancelled call may yet write dL/dh into it, which must not land in the next call's.
            if call is not None:
                call.cancel()  # tells the server to stop; nothing once the call has ended
            if following is not None:
                following.stop()
            if pooled is not None:
                pooled.close()
            raise
        if pooled is not None:
            self._shared_buffers.release(pooled)
        return result

    def shared_array(self, shape, dtype="float32"):
        """A new C-contiguous array of `shape` (zeros) in memory this client can share with a
        server on its host: compute() reads hidden rows that lie in one (the whole array, or a
        slice of whole rows starting at a multiple of 64 bytes) where they are, instead of
        copying them into shared memory first. dtype: "float32", "bfloat16" (uint16 bit
        patterns) or "float16"; torch.from_numpy(array) shares it (for bfloat16,
        torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)). The memory is handed
        over to the server once, at the first call that uses it, and freed once the array and
        everything made from it are gone. With messages (a server elsewhere) it is an ordinary
        array. Linux only (memfd_create)."""
        numpy_dtype = _tensors.numpy_dtype(dtype)
        shape = tuple(int(extent) for extent in np.atleast_1d(shape))
        if any(extent < 0 for extent in shape):
            raise ValueError(f"shape: expected extents >= 0, got {shape}")
        size = int(np.prod(shape)) * numpy_dtype.itemsize
        return self._shared_buffers.shared_array(size, numpy_dtype, shape)

    def score_kl(self, head, hidden, teacher_head, teacher_hidden, *, beta=1.0, temperature=1.0,
                 labels=None, ignore_index=-100, logit_softcap=None, teacher_logit_softcap=None,
                 teacher_temperature=1.0) -> LossResult:
        """The divergence per token between head `head` on hidden [N, H] and `teacher_head` on
        teacher_hidden [N, H_t] (the "distill" objective without gradients): result.kd [N] and
        result.mean_kd. beta 1 (the default) is KL(q || p), q the head's and p the teacher's
        distribution: a policy's KL from its reference, as RL's KL penalty measures it; 0 is
        KL(p || q), between them the generalized JSD. labels, when given, only mask tokens
        (ignore_index). The soft caps as in compute() (None: each head's own). Nothing is
        accumulated on the server."""
        return self.compute(head, hidden, labels, reduction="none", ignore_index=ignore_index,
                            logit_softcap=logit_softcap, objective="distill",
                            teacher_head=teacher_head, teacher_hidden=teacher_hidden,
                            distill_beta=beta, distill_temperature=temperature,
                            teacher_logit_softcap=teacher_logit_softcap,
                            teacher_temperature=teacher_temperature, outputs=["kd"])

    def score(self, head, hidden, token_ids, *, top_k=0, entropy=False, temperature=1.0,
              logit_softcap=None, ignore_index=-100, weight_sha256=None) -> LossResult:
        """Per-token log-probabilities of token_ids [N] given hidden [N, H] (logprob), with the
        top_k most likely tokens (top_k_token, top_k_logprob) and the entropy when asked.
        logit_softcap as in compute() (None: the head's). Nothing is accumulated on the server.
        weight_sha256 pins W (see compute)."""
        outputs = ["logprob"] + (["entropy"] if entropy else [])
        return self.compute(head, hidden, token_ids, reduction="sum", ignore_index=ignore_index,
                            temperature=temperature, logit_softcap=logit_softcap,
                            outputs=outputs, top_k=top_k, weight_sha256=weight_sha256)


def _rank_group(world_size, rank):
    """The RankGroup of a collective call, checked here so that a bad rank fails before any rank
    waits on the server."""
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"world_size: expected an int >= 1, got {world_size!r}")
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"rank: expected an int in [0, {world_size}), got {rank!r}")
    return pb.RankGroup(world_size=world_size if world_size > 1 else 0,
                        rank=rank if world_size > 1 else 0)


def _token_ids(values, field):
    """values as a flat int64 array. Anything but integers is refused rather than cast: float
    labels are likelier a mistake (or class probabilities, as F.cross_entropy reads them) than
    token ids, and casting would truncate them silently."""
    array = np.asarray(values)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{field}: expected integer token ids, got {array.dtype} values; cast "
                        f"them with .astype(np.int64) if they are ids")
    return array.astype(np.int64, copy=False).reshape(-1)


def _per_token_inputs(num_tokens, **inputs):
    """The ComputeStart fields of the per-token inputs given (weights as token_weights), each
    num_tokens float32 values."""
    fields = {}
    for name, values in inputs.items():
        if values is None:
            continue
        values = np.asarray(values, dtype=np.float32).reshape(-1)
        if values.shape[0] != num_tokens:
            raise ValueError(f"{name}: expected {num_tokens} entries (rows of hidden), got "
                             f"{values.shape[0]}")
        fields["token_weights" if name == "weights" else name] = values.tolist()
    return fields


def _teacher_rows(teacher_head, teacher_hidden, tokens, logprobs, num_tokens, hidden_dtype):
    """The per-row teacher arrays that ride in each chunk message beside the hidden rows, by their
    ComputeChunk field name, and the ComputeStart fields that announce them."""
    if teacher_head is None and tokens is None and logprobs is None:
        if teacher_hidden is not None:
            raise ValueError("teacher_hidden: given without a teacher_head")
        return {}, {}
    if teacher_head is not None:
        if tokens is not None or logprobs is not None:
            raise ValueError("teacher_head and teacher_top_k_tokens/logprobs: expected one "
                             "teacher, got both")
        if teacher_hidden is None:
            raise ValueError("teacher_hidden: expected the teacher's rows [N, H_t] beside "
                             "teacher_head")
        dtype, rows = _tensors.as_wire_array(teacher_hidden)
        if rows.ndim != 2 or rows.shape[0] != num_tokens:
            raise ValueError(f"teacher_hidden: expected a [{num_tokens}, teacher_hidden_size] "
                             f"array (a row per row of hidden), got shape {rows.shape}")
        fields = dict(teacher_head=teacher_head, teacher_hidden_size=rows.shape[1])
        if dtype != hidden_dtype:
            fields["teacher_hidden_dtype"] = _tensors.wire_enum(dtype)
        return {"teacher_hidden": rows}, fields
    if tokens is None or logprobs is None:
        raise ValueError("teacher_top_k_tokens, teacher_top_k_logprobs: expected both")
    tokens = np.ascontiguousarray(
        _token_ids(tokens, "teacher_top_k_tokens").reshape(np.shape(tokens)), dtype="<i4")
    logprobs = np.ascontiguousarray(np.asarray(logprobs), dtype="<f4")
    if tokens.ndim != 2 or tokens.shape != logprobs.shape or tokens.shape[0] != num_tokens:
        raise ValueError(f"teacher_top_k_tokens, teacher_top_k_logprobs: expected two "
                         f"[{num_tokens}, k] arrays, got shapes {tokens.shape} and "
                         f"{logprobs.shape}")
    return ({"teacher_top_k_tokens": tokens, "teacher_top_k_logprobs": logprobs},
            dict(teacher_top_k=tokens.shape[1]))


def _aligned(offset):
    """The first offset at or after `offset` that the server takes (SharedMemory in the proto)."""
    return -(-offset // _SHARED_MEMORY_ALIGNMENT) * _SHARED_MEMORY_ALIGNMENT


def _check_grad_hidden_out(out, grad_wanted, num_tokens, hidden_size, dtype):
    if not grad_wanted:
        raise ValueError("grad_hidden_out: given, but outputs does not ask for grad_hidden")
    if not isinstance(out, np.ndarray) or out.shape != (num_tokens, hidden_size) or \
            out.dtype != dtype or not out.flags.c_contiguous or not out.flags.writeable:
        got = (f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray)
               else type(out).__name__)
        raise ValueError(f"grad_hidden_out: expected a writable C-contiguous {dtype} array of "
                         f"shape {(num_tokens, hidden_size)}, got {got}")


def _empty_array(dtype, shape):
    return np.empty(shape, dtype)


def _assemble(responses, wanted, top_k, num_tokens, hidden_size, grad_dtype,
              grad_hidden_in_messages=True, new_array=None, responses_placing=None):
    """A LossResult from a Compute call's responses (pb.ComputeSummary and _wire.Result):
    per-chunk results placed by row offset as they arrive, then the summary. Every per-token
    output the call asked for (lossd.options' naming rule) must come with each message's rows.
    Without grad_hidden_in_messages (shared memory) the messages carry no dL/dh and
    grad_hidden is left None, for the caller to fill. new_array(dtype, shape) makes dL/dh's array
    (np.empty by default). responses_placing(place), given instead of responses, gives responses
    whose dL/dh may be received straight into that array, where place(result, nbytes) says."""
    per_row = {name: 1 for name in _options.ROW_OUTPUT_NAMES if name in wanted}
    if top_k > 0:
        per_row.update({name: top_k for name in _options.TOP_K_OUTPUT_NAMES})
    outputs = {name: np.empty((num_tokens, top_k) if name in _options.TOP_K_OUTPUT_NAMES
                              else num_tokens, _options.output_numpy_dtype(name))
               for name in per_row}
    grad_hidden = None
    # dL/dh bytes each result must carry per row: none unless asked for and sent in messages.
    grad_row_bytes = 0
    if "grad_hidden" in wanted and grad_hidden_in_messages:
        grad_hidden = (new_array or _empty_array)(_tensors.numpy_dtype(grad_dtype),
                                                  (num_tokens, hidden_size))
        grad_row_bytes = hidden_size * grad_hidden.itemsize

    def rows_of(chunk, grad_nbytes):
        first, end = chunk.row_offset, chunk.row_offset + chunk.num_rows
        if first < 0 or end > num_tokens:
            raise LossdError("Compute", "INTERNAL",
                             f"result rows [{first}, {end}) outside [0, {num_tokens})")
        if grad_nbytes != chunk.num_rows * grad_row_bytes:
            raise LossdError("Compute", "INTERNAL",
                             f"result rows [{first}, {end}) carry {grad_nbytes} bytes "
                             f"of grad_hidden, expected {chunk.num_rows * grad_row_bytes}")
        return first, end

    def place(chunk, grad_nbytes):
        if grad_hidden is None:
            return None
        first, end = rows_of(chunk, grad_nbytes)
        return memoryview(grad_hidden[first:end]).cast("B")

    if responses_placing is not None:
        responses = responses_placing(place)
    received = 0
    summary = None
    for response in responses:
        if isinstance(response, pb.ComputeSummary):
            summary = response
            continue
        chunk = response.message
        if response.placed:
            first, end = chunk.row_offset, chunk.row_offset + chunk.num_rows  # checked by place
        else:
            first, end = rows_of(chunk, len(response.grad_hidden))
            if grad_hidden is not None:
                grad_hidden[first:end] = _tensors.from_wire(response.grad_hidden, grad_dtype,
                                                            (chunk.num_rows, hidden_size))
        for name, array in outputs.items():
            values = getattr(chunk, name)
            if len(values) != chunk.num_rows * per_row[name]:
                raise LossdError("Compute", "INTERNAL",
                                 f"result rows [{first}, {end}) carry {len(values)} values of "
                                 f"{name}, expected {chunk.num_rows * per_row[name]}")
            array[first:end] = np.asarray(values, array.dtype).reshape(array[first:end].shape)
        received += chunk.num_rows
    if summary is None or received != num_tokens:
        raise LossdError("Compute", "INTERNAL", f"results for {received} of {num_tokens} rows"
                         f"{'' if summary else ' and no summary'}")
    return LossResult(summary, outputs, grad_hidden)
