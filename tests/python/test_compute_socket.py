"""Compute calls over the Compute socket (lossd_server --compute_socket_listen) against the real
server on loopback: the same results as over gRPC, bit for bit, and float64 references; the same
errors; and a server that a hostile or vanishing peer can neither stall, crash nor leave with a
partial gradient.

The raw-socket tests speak the framing of lossd.proto (ComputeSocket) themselves.
"""
import socket
import struct
import threading
import time

import numpy as np
import pytest
import torch

from server_process import demo_server, ensure_python_client
from test_client import (CASES, GRAD_RTOL, LOSS_RTOL, check_case_against_torch, random_batch,
                         relative_error)

ensure_python_client()
import lossd  # noqa: E402
from lossd import _compute_socket, _shared_memory, _wire  # noqa: E402
from lossd.torch import RemoteHead  # noqa: E402
from lossd.v1 import lossd_pb2 as pb  # noqa: E402

VOCAB, HIDDEN = 3001, 64
MAGIC = 0x3153434C
HEADER = struct.Struct("<IIQ")
IDLE_SECONDS = 3


@pytest.fixture(scope="module")
def server():
    # A 1 MiB workspace computes a few hundred rows in several engine chunks, so results come
    # back in several messages; a short idle limit lets the tests see silent peers ended.
    with demo_server(VOCAB, HIDDEN, "--workspace_budget_mib=1", "--compute_socket_listen=127.0.0.1:0",
                     f"--stream_idle_seconds={IDLE_SECONDS}", "--compute_socket_idle_seconds=2",
                     "--shared_memory=false", metrics=True) as s:
        yield s


@pytest.fixture(scope="module", autouse=True)
def small_results_placed_and_lent():
    # These tests' results are far below the sizes at which a result's dL/dh is received straight
    # into its array and that array lent from the pool: every size takes those paths here, and a
    # test of the clients' own thresholds sets them back (CLIENT_THRESHOLDS).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_compute_socket, "_PLACED_MIN_BYTES", 0)
        patch.setattr(_shared_memory._SharedBufferPool, "_MIN_LENT_ARRAY_BYTES", 0)
        yield


# The clients' own thresholds, as they were before the fixture above lowered them.
CLIENT_THRESHOLDS = [(_compute_socket, "_PLACED_MIN_BYTES", _compute_socket._PLACED_MIN_BYTES),
                     (_shared_memory._SharedBufferPool, "_MIN_LENT_ARRAY_BYTES",
                      _shared_memory._SharedBufferPool._MIN_LENT_ARRAY_BYTES)]


@pytest.fixture(scope="module")
def over_grpc(server):
    with lossd.Client(server.address, timeout=600, compute_socket=False) as c:
        yield c


@pytest.fixture(scope="module")
def over_socket(server):
    with lossd.Client(server.address, timeout=600, compute_socket=True) as c:
        yield c


@pytest.fixture(scope="module")
def over_lanes(server):
    with lossd.Client(server.address, timeout=600, compute_socket=True,
                      compute_socket_lanes=3) as c:
        yield c


@pytest.fixture
def head(over_grpc):
    weight = np.random.default_rng().standard_normal((VOCAB, HIDDEN), dtype=np.float32) * 0.3
    return RemoteHead.upload(over_grpc, f"socket-{np.random.default_rng().integers(1 << 40):x}",
                             torch.from_numpy(weight))


def socket_port(client):
    return client._unary("GetComputeSocket", pb.GetComputeSocketRequest()).port


# --- raw frames ------------------------------------------------------------------------------------

def frame(kind, payload=b"", magic=MAGIC, length=None):
    return HEADER.pack(magic, kind, len(payload) if length is None else length) + payload


def read_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def read_frame(sock):
    magic, kind, length = HEADER.unpack(read_exact(sock, HEADER.size))
    assert magic == MAGIC
    return kind, read_exact(sock, length)


def read_status(sock):
    kind, body = read_frame(sock)
    assert kind == pb.FRAME_STATUS
    return pb.RpcStatus.FromString(body)


def field_of(status):
    for detail in status.details:
        info = pb.ErrorInfo()
        if detail.Unpack(info):
            return info.field
    return ""


def closed_by_server(sock, within=30):
    """Whether the server closes the connection (reads end) within `within` seconds."""
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def wait_for_no_call_in_flight(server, within=120):
    deadline = time.monotonic() + within
    while server.metric("lossd_inflight_calls") > 0:
        assert time.monotonic() < deadline, "a call stayed in flight"
        time.sleep(0.05)


def frames_until_closed(sock, within=120):
    """The frames the server sends until it closes the connection: (kinds of the whole frames,
    whether the connection ended inside a frame)."""
    sock.settimeout(within)
    data = b""
    try:
        while True:
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            data += chunk
    except (ConnectionResetError, BrokenPipeError):
        pass
    kinds = []
    while len(data) >= HEADER.size:
        _, kind, length = HEADER.unpack(data[:HEADER.size])
        if len(data) < HEADER.size + length:
            break
        kinds.append((kind, data[HEADER.size:HEADER.size + length]))
        data = data[HEADER.size + length:]
    return kinds, len(data) > 0


def raw_connection(server, client, token=""):
    sock = socket.create_connection(("127.0.0.1", socket_port(client)), timeout=60)
    sock.sendall(frame(pb.FRAME_HELLO, pb.ComputeSocketHello(token=token).SerializeToString()))
    return sock


# --- results -----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradients_match_torch_over_the_socket(over_socket, head, case):
    check_case_against_torch(RemoteHead(over_socket, head.head), head, case)


SHAPES = {
    "one_row": dict(tokens=1),  # the smallest call: one message each way
    "chunk_boundaries": dict(tokens=777, rows_per_message=100),  # messages and chunks misalign
    # Messages above 256 KiB: the server receives rows straight into its chunk buffers, each
    # message's rows spanning many chunks.
    "rows_received_in_place": dict(tokens=3000, rows_per_message=1100),
    "all_ignored": dict(tokens=64, ignored=64),  # no token counts: loss 0, dL/dh zero
    "extreme_logits": dict(tokens=50, scale=300.0),  # softmax saturates
    "bfloat16_rows": dict(tokens=300, dtype="bfloat16"),  # dL/dh back in bfloat16
    "top_k_and_entropy": dict(tokens=200, top_k=5),  # per-token outputs beside dL/dh
    "no_rows": dict(tokens=0),  # a call that is only its start
}


@pytest.mark.parametrize("shape", SHAPES)
def test_the_socket_gives_the_same_bits_as_grpc(over_grpc, over_socket, head, shape):
    spec = SHAPES[shape]
    rng = np.random.default_rng()
    n = spec["tokens"]
    hidden = rng.standard_normal((n, HIDDEN), dtype=np.float32) * spec.get("scale", 1.0)
    if spec.get("dtype") == "bfloat16":
        hidden = lossd.float32_to_bfloat16_bits(hidden)
    labels = rng.integers(0, VOCAB, n)
    labels[:spec.get("ignored", 0)] = -100
    outputs = ["grad_hidden", "token_loss", "logprob", "lse"]
    if spec.get("top_k"):
        outputs += ["entropy", "argmax"]
    results = [client.compute(head.head, hidden, labels, outputs=outputs,
                              top_k=spec.get("top_k", 0),
                              rows_per_message=spec.get("rows_per_message"))
               for client in (over_grpc, over_socket)]
    grpc_result, socket_result = results
    assert (grpc_result.transport, socket_result.transport) == ("grpc", "compute_socket")
    assert np.isfinite(grpc_result.loss)
    assert grpc_result.loss == socket_result.loss
    assert grpc_result.counted_tokens == socket_result.counted_tokens
    names = outputs + (["top_k_token", "top_k_logprob"] if spec.get("top_k") else [])
    for name in names:
        expected, got = getattr(grpc_result, name), getattr(socket_result, name)
        assert got is not None and np.array_equal(expected, got), name


# At the clients' own thresholds (a server of its own, whose default workspace computes 2048 rows
# in one chunk): each result's dL/dh, megabytes in one message, is received straight into a lent
# array, with the same bits as the one assembled from gRPC's messages; a result whose small fields
# outrun the first bytes read is received whole, with the same bits too.
@pytest.mark.parametrize("case", ["placed", "small_fields_outrun_the_head"])
def test_a_large_result_lands_in_place_with_the_same_bits(monkeypatch, case):
    for owner, name, value in CLIENT_THRESHOLDS:
        monkeypatch.setattr(owner, name, value)
    placed = []  # rows of each result message read, placed or not
    read_response = _compute_socket._Connection.read_response

    def spy(connection, answered, place):
        kind, body = read_response(connection, answered, place)
        if isinstance(body, _wire.Result):
            placed.append((body.placed, body.message.num_rows))
        return kind, body

    monkeypatch.setattr(_compute_socket._Connection, "read_response", spy)
    top_k = 0
    if case == "small_fields_outrun_the_head":
        monkeypatch.setattr(_compute_socket, "_HEAD_BYTES", 256)
        top_k = 4
    rng = np.random.default_rng()
    n, vocab, hidden_size = 2048, 16, 2048
    with demo_server(vocab, hidden_size, "--compute_socket_listen=127.0.0.1:0",
                     "--shared_memory=false") as server, \
            lossd.Client(server.address, timeout=600, compute_socket=False) as by_grpc, \
            lossd.Client(server.address, timeout=600, compute_socket=True) as by_socket:
        by_grpc.upload_head("large", rng.standard_normal((vocab, hidden_size),
                                                         dtype=np.float32) * 0.1)
        hidden = rng.standard_normal((n, hidden_size), dtype=np.float32)
        labels = rng.integers(0, vocab, n)
        results = [client.compute("large", hidden, labels, outputs=["grad_hidden", "logprob"],
                                  top_k=top_k) for client in (by_grpc, by_socket)]
    assert [result.transport for result in results] == ["grpc", "compute_socket"]
    for name in ("grad_hidden", "logprob") + (("top_k_logprob",) if top_k else ()):
        assert np.array_equal(getattr(results[0], name), getattr(results[1], name)), name
    assert all(isinstance(result.grad_hidden.base, _shared_memory._Lease) for result in results)
    # Messages under _PLACED_MIN_BYTES (the last of a call, say) are read whole.
    rows_placed = sum(rows for was_placed, rows in placed if was_placed)
    assert rows_placed >= n // 2 if case == "placed" else rows_placed == 0


# dL/dh arrays come from a pool: one the caller let go of serves the next call, one it keeps is
# never written again, and past the lending limit results are arrays of their own.
@pytest.mark.parametrize("transport", ["grpc", "compute_socket"])
def test_a_kept_result_is_never_overwritten_by_later_calls(request, head, transport):
    client = request.getfixturevalue("over_grpc" if transport == "grpc" else "over_socket")
    rng = np.random.default_rng()
    n = 300
    labels = rng.integers(0, VOCAB, n)
    batches = [rng.standard_normal((n, HIDDEN), dtype=np.float32) for _ in range(7)]

    def grad_hidden(hidden):
        result = client.compute(head.head, hidden, labels, outputs=["grad_hidden"])
        assert result.transport == transport
        return result.grad_hidden

    let_go = grad_hidden(batches[0])
    address = let_go.__array_interface__["data"][0]
    del let_go
    reused = grad_hidden(batches[0])
    assert reused.__array_interface__["data"][0] == address
    del reused
    kept = [grad_hidden(hidden) for hidden in batches]  # more than the pool lends at once
    copies = [array.copy() for array in kept]
    lent = sum(isinstance(array.base, _shared_memory._Lease) for array in kept)
    assert lent == _shared_memory._SharedBufferPool._MAX_LENT
    views = [torch.from_numpy(array[::2]) for array in kept]  # a view keeps its array lent
    del kept
    for hidden in batches:
        grad_hidden(hidden)
    expected = [grad_hidden(hidden).copy() for hidden in batches]
    for view, copy, again in zip(views, copies, expected):
        assert np.array_equal(view.numpy(), copy[::2])
        assert np.array_equal(copy, again)  # the same rows, computed again


# Where no memfd can be had (descriptors used up, a sandbox that forbids memfd_create), dL/dh
# comes in an array of its own, with the same bits.
def test_results_come_without_a_memfd_to_lend(server, over_grpc, head, monkeypatch):
    rng = np.random.default_rng()
    hidden = rng.standard_normal((300, HIDDEN), dtype=np.float32)
    labels = rng.integers(0, VOCAB, 300)
    expected = over_grpc.compute(head.head, hidden, labels, outputs=["grad_hidden"]).grad_hidden

    def no_memfd(*args):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(_shared_memory.os, "memfd_create", no_memfd)
    for choice in (False, True):
        with lossd.Client(server.address, timeout=600, compute_socket=choice) as client:
            got = client.compute(head.head, hidden, labels, outputs=["grad_hidden"]).grad_hidden
        assert not isinstance(got.base, _shared_memory._Lease)
        assert np.array_equal(got, expected)


def test_a_teacher_travels_in_the_socket_messages_too(over_grpc, over_socket):
    rng = np.random.default_rng()
    student = over_grpc.upload_head(f"student-{rng.integers(1 << 40):x}",
                                    rng.standard_normal((500, 32), dtype=np.float32) * 0.3)
    teacher = over_grpc.upload_head(f"teacher-{rng.integers(1 << 40):x}",
                                    rng.standard_normal((500, 48), dtype=np.float32) * 0.3)
    hidden = rng.standard_normal((130, 32), dtype=np.float32)
    teacher_hidden = rng.standard_normal((130, 48), dtype=np.float32)
    labels = rng.integers(0, 500, 130)
    results = [client.compute(student.name, hidden, labels, objective="distill",
                              distill_alpha=0.5, teacher_head=teacher.name,
                              teacher_hidden=teacher_hidden, outputs=["grad_hidden", "kd"],
                              rows_per_message=40)
               for client in (over_grpc, over_socket)]
    assert results[0].loss == results[1].loss and results[0].mean_kd > 0
    assert np.array_equal(results[0].grad_hidden, results[1].grad_hidden)
    assert np.array_equal(results[0].kd, results[1].kd)


def test_calls_reuse_one_connection_and_concurrent_calls_take_their_own(over_socket, head):
    hidden, labels = random_batch(100)
    for _ in range(3):
        over_socket.compute(head.head, hidden.numpy(), labels.numpy())
    assert len(over_socket._compute_socket._idle) == 1
    kept = over_socket._compute_socket._idle[0]
    over_socket.compute(head.head, hidden.numpy(), labels.numpy())
    # The same connection: not one replaced after the server closed it while idle (the check for
    # a closed one must not wait for that).
    assert over_socket._compute_socket._idle == [kept]
    errors = []

    def call():
        try:
            over_socket.compute(head.head, hidden.numpy(), labels.numpy(), outputs=["grad_hidden"])
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert 1 <= len(over_socket._compute_socket._idle) <= 3


@pytest.mark.parametrize("lanes", [1, 3])
def test_a_connection_the_server_closed_while_idle_is_replaced(server, head, lanes):
    hidden, labels = random_batch(50)
    with lossd.Client(server.address, timeout=600, compute_socket=True,
                      compute_socket_lanes=lanes) as client:
        client.compute(head.head, hidden.numpy(), labels.numpy(), rows_per_message=20)
        assert len(client._compute_socket._idle) == lanes
        time.sleep(4)  # past --compute_socket_idle_seconds=2: the server has closed the kept ones
        result = client.compute(head.head, hidden.numpy(), labels.numpy(), rows_per_message=20)
        assert result.attempts == 1 and result.transport == "compute_socket"


# --- lanes: one call over several connections ------------------------------------------------------

LANE_SHAPES = {
    # case -> (tokens, rows_per_message, lanes the client may use, lanes the call takes)
    "many_rounds": (700, 50, 3, 3),  # 14 messages of rows: each lane carries several
    "uneven_last_round": (531, 40, 3, 3),  # the last round fills one lane of three
    "more_lanes_than_messages": (100, 50, 8, 2),  # no lane without rows to carry
    "one_message": (40, None, 4, 1),  # a call of one message of rows keeps to one connection
    "one_row": (1, 1, 4, 1),  # N = 1
    "bfloat16_rows": (300, 16, 4, 4),  # dL/dh back in bfloat16, spread over the lanes
    "all_lanes_the_server_takes": (600, 25, 8, 8),  # the most a call may use
}


@pytest.mark.parametrize("case", LANE_SHAPES)
def test_lanes_give_the_same_bits_as_grpc(server, over_grpc, head, case):
    tokens, rows_per_message, lanes, used = LANE_SHAPES[case]
    rng = np.random.default_rng()
    hidden = rng.standard_normal((tokens, HIDDEN), dtype=np.float32)
    if case == "bfloat16_rows":
        hidden = lossd.float32_to_bfloat16_bits(hidden)
    labels = rng.integers(0, VOCAB, tokens)
    labels[::7] = -100
    outputs = ["grad_hidden", "token_loss", "logprob", "lse", "entropy", "argmax"]
    expected = over_grpc.compute(head.head, hidden, labels, outputs=outputs, top_k=3,
                                 rows_per_message=rows_per_message)
    with lossd.Client(server.address, timeout=600, compute_socket=True,
                      compute_socket_lanes=lanes) as client:
        for _ in range(2):  # on fresh connections, then on the kept ones
            got = client.compute(head.head, hidden, labels, outputs=outputs, top_k=3,
                                 rows_per_message=rows_per_message)
            assert got.transport == "compute_socket"
            assert len(client._compute_socket._idle) == used  # each lane kept for the next call
            assert got.loss == expected.loss and np.isfinite(got.loss)
            for name in outputs + ["top_k_token", "top_k_logprob"]:
                assert np.array_equal(getattr(got, name), getattr(expected, name)), name


def test_kept_lanes_the_server_closed_meanwhile_are_replaced(server, head):
    """Some kept connections closed by the server (idle past --compute_socket_idle_seconds=2),
    another still open: the call takes fresh lanes for the closed ones at once, rather than wait
    on lane 0 for lanes that can never join."""
    hidden, labels = random_batch(100)
    with lossd.Client(server.address, timeout=600, compute_socket=True,
                      compute_socket_lanes=3) as client:
        client.compute(head.head, hidden.numpy(), labels.numpy(), rows_per_message=10)
        time.sleep(1.2)
        # One message of rows: one connection, whose idle time starts again.
        client.compute(head.head, hidden.numpy(), labels.numpy())
        time.sleep(1.2)  # the other two, idle 2.4 s, are closed now
        started = time.monotonic()
        result = client.compute(head.head, hidden.numpy(), labels.numpy(), rows_per_message=10)
        assert result.attempts == 1 and result.transport == "compute_socket"
        assert time.monotonic() - started < IDLE_SECONDS  # no wait for a lane that never joins


def test_lanes_match_torch_in_float64(over_lanes, head):
    # Enough rows for several messages of the client's own size (none given), which it cuts
    # smaller for the lanes.
    hidden, labels = random_batch(40000)
    result = over_lanes.compute(head.head, hidden.numpy(), labels.numpy(),
                                outputs=["grad_hidden"])
    assert result.transport == "compute_socket"
    assert len(over_lanes._compute_socket._idle) == 3
    h = hidden.double().requires_grad_()
    loss = torch.nn.functional.cross_entropy(h @ head.fetch_weight().double().T, labels,
                                             ignore_index=-100)
    loss.backward()
    assert relative_error(torch.tensor(result.loss), loss.detach()) < LOSS_RTOL
    assert relative_error(torch.from_numpy(result.grad_hidden), h.grad) < GRAD_RTOL


@pytest.mark.parametrize("mistake,code,field", [
    ("label_out_of_range", "INVALID_ARGUMENT", "labels[3]"),  # refused at the call's start
    ("unknown_head", "NOT_FOUND", None),  # refused before any row is read
])
def test_a_call_over_lanes_fails_as_over_grpc(over_grpc, over_lanes, head, mistake, code, field):
    hidden, labels = random_batch(400)
    labels = labels.numpy()
    name = head.head
    if mistake == "label_out_of_range":
        labels[3] = VOCAB + 7
    else:
        name = "no-such-head"
    errors = []
    for client in (over_grpc, over_lanes):
        with pytest.raises(lossd.LossdError) as error:
            client.compute(name, hidden.numpy(), labels, rows_per_message=50)
        errors.append(error.value)
    assert errors[0].code == errors[1].code == code
    assert errors[0].message == errors[1].message
    assert errors[1].field == field
    # Every lane of the failed call is closed; the next call opens fresh ones.
    result = over_lanes.compute(head.head, hidden.numpy(), random_batch(400)[1].numpy(),
                                rows_per_message=50)
    assert result.loss > 0 and result.attempts == 1


def lanes_frame(key, lanes):
    return frame(pb.FRAME_LANES,
                 pb.ComputeSocketLanes(call_key=key, lanes=lanes).SerializeToString())


def join_frame(key, lane):
    return frame(pb.FRAME_JOIN, pb.ComputeSocketJoin(call_key=key, lane=lane).SerializeToString())


def hello_from(server, client, source="127.0.0.1"):
    sock = socket.create_connection(("127.0.0.1", socket_port(client)), timeout=60,
                                    source_address=(source, 0))
    sock.sendall(frame(pb.FRAME_HELLO, pb.ComputeSocketHello().SerializeToString()))
    assert read_status(sock).code == 0
    return sock


def test_a_raw_call_over_two_lanes_takes_turns(server, over_grpc, head):
    """The framing as lossd.proto gives it, spoken by hand: message m on lane m mod 2, a
    half-close and the status on each lane, and both connections kept for the next call."""
    rows = np.random.default_rng().standard_normal((90, HIDDEN), dtype=np.float32)
    start = pb.ComputeStart(head=head.head, num_tokens=90, hidden_size=HIDDEN,
                            hidden_dtype=pb.DTYPE_FLOAT32, labels=list(range(90)),
                            outputs=pb.OutputSelection(grad_hidden=True))
    expected = over_grpc.compute(head.head, rows, np.arange(90), outputs=["grad_hidden"])
    with hello_from(server, over_grpc) as lane0, hello_from(server, over_grpc) as lane1:
        for _ in range(2):
            key = np.random.default_rng().bytes(24)
            lane1.sendall(join_frame(key, 1))
            lane0.sendall(lanes_frame(key, 2) + frame(pb.FRAME_MESSAGE, _wire.encode_start(start)))
            lane1.sendall(chunk_frame(rows[:40]))
            lane0.sendall(chunk_frame(rows[40:]))
            for lane in (lane0, lane1):
                lane.sendall(frame(pb.FRAME_HALF_CLOSE))
            grad = np.empty_like(rows)
            summary = None
            for r in range(100):
                kind, body = read_frame((lane0, lane1)[r % 2])
                if kind == pb.FRAME_STATUS:
                    assert pb.RpcStatus.FromString(body).code == 0
                    break
                response = _wire.decode_response(memoryview(body))
                if isinstance(response, pb.ComputeSummary):
                    summary = response
                    continue
                chunk = response.message
                grad[chunk.row_offset:chunk.row_offset + chunk.num_rows] = np.frombuffer(
                    response.grad_hidden, np.float32).reshape(chunk.num_rows, HIDDEN)
            # The other lane's copy of the status follows its last message.
            assert read_status((lane0, lane1)[(r + 1) % 2]).code == 0
            assert summary is not None and summary.loss == expected.loss
            assert np.array_equal(grad, expected.grad_hidden)


LANE_MISTAKES = {
    # case -> (frame after a good HELLO, status code, field, or None where the message says)
    "lanes_key_too_short": (lambda: lanes_frame(b"k" * 8, 2), 3, "lanes.call_key"),
    "lanes_key_too_long": (lambda: lanes_frame(b"k" * 65, 2), 3, "lanes.call_key"),
    "one_lane": (lambda: lanes_frame(b"k" * 16, 1), 3, "lanes.lanes"),  # not a spread call
    "nine_lanes": (lambda: lanes_frame(b"k" * 16, 9), 3, "lanes.lanes"),  # past the server's 8
    "join_lane_zero": (lambda: join_frame(b"k" * 16, 0), 3, "join.lane"),  # lane 0 runs the call
    "join_lane_eight": (lambda: join_frame(b"k" * 16, 8), 3, "join.lane"),
    "lanes_that_do_not_parse": (lambda: frame(pb.FRAME_LANES, b"\xff\xff"), 3, "lanes"),
    "join_too_long": (lambda: frame(pb.FRAME_JOIN, b"\0" * 5000), 3, "frame.length"),
    # Waits the stream idle limit for lanes that never come, naming them.
    "lanes_that_never_join": (lambda: lanes_frame(np.random.default_rng().bytes(16), 3), 4,
                              None),
    # Waits the stream idle limit for a call that never claims the lane.
    "join_that_no_call_claims": (lambda: join_frame(np.random.default_rng().bytes(16), 1), 4,
                                 None),
}


@pytest.mark.parametrize("case", LANE_MISTAKES)
def test_a_bad_lane_frame_is_answered_and_closed(server, over_grpc, over_lanes, head, case):
    make, code, field = LANE_MISTAKES[case]
    with hello_from(server, over_grpc) as sock:
        sock.sendall(make())
        status = read_status(sock)
        assert status.code == code, status
        if field is not None:
            assert field_of(status) == field, status
        if case == "lanes_that_never_join":
            assert "lane 1, 2 of 3 did not join" in status.message, status
        assert closed_by_server(sock)
    hidden, labels = random_batch(400)
    assert over_lanes.compute(head.head, hidden.numpy(), labels.numpy(),
                              rows_per_message=50).loss > 0


def test_a_lane_from_another_host_does_not_join(server, over_grpc, head):
    """Lanes meet by key and host: a connection from 127.0.0.2 that presents lane 0's key (from
    127.0.0.1) joins nothing, and lane 0 waits for its own lane until the idle limit."""
    key = np.random.default_rng().bytes(32)
    with hello_from(server, over_grpc) as lane0, \
            hello_from(server, over_grpc, source="127.0.0.2") as stranger:
        stranger.sendall(join_frame(key, 1))
        lane0.sendall(lanes_frame(key, 2))
        for sock, says in ((lane0, "lane 1 of 2 did not join"), (stranger, "no call claimed")):
            status = read_status(sock)
            assert status.code == 4 and says in status.message, status
            assert closed_by_server(sock)


def test_a_lane_joined_twice_is_refused(server, over_grpc, head):
    key = np.random.default_rng().bytes(16)
    with hello_from(server, over_grpc) as first, hello_from(server, over_grpc) as second:
        first.sendall(join_frame(key, 1))
        second.sendall(join_frame(key, 1))
        # One of the two waits for the call; the other is refused at once.
        refused = []
        for sock in (first, second):
            sock.settimeout(IDLE_SECONDS / 2)
            try:
                refused.append(read_status(sock))
            except socket.timeout:
                pass
        assert [status.code for status in refused] == [6], refused
        assert field_of(refused[0]) == "join.lane"


def test_a_lane_that_vanishes_mid_call_leaves_no_gradient(server, over_grpc, over_lanes, head):
    rows = np.random.default_rng().standard_normal((400, HIDDEN), dtype=np.float32)
    key = np.random.default_rng().bytes(16)
    with hello_from(server, over_grpc) as lane0:
        with hello_from(server, over_grpc) as lane1:
            lane1.sendall(join_frame(key, 1))
            lane0.sendall(lanes_frame(key, 2) + start_frame(head.head, 400, accumulate=True))
            lane1.sendall(chunk_frame(rows[:250]))
            time.sleep(0.5)  # the server computes what it has
        # Lane 1 is gone: the call ends, and lane 0 hears why before it closes.
        kinds, _ = frames_until_closed(lane0)
        assert kinds and kinds[-1][0] == pb.FRAME_STATUS
        assert pb.RpcStatus.FromString(kinds[-1][1]).code != 0
    wait_for_no_call_in_flight(server)
    assert not head.fetch_grad_weight().any()
    hidden, labels = random_batch(400)
    assert over_lanes.compute(head.head, hidden.numpy(), labels.numpy(),
                              rows_per_message=50).loss > 0


# --- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("mistake,code,field", [
    ("label_out_of_range", "INVALID_ARGUMENT", "labels[3]"),  # a field-level error from the call
    ("unknown_head", "NOT_FOUND", None),  # refused before any row is read
    ("stale_version", "FAILED_PRECONDITION", "head_version"),  # a typed reason: HEAD_MOVED
])
def test_errors_are_the_same_as_over_grpc(over_grpc, over_socket, head, mistake, code, field):
    hidden, labels = random_batch(40)
    labels = labels.numpy()
    name, kwargs = head.head, {}
    if mistake == "label_out_of_range":
        labels[3] = VOCAB + 7
    elif mistake == "unknown_head":
        name = "no-such-head"
    else:
        kwargs["head_version"] = 12345
    errors = []
    for client in (over_grpc, over_socket):
        with pytest.raises(lossd.LossdError) as error:
            client.compute(name, hidden.numpy(), labels, **kwargs)
        errors.append(error.value)
    assert errors[0].code == errors[1].code == code
    assert errors[0].message == errors[1].message
    assert errors[0].reason == errors[1].reason
    assert errors[1].field == field
    # The connection of a failed call is closed, and the next call gets a fresh one.
    assert over_socket.compute(head.head, hidden.numpy(), random_batch(40)[1].numpy()).loss > 0


def test_a_server_without_the_socket_keeps_auto_on_grpc_and_refuses_true():
    with demo_server(64, 16) as plain:
        with lossd.Client(plain.address, timeout=600) as auto:
            rng = np.random.default_rng()
            result = auto.compute("demo", rng.standard_normal((8, 16), dtype=np.float32),
                                  rng.integers(0, 64, 8), shared_memory=False)
            assert result.loss > 0 and result.transport == "grpc"
            with pytest.raises(lossd.LossdError) as error:
                auto.compute("demo", rng.standard_normal((8, 16), dtype=np.float32),
                             rng.integers(0, 64, 8), shared_memory=False, compute_socket=True)
            assert error.value.code == "FAILED_PRECONDITION"
            assert "--compute_socket_listen" in error.value.message


def test_tls_and_an_explicit_socket_are_refused_together():
    with pytest.raises(ValueError, match="compute_socket: not with tls_root_cert"):
        lossd.Client("127.0.0.1:1", tls_root_cert=b"pem", compute_socket=True)


def test_the_token_is_asked_for_on_the_socket(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    with demo_server(64, 16, "--compute_socket_listen=127.0.0.1:0",
                     f"--token_file={token_file}") as guarded:
        with lossd.Client(guarded.address, token="s3cret", timeout=600,
                          compute_socket=True) as good:
            rng = np.random.default_rng()
            assert good.compute("demo", rng.standard_normal((8, 16), dtype=np.float32),
                                rng.integers(0, 64, 8), shared_memory=False).loss > 0
            for presented in ("", "wrong", "s3cret\n"):
                with raw_connection(guarded, good, token=presented) as sock:
                    status = read_status(sock)
                    assert status.code == 16  # UNAUTHENTICATED
                    assert "hello.token" in status.message
                    assert closed_by_server(sock)
            with raw_connection(guarded, good, token="s3cret") as sock:
                assert read_status(sock).code == 0


# --- hostile peers ------------------------------------------------------------------------------

HOSTILE = {
    # what the peer sends first -> (code, field of the status it gets)
    "bad_magic": (frame(pb.FRAME_HELLO, magic=0x20544547), 3, "frame.magic"),  # "GET " as HTTP
    "message_before_hello": (frame(pb.FRAME_MESSAGE, b"x"), 3, "frame.kind"),
    "hello_too_long": (frame(pb.FRAME_HELLO, length=1 << 40), 8, "frame.length"),  # never sent
    "hello_that_does_not_parse": (frame(pb.FRAME_HELLO, b"\xff\xff\xff"), 3, "hello"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_bad_first_frame_is_answered_and_closed(server, over_grpc, over_socket, head, case):
    sent, code, field = HOSTILE[case]
    with socket.create_connection(("127.0.0.1", socket_port(over_grpc)), timeout=60) as sock:
        sock.sendall(sent)
        status = read_status(sock)
        assert (status.code, field_of(status)) == (code, field), status
        assert closed_by_server(sock)
    hidden, labels = random_batch(20)
    assert over_socket.compute(head.head, hidden.numpy(), labels.numpy()).loss > 0


CALL_MISTAKES = {
    # what follows a good HELLO -> (code, field)
    "oversized_message": (frame(pb.FRAME_MESSAGE, length=1 << 40), 8, "frame.length"),
    "unknown_kind": (frame(77), 3, "frame.kind"),
    "message_that_does_not_parse": (frame(pb.FRAME_MESSAGE, b"\x0a\xff\xff\xff\xff\x0f"), 3,
                                    None),
    "half_close_with_bytes": (frame(pb.FRAME_HALF_CLOSE, b"abc"), 3, "frame.length"),
}


@pytest.mark.parametrize("case", CALL_MISTAKES)
def test_a_bad_frame_in_a_call_is_answered_and_closed(server, over_grpc, over_socket, head, case):
    sent, code, field = CALL_MISTAKES[case]
    with raw_connection(server, over_grpc) as sock:
        assert read_status(sock).code == 0
        sock.sendall(sent)
        status = read_status(sock)
        assert status.code == code, status
        if field is not None:
            assert field_of(status) == field
        assert closed_by_server(sock)
    hidden, labels = random_batch(20)
    assert over_socket.compute(head.head, hidden.numpy(), labels.numpy()).loss > 0


def start_frame(head_name, num_tokens, accumulate):
    start = pb.ComputeStart(head=head_name, num_tokens=num_tokens, hidden_size=HIDDEN,
                            hidden_dtype=pb.DTYPE_FLOAT32,
                            labels=np.random.default_rng().integers(0, VOCAB, num_tokens).tolist(),
                            outputs=pb.OutputSelection(grad_hidden=True,
                                                       accumulate_grad_weight=accumulate),
                            call_id="raw-" + str(time.monotonic_ns()) if accumulate else "")
    return frame(pb.FRAME_MESSAGE, _wire.encode_start(start))


def chunk_frame(rows):
    return frame(pb.FRAME_MESSAGE, _wire.encode_chunk({"hidden": rows}))


def test_a_peer_that_vanishes_mid_call_leaves_no_gradient(server, over_grpc, over_socket, head):
    rows = np.random.default_rng().standard_normal((400, HIDDEN), dtype=np.float32)
    with raw_connection(server, over_grpc) as sock:
        assert read_status(sock).code == 0
        sock.sendall(start_frame(head.head, 400, accumulate=True) + chunk_frame(rows[:250]))
        time.sleep(0.5)  # the server computes what it has
    wait_for_no_call_in_flight(server)
    assert not head.fetch_grad_weight().any()
    hidden, labels = random_batch(20)
    assert over_socket.compute(head.head, hidden.numpy(), labels.numpy()).loss > 0


# Messages above 256 KiB, whose rows the server receives straight into its chunk buffers before
# it checks them: wrong ones are refused by name all the same (or, cut short, leave nothing), no
# gradient is left, and the server goes on serving.
LARGE_ROWS = 1100  # 275 KiB of rows per message


def large_rows(count=LARGE_ROWS):
    return np.random.default_rng().standard_normal((count, HIDDEN), dtype=np.float32)


LARGE_MISTAKES = {
    # case -> (rows the start announces, what follows the start, field named or None: cut short)
    "rows_not_whole": (2000, lambda: frame(pb.FRAME_MESSAGE, _wire.encode_chunk(
        {"hidden": np.concatenate([large_rows().view(np.uint8).ravel(),
                                   np.zeros(4, np.uint8)])})), "chunk.hidden"),
    "more_rows_than_announced": (LARGE_ROWS - 100, lambda: chunk_frame(large_rows()),
                                 "chunk.hidden"),
    "teacher_rows_unasked": (2000, lambda: frame(pb.FRAME_MESSAGE, _wire.encode_chunk(
        {"hidden": large_rows(), "teacher_hidden": large_rows()})), "chunk.teacher_hidden"),
    "cut_short_within_the_rows": (2000, lambda: chunk_frame(large_rows())[:200 << 10], None),
}


@pytest.mark.parametrize("case", LARGE_MISTAKES)
def test_a_large_bad_message_is_refused_and_leaves_nothing(server, over_grpc, over_socket, head,
                                                           case):
    announced, follows, field = LARGE_MISTAKES[case]
    with raw_connection(server, over_grpc) as sock:
        assert read_status(sock).code == 0
        sock.sendall(start_frame(head.head, announced, accumulate=True) + follows())
        if field is not None:
            status = read_status(sock)
            assert status.code == 3 and field_of(status) == field, status
    wait_for_no_call_in_flight(server)
    assert not head.fetch_grad_weight().any()
    hidden, labels = random_batch(20)
    assert over_socket.compute(head.head, hidden.numpy(), labels.numpy()).loss > 0


def test_a_silent_peer_is_ended_by_the_idle_limit(server, over_grpc, over_socket, head):
    started = time.monotonic()
    with raw_connection(server, over_grpc) as sock:
        assert read_status(sock).code == 0
        sock.sendall(start_frame(head.head, 300, accumulate=False) + chunk_frame(
            np.zeros((10, HIDDEN), np.float32)))
        status = read_status(sock)  # no more rows: the call waits IDLE_SECONDS for them
        assert status.code == 4 and "stream idle" in status.message  # DEADLINE_EXCEEDED
        assert closed_by_server(sock)
    assert time.monotonic() - started >= IDLE_SECONDS * 0.9
    # A connection that never sends its HELLO is closed after the same limit.
    with socket.create_connection(("127.0.0.1", socket_port(over_grpc)), timeout=60) as sock:
        assert closed_by_server(sock, within=IDLE_SECONDS * 20)
    hidden, labels = random_batch(20)
    assert over_socket.compute(head.head, hidden.numpy(), labels.numpy()).loss > 0


def test_a_peer_that_reads_nothing_cannot_hold_the_server(server, over_grpc, over_socket, head):
    """A call whose client sends its rows but never reads its results ends once a result has
    waited past the idle limit (the connection is closed: the status cannot pass the message
    stuck before it); meanwhile other calls run."""
    rows = np.random.default_rng().standard_normal((40000, HIDDEN), dtype=np.float32)
    sock = socket.socket()
    # Before connecting, so that the kernel buffers little of what the server sends.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(120)
    sock.connect(("127.0.0.1", socket_port(over_grpc)))
    with sock:
        sock.sendall(frame(pb.FRAME_HELLO, pb.ComputeSocketHello().SerializeToString()))
        assert read_status(sock).code == 0

        def send_rows():
            try:
                sock.sendall(start_frame(head.head, 40000, accumulate=False))
                for r0 in range(0, 40000, 2000):
                    sock.sendall(chunk_frame(rows[r0:r0 + 2000]))
            except OSError:
                pass  # the server gave up on the call and closed

        sender = threading.Thread(target=send_rows, daemon=True)
        sender.start()
        hidden, labels = random_batch(20)
        assert over_socket.compute(head.head, hidden.numpy(), labels.numpy()).loss > 0
        time.sleep(IDLE_SECONDS + 1)
        wait_for_no_call_in_flight(server)
        frames, cut_short = frames_until_closed(sock)
        assert cut_short or any(kind == pb.FRAME_STATUS and pb.RpcStatus.FromString(body).code != 0
                                for kind, body in frames)
        assert not any(kind == pb.FRAME_STATUS and pb.RpcStatus.FromString(body).code == 0
                       for kind, body in frames)
        sender.join(120)
    assert over_socket.compute(head.head, hidden.numpy(), labels.numpy()).loss > 0


def test_a_client_left_to_itself_takes_the_socket(server, head):
    with lossd.Client(server.address, timeout=600) as automatic:
        hidden, labels = random_batch(30)
        result = automatic.compute(head.head, hidden.numpy(), labels.numpy())
        assert result.transport == "compute_socket"


def test_open_connections_are_a_gauge_on_the_metrics(server, head):
    hidden, labels = random_batch(30)
    with lossd.Client(server.address, timeout=600, compute_socket=True) as own:
        own.compute(head.head, hidden.numpy(), labels.numpy())
        # Its kept connection at least (other clients' kept ones may close meanwhile, when idle).
        while_open = server.metric("lossd_compute_socket_connections")
        assert while_open >= 1
    deadline = time.monotonic() + 120
    while server.metric("lossd_compute_socket_connections") > while_open - 1:
        assert time.monotonic() < deadline, "a closed client's connection stayed counted"
        time.sleep(0.05)


def test_a_full_socket_sends_the_call_over_grpc(server, over_grpc, head):
    """One host may hold 64 connections: past them the HELLO is refused (RESOURCE_EXHAUSTED),
    and a client that chose the socket by itself sends its call over gRPC instead of failing; one
    that asked for the socket gets the refusal."""
    held = []
    hidden, labels = random_batch(30)
    try:
        for _ in range(80):
            sock = raw_connection(server, over_grpc)
            held.append(sock)
            status = read_status(sock)
            if status.code != 0:
                assert status.code == 8 and "from one host" in status.message, status
                break
        else:
            pytest.fail("80 connections from one host were all taken")
        with lossd.Client(server.address, timeout=600) as automatic:
            result = automatic.compute(head.head, hidden.numpy(), labels.numpy())
            assert result.transport == "grpc" and result.loss > 0
        with lossd.Client(server.address, timeout=600, compute_socket=True) as insisting:
            with pytest.raises(lossd.LossdError) as error:
                insisting.compute(head.head, hidden.numpy(), labels.numpy())
            assert error.value.code == "RESOURCE_EXHAUSTED"
    finally:
        for sock in held:
            sock.close()
    wait_for_no_call_in_flight(server)
    deadline = time.monotonic() + 120
    while True:
        with lossd.Client(server.address, timeout=600) as again:
            if again.compute(head.head, hidden.numpy(),
                             labels.numpy()).transport == "compute_socket":
                break
        assert time.monotonic() < deadline, "the closed connections were never let go"
        time.sleep(0.1)


def test_an_unreachable_socket_sends_the_call_over_grpc():
    """A socket bound to another address than the one the client reaches gRPC at (a port the
    network does not pass, say): a client that chose it by itself sends its calls over gRPC, and
    does not try it again for a while; one that asked for it gets UNAVAILABLE."""
    with demo_server(64, 16, "--compute_socket_listen=127.0.0.2:0",
                     "--shared_memory=false") as elsewhere:
        rng = np.random.default_rng()
        hidden = rng.standard_normal((8, 16), dtype=np.float32)
        labels = rng.integers(0, 64, 8)
        with lossd.Client(elsewhere.address, timeout=600) as automatic:
            for _ in range(2):
                assert automatic.compute("demo", hidden, labels).transport == "grpc"
            # Marked out of reach: the calls of the next minute try no connection.
            assert automatic._compute_socket._unreachable_until > time.monotonic()
        with lossd.Client(elsewhere.address, timeout=600, compute_socket=True) as insisting:
            with pytest.raises(lossd.LossdError) as error:
                insisting.compute("demo", hidden, labels)
            assert error.value.code == "UNAVAILABLE" and "Compute socket" in error.value.message
