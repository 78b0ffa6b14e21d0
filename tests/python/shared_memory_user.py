"""A client process of test_shared_memory_users.py, run as another user than the test's.

    shared_memory_user.py owner ADDRESS HEAD
        Hands a memfd of its own rows over, checks that its calls through shared memory and
        through messages agree bit for bit, prints {"pid", "fd", "handle", ...} as one JSON line,
        then serves commands from stdin, one per line, each answered with one JSON line:
        "check" (its memfd is as it wrote it; its calls still work), "revoke" (closes its handover
        connection, so the server revokes its handle), "exit".

    shared_memory_user.py hog ADDRESS
        Opens handover connections and registers memfds on them until the server refuses each,
        prints {"connections", "handles", "connection_refused", "handle_refused"} as one JSON
        line, then holds them all until stdin closes.

    shared_memory_user.py intruder ADDRESS HEAD OWNER_JSON
        Tries to get results from, or write dL/dh into, the owner's memfd by every means the
        protocol offers, and prints what each attempt got as one JSON line. Its own memory it
        may use.
"""
import json
import os
import select
import sys

import numpy as np

import lossd
from lossd import _shared_memory, _wire
from lossd._errors import _code_name
from lossd.v1 import lossd_pb2 as pb

ROWS = 8
SENTINEL = 0x5A


def start_message(head, hidden_size, labels, shared_memory_bytes):
    """A training start whose shared_memory is `shared_memory_bytes` as they are: fields the
    current SharedMemory has not (pid = 1, fd = 2) reach the server as unknown fields."""
    start = pb.ComputeStart(
        head=head, num_tokens=len(labels), hidden_size=hidden_size,
        hidden_dtype=pb.DTYPE_FLOAT32, labels=labels,
        outputs=pb.OutputSelection(token_loss=True, logprob=True, grad_hidden=True,
                                   accumulate_grad_weight=True))
    start.shared_memory.MergeFromString(shared_memory_bytes)
    # The unknown fields travel too (after the known ones): the server gets every byte.
    assert len(start.shared_memory.SerializeToString()) == len(shared_memory_bytes)
    return start


def layout_bytes(grad_offset, pid=None, fd=None, handle=None):
    """A SharedMemory's bytes; with pid and fd, those of the earlier protocol's fields 1 and 2
    (int64 pid = 1; int32 fd = 2), which any message with integer fields 1 and 2 writes alike."""
    out = b""
    if pid is not None:
        out += pb.TensorChunk(row_offset=pid, num_rows=fd).SerializeToString()
    return out + pb.SharedMemory(grad_hidden_offset=grad_offset, handle=handle).SerializeToString()


def call(client, start):
    """(status code name, result messages received, error message) of a Compute call."""
    responses = client._call("Compute", iter([_wire.encode_start(start)]))
    results = 0
    try:
        for response in responses:
            results += isinstance(response, _wire.Result)
    except Exception as error:  # grpc.RpcError
        return error.code().name, results, error.details()
    return "OK", results, ""


def memfd_bytes(fd, size):
    return os.pread(fd, size, 0)


def owner(address, head):
    client = lossd.Client(address, timeout=600)
    info = client.get_head(head)
    rng = np.random.default_rng()
    hidden = rng.standard_normal((ROWS, info.hidden_size), dtype=np.float32)
    labels = rng.integers(0, info.vocab_size, ROWS)
    # Its calls through shared memory agree with messages, bit for bit.
    by_messages = client.compute(head, hidden, labels, outputs=["token_loss", "grad_hidden"])
    by_memory = client.compute(head, hidden, labels, outputs=["token_loss", "grad_hidden"],
                               shared_memory=True)
    same = (np.array_equal(by_messages.token_loss, by_memory.token_loss)
            and np.array_equal(by_messages.grad_hidden, by_memory.grad_hidden)
            and by_messages.loss == by_memory.loss)

    # A memfd of its own, registered and kept: its rows, then dL/dh's region, filled with a
    # recognizable byte that nobody else may overwrite.
    rows_bytes = hidden.nbytes
    grad_offset = -(-rows_bytes // 64) * 64
    buffer = _shared_memory._SharedBuffer(grad_offset + rows_bytes)
    buffer.array(0, np.float32, hidden.shape)[:] = hidden
    buffer.array(grad_offset, np.uint8, (rows_bytes,))[:] = SENTINEL
    handover = client._handover_connection()
    handle = buffer.handle_on(handover)
    expected = memfd_bytes(buffer.fd, buffer.size)
    print(json.dumps({"pid": os.getpid(), "fd": buffer.fd, "handle": handle.hex(),
                      "grad_offset": grad_offset, "labels": labels.tolist(),
                      "shared_matches_messages": bool(same)}), flush=True)

    for command in sys.stdin:
        command = command.strip()
        if command == "check":
            again = client.compute(head, hidden, labels, outputs=["token_loss"],
                                   shared_memory=True)
            print(json.dumps({
                "memfd_unchanged": memfd_bytes(buffer.fd, buffer.size) == expected,
                "calls_still_work": bool(np.array_equal(again.token_loss,
                                                        by_messages.token_loss))}), flush=True)
        elif command == "revoke":
            handover.close()
            print(json.dumps({"revoked": True}), flush=True)
        elif command == "exit":
            break
    buffer.close()
    client.close()


def intruder(address, head, owner_json):
    victim = json.loads(owner_json)
    client = lossd.Client(address, timeout=600)
    info = client.get_head(head)
    labels = victim["labels"]
    grad_offset = victim["grad_offset"]
    outcome = {}

    # The kernel keeps another user's descriptors to themselves.
    try:
        os.close(os.open(f"/proc/{victim['pid']}/fd/{victim['fd']}", os.O_RDONLY))
        outcome["open_proc_fd"] = "opened"
    except OSError as error:
        outcome["open_proc_fd"] = type(error).__name__

    def attempt(name, shared_memory_bytes):
        outcome[name] = call(client, start_message(head, info.hidden_size, labels,
                                                   shared_memory_bytes))

    # The old protocol's fields, naming the owner's memfd.
    attempt("pid_and_fd", layout_bytes(grad_offset, pid=victim["pid"], fd=victim["fd"]))
    # Guessed handles.
    attempt("random_handle", layout_bytes(grad_offset, handle=os.urandom(16)))
    attempt("zero_handle", layout_bytes(grad_offset, handle=bytes(16)))
    attempt("short_handle", layout_bytes(grad_offset, handle=os.urandom(15)))
    if victim.get("revoked_handle"):
        # The owner's handle, once its connection has closed.
        attempt("revoked_handle",
                layout_bytes(grad_offset, handle=bytes.fromhex(victim["revoked_handle"])))
        # Registered anew by this process: still not the owner's.
        handover = client._handover_connection()
        try:
            handover.release(bytes.fromhex(victim["revoked_handle"]))
            outcome["release_revoked_handle"] = "OK"
        except lossd.LossdError as error:
            outcome["release_revoked_handle"] = error.code

    # Its own memory, with the old fields naming the owner's memfd beside its own handle: the
    # server computes on the intruder's rows, which the intruder can check.
    rng = np.random.default_rng()
    own = rng.standard_normal((len(labels), info.hidden_size), dtype=np.float32)
    rows_bytes = own.nbytes
    buffer = _shared_memory._SharedBuffer(grad_offset + rows_bytes)
    buffer.array(0, np.float32, own.shape)[:] = own
    own_handle = buffer.handle_on(client._handover_connection())
    start = start_message(head, info.hidden_size, labels,
                          layout_bytes(grad_offset, pid=victim["pid"], fd=victim["fd"],
                                       handle=own_handle))
    responses = list(client._responses("Compute", client._call(
        "Compute", iter([_wire.encode_start(start)]))))
    token_loss = np.concatenate([np.array(r.message.token_loss, dtype=np.float32)
                                 for r in responses if isinstance(r, _wire.Result)])
    expected = client.compute(head, own, labels, outputs=["token_loss", "grad_hidden"])
    outcome["own_memory_with_pid_and_fd"] = {
        "rows_were_its_own": bool(np.array_equal(token_loss, expected.token_loss)),
        "grad_hidden_in_its_own_memfd": bool(np.array_equal(
            buffer.array(grad_offset, np.float32, own.shape), expected.grad_hidden)),
    }
    # And the client's own path, as a user of another user than the server's.
    by_memory = client.compute(head, own, labels, outputs=["token_loss", "grad_hidden"],
                               shared_memory=True)
    outcome["own_calls_match_messages"] = bool(
        np.array_equal(by_memory.token_loss, expected.token_loss)
        and np.array_equal(by_memory.grad_hidden, expected.grad_hidden))
    buffer.close()
    client.close()
    print(json.dumps(outcome), flush=True)


def memfd():
    """A one-page memfd sealed as the server expects."""
    import fcntl
    fd = os.memfd_create("lossd-hog", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def hog(address):
    client = lossd.Client(address, timeout=600)
    socket_name = client._unary("GetSharedMemorySocket",
                                pb.GetSharedMemorySocketRequest()).abstract_name
    connections, fds = [], []
    outcome = {"handles": 0, "connection_refused": None, "handle_refused": None}
    while len(connections) < 64:
        connection = _shared_memory._HandoverConnection(socket_name)
        # A refused connection is told so and closed at once (the server never speaks first to one
        # it keeps); a request sent before the refusal is read would make the close a reset,
        # which loses the refusal's text.
        if select.select([connection._socket], [], [], 0.5)[0]:
            reply = pb.HandoverReply.FromString(connection._socket.recv(4096))
            outcome["connection_refused"] = [_code_name(reply.code), reply.message]
            connection.close()
            break
        fds.append(memfd())
        try:
            connection.register(fds[-1])
        except lossd.LossdError as error:
            outcome["connection_refused"] = [error.code, str(error)]
            connection.close()
            break
        connections.append(connection)
        outcome["handles"] += 1
    # Handles on every connection, until the server takes no more from this user.
    for connection in connections:
        while outcome["handle_refused"] is None and outcome["handles"] < 1024:
            fds.append(memfd())
            try:
                connection.register(fds[-1])
            except lossd.LossdError as error:
                if "per connection" not in str(error):
                    outcome["handle_refused"] = [error.code, str(error)]
                break
            outcome["handles"] += 1
    outcome["connections"] = len(connections)
    print(json.dumps(outcome), flush=True)
    sys.stdin.read()
    for connection in connections:
        connection.close()


if __name__ == "__main__":
    if sys.argv[1] == "owner":
        owner(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "hog":
        hog(sys.argv[2])
    else:
        intruder(sys.argv[2], sys.argv[3], sys.argv[4])
