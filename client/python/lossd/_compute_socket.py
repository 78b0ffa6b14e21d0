"""Compute calls over the server's Compute socket (ComputeSocket in lossd.proto): the call's own
messages, framed on a plain TCP connection instead of gRPC's HTTP/2 streams, which moved rows at
about a third of what the same connection carries.

A call's rows leave from the caller's array (sendmsg of views, no join into one message) on a
thread of their own while the calling thread reads the results as they come, so both directions
of the connection are busy at once; each large result's dL/dh is received straight into the rows
of the array the call returns. Connections are kept between calls (one per call in flight),
and one that has sat idle may have been closed by the server meanwhile: a call that finds its kept
connection closed before any answer came is sent again on a fresh one.

A call may spread over several connections (its lanes, ComputeSocketLanes in lossd.proto) for a
network where one TCP flow cannot carry what the link does: message m travels on lane m mod
lanes both ways, each lane sent on by a thread of its own and read one message ahead by another,
and the results are taken in turn.
"""
import os
import socket
import struct
import threading
import time

import numpy as np

from lossd import _wire
from lossd._errors import LossdError, from_rpc_status
from lossd.v1 import lossd_pb2 as pb

_MAGIC = 0x3153434C  # "LCS1" in little-endian byte order
_HEADER = struct.Struct("<IIQ")
_MAX_STATUS_BYTES = 1 << 20
_MAX_IDLE_CONNECTIONS = 8
# A result message at least this long has its dL/dh received straight into the array the call
# returns, found from its first _HEAD_BYTES (the server writes a result's small fields first): the
# copy out of the connection's buffer took an eighth of the client's time in a call of 128 MiB
# each way.
_PLACED_MIN_BYTES = 256 << 10
_HEAD_BYTES = 64 << 10
# A connection that does not open within this is not worth holding a call for: a port the network
# drops would otherwise take the call's whole timeout.
_CONNECT_SECONDS = 10
# After the socket could not be reached, calls go another way for this long before it is tried
# again.
_UNREACHABLE_SECONDS = 60
# A call's lanes (the server takes 2 to 8, lane 0 counted) meet under a key of this many random
# bytes (16 to 64).
MAX_LANES = 8
_CALL_KEY_BYTES = 32


def _nowhere(result, nbytes):
    return None


class SocketUnusable(LossdError):
    """The Compute socket cannot take the call, which did not begin there: it holds as many
    connections as it takes (its HELLO answered RESOURCE_EXHAUSTED), or it cannot be reached (a
    port the network does not pass, say)."""


class _Unreachable(Exception):
    """No connection could be opened."""


class _ConnectionLost(Exception):
    """The connection closed or broke; `answered` says whether any frame of the call had come."""

    def __init__(self, message, answered):
        super().__init__(message)
        self.answered = answered


class _Connection:
    def __init__(self, address, token, timeout, max_message_bytes):
        self.address = address
        self.max_message_bytes = max_message_bytes
        # Frames are read into this, grown as needed and kept: a fresh buffer per message would
        # be zeroed and faulted in again for every few megabytes of dL/dh.
        self._buffer = np.empty(0, np.uint8)
        connect_timeout = _CONNECT_SECONDS if timeout is None else min(timeout, _CONNECT_SECONDS)
        try:
            self.sock = socket.create_connection(address, timeout=connect_timeout)
        except OSError as error:
            raise _Unreachable(str(error)) from None
        try:
            self.sock.settimeout(timeout)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.send_frame(pb.FRAME_HELLO,
                            [pb.ComputeSocketHello(token=token or "").SerializeToString()])
            kind, body = self.read_frame(answered=False)
            if kind != pb.FRAME_STATUS:
                raise _ConnectionLost(f"the server answered its HELLO with frame kind {kind}",
                                      answered=False)
            status = pb.RpcStatus.FromString(bytes(body))
            if status.code != 0:
                error = from_rpc_status("Compute", status)
                if error.code == "RESOURCE_EXHAUSTED":
                    raise SocketUnusable("Compute", error.code, error.message)
                raise error
        except BaseException:
            self.sock.close()
            raise

    def send_frame(self, kind, parts):
        views = [view for view in (memoryview(part).cast("B") for part in parts) if view.nbytes]
        total = sum(view.nbytes for view in views)
        views.insert(0, memoryview(_HEADER.pack(_MAGIC, kind, total)))
        while views:
            sent = self.sock.sendmsg(views)
            while sent:
                if sent >= views[0].nbytes:
                    sent -= views[0].nbytes
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    def _read_into(self, view, answered):
        while view.nbytes:
            got = self.sock.recv_into(view)
            if got == 0:
                raise _ConnectionLost("the server closed the connection", answered)
            view = view[got:]

    def read_frame(self, answered):
        """(kind, body) of the next frame; body a memoryview of the connection's buffer, valid
        until the next read."""
        header = bytearray(_HEADER.size)
        self._read_into(memoryview(header), answered)
        kind, length = self._check_header(header)
        return kind, self._read_body(length)

    def _check_header(self, header):
        magic, kind, length = _HEADER.unpack(header)
        if magic != _MAGIC:
            raise _ConnectionLost(f"a frame with magic {magic:#010x}, not a Compute socket's",
                                  answered=True)
        limit = _MAX_STATUS_BYTES if kind == pb.FRAME_STATUS else self.max_message_bytes
        if length > limit:
            raise _ConnectionLost(f"a frame of {length} bytes, above the client's limit of "
                                  f"{limit}", answered=True)
        return kind, length

    def _body(self, length):
        if length > self._buffer.nbytes:
            self._buffer = np.empty(length, np.uint8)
        return memoryview(self._buffer)[:length]

    def _read_body(self, length):
        body = self._body(length)
        self._read_into(body, True)
        return body

    def read_response(self, answered, place):
        """(kind, body) of the next frame as read_frame gives it, except that a FRAME_MESSAGE
        comes decoded (pb.ComputeSummary or _wire.Result); a result's dL/dh goes straight
        where place(result without it, its byte count) says, a writable byte view (None: into
        the connection's buffer, as any other field)."""
        header = bytearray(_HEADER.size)
        self._read_into(memoryview(header), answered)
        kind, length = self._check_header(header)
        if kind != pb.FRAME_MESSAGE:
            return kind, self._read_body(length)
        if length < _PLACED_MIN_BYTES:
            return kind, _wire.decode_response(self._read_body(length))
        body = self._body(length)
        head = min(length, _HEAD_BYTES)
        self._read_into(body[:head], True)
        split = _wire.split_result(body[:head], length)
        target = None if split is None else place(split[0], length - split[1])
        if target is None:
            self._read_into(body[head:], True)
            return kind, _wire.decode_response(body)
        message, start = split
        arrived = head - start
        target[:arrived] = body[start:head]
        self._read_into(target[arrived:], True)
        return kind, _wire.Result(message, None, placed=True)

    def closed_by_peer(self):
        """Whether the server has closed this (idle) connection: its end is readable now."""
        timeout = self.sock.gettimeout()
        # Non-blocking for the peek: with a timeout Python would wait for bytes first.
        self.sock.setblocking(False)
        try:
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        finally:
            self.sock.settimeout(timeout)

    def close(self):
        try:
            # Wakes a thread that sends on it (close alone would not).
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class ComputeSocket:
    """The Compute socket of one server at (host, port)."""

    def __init__(self, host, port, token, timeout, max_message_bytes):
        self.address = (host, port)
        self._token = token
        self._timeout = timeout
        self._max_message_bytes = max_message_bytes
        self._idle = []
        self._lock = threading.Lock()
        self._unreachable_until = 0.0  # time.monotonic() before which no connection is tried

    def close(self):
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def _connect(self):
        if time.monotonic() < self._unreachable_until:
            raise SocketUnusable("Compute", "UNAVAILABLE",
                                 f"the Compute socket at {self._where()} could not be reached "
                                 f"lately")
        try:
            return _Connection(self.address, self._token, self._timeout, self._max_message_bytes)
        except LossdError:
            raise
        except _Unreachable as error:
            self._unreachable_until = time.monotonic() + _UNREACHABLE_SECONDS
            raise SocketUnusable("Compute", "UNAVAILABLE",
                                 f"cannot reach the Compute socket at {self._where()}: "
                                 f"{error}") from None
        except (socket.timeout, TimeoutError):
            raise LossdError("Compute", "DEADLINE_EXCEEDED",
                             f"no answer from the Compute socket at {self._where()} within "
                             f"{self._timeout} s") from None
        except (OSError, _ConnectionLost) as error:
            raise LossdError("Compute", "UNAVAILABLE",
                             f"cannot reach the Compute socket at {self._where()}: {error}") from None

    def _where(self):
        host, port = self.address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def responses(self, make_frames, place=None, lanes=1):
        """The call's responses (pb.ComputeSummary and _wire.Result) as they arrive, the frames
        of make_frames() (each a list of bytes-like pieces of one ComputeRequest) sent meanwhile
        over `lanes` connections; raises LossdError as the same call over gRPC would.
        place(result, nbytes): where a result's dL/dh goes, if it can go there straight
        (_Connection.read_response)."""
        with self._lock:
            kept = [self._idle.pop() for _ in range(min(lanes, len(self._idle)))]
        # Those the server closed while they sat idle are no use: a lane among them would keep
        # the call waiting for it to join.
        for connection in [c for c in kept if c.closed_by_peer()]:
            kept.remove(connection)
            connection.close()
        if kept:
            try:
                yield from self._call(self._connect_more(kept, lanes), make_frames, place)
                return
            except _ConnectionLost as lost:
                if lost.answered:
                    raise self._lost_error(lost) from None
                # A kept one was closed while it sat idle: the server saw no call.
        try:
            yield from self._call(self._connect_more([], lanes), make_frames, place)
        except _ConnectionLost as lost:
            raise self._lost_error(lost) from None

    def _connect_more(self, connections, count):
        """`connections` with fresh ones added up to `count`; all closed if one cannot open."""
        try:
            while len(connections) < count:
                connections.append(self._connect())
            return connections
        except BaseException:
            for connection in connections:
                connection.close()
            raise

    def _lost_error(self, lost):
        return LossdError("Compute", "UNAVAILABLE",
                          f"the connection to the Compute socket at {self._where()} ended "
                          f"mid-call: {lost}")

    def _call(self, connections, make_frames, place):
        lanes = len(connections)
        turns = _Turns(make_frames(), lanes)
        send_errors = []

        def send(lane):
            connection = connections[lane]
            try:
                while (parts := turns.take(lane)) is not None:
                    connection.send_frame(pb.FRAME_MESSAGE, parts)
                if turns.finished:
                    connection.send_frame(pb.FRAME_HALF_CLOSE, [])
            except BaseException as error:  # the reader reports the call's end
                send_errors.append(error)
                turns.stop()

        senders = [threading.Thread(target=send, args=(lane,), daemon=True,
                                    name=f"lossd-compute-socket-send-{lane}")
                   for lane in range(lanes)]
        started = time.monotonic()
        deadline = None if self._timeout is None else started + self._timeout
        readers = None if lanes == 1 else _LaneReaders(
            connections, lambda connection, answered: self._read(connection, answered, place,
                                                                 started, deadline))
        reusable = False
        answered = False
        try:
            for connection in connections:
                # A kept one may hold a call's last remainder.
                connection.sock.settimeout(self._timeout)
            if lanes > 1:
                key = os.urandom(_CALL_KEY_BYTES)
                connections[0].send_frame(pb.FRAME_LANES, [pb.ComputeSocketLanes(
                    call_key=key, lanes=lanes).SerializeToString()])
                for lane, connection in enumerate(connections[1:], start=1):
                    connection.send_frame(pb.FRAME_JOIN, [pb.ComputeSocketJoin(
                        call_key=key, lane=lane).SerializeToString()])
                readers.start()
            for sender in senders:
                sender.start()
            read = 0  # the server's message r comes on lane r mod lanes, its status on each
            while True:
                lane = read % lanes
                if readers is None:
                    kind, body = self._read(connections[0], answered, place, started, deadline)
                else:
                    kind, body = readers.next_frame(lane)
                if kind == pb.FRAME_MESSAGE:
                    answered = True
                    read += 1
                    yield body
                    if readers is not None:
                        readers.read_on(lane)  # the body is used: its buffer may take the next
                elif kind == pb.FRAME_STATUS:
                    status = pb.RpcStatus.FromString(bytes(body))
                    if status.code != 0:
                        raise from_rpc_status("Compute", status)
                    break
                else:
                    raise _ConnectionLost(f"a frame of kind {kind} from the server", True)
            for other in range(1, lanes):
                # The same status on every other lane: read, so that each is clean for reuse.
                kind, _ = readers.next_frame((read + other) % lanes)
                if kind != pb.FRAME_STATUS:
                    raise _ConnectionLost(f"a frame of kind {kind} after the call's status",
                                          True)
            for sender in senders:
                sender.join()
            if send_errors:
                raise _ConnectionLost(f"sending failed: {send_errors[0]}", answered=True)
            reusable = True
        finally:
            turns.stop()
            if readers is not None:
                readers.stop()
            if reusable:
                with self._lock:
                    while connections and len(self._idle) < _MAX_IDLE_CONNECTIONS:
                        self._idle.append(connections.pop())
            for connection in connections:
                connection.close()
            for thread in senders + ([] if readers is None else readers.threads):
                if thread.ident is not None:
                    thread.join()

    def _read(self, connection, answered, place, started, deadline):
        """The next frame on `connection` (_Connection.read_response), within the call's
        deadline."""
        if deadline is not None:
            # The whole call within the client's timeout, as a gRPC deadline bounds it.
            connection.sock.settimeout(max(1e-3, deadline - time.monotonic()))
        try:
            return connection.read_response(answered, place or _nowhere)
        except (socket.timeout, TimeoutError):
            raise LossdError("Compute", "DEADLINE_EXCEEDED",
                             f"the call took more than {self._timeout} s "
                             f"({time.monotonic() - started:.1f} s)") from None
        except OSError as error:
            raise _ConnectionLost(str(error), answered) from None


class _LaneReaders:
    """A thread per lane that reads the lane's next frame ahead of the caller, so that every
    lane's bytes keep arriving while the caller takes another lane's frame. A frame's body lies
    in its connection's buffer, so a lane reads its next frame only once the caller is done with
    the last one (read_on)."""

    def __init__(self, connections, read):
        self._read = read  # read(connection, answered) -> (kind, body)
        self._connections = connections
        self._frames = [None] * len(connections)  # (kind, body) or the read's exception
        self._go = [True] * len(connections)
        self._stopped = False
        self._answered = False
        self._changed = threading.Condition()
        self.threads = [threading.Thread(target=self._run, args=(lane,), daemon=True,
                                         name=f"lossd-compute-socket-read-{lane}")
                        for lane in range(len(connections))]

    def start(self):
        for thread in self.threads:
            thread.start()

    def _run(self, lane):
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._stopped or self._go[lane])
                if self._stopped:
                    return
                self._go[lane] = False
                answered = self._answered
            try:
                frame = self._read(self._connections[lane], answered)
            except BaseException as error:
                frame = error
            with self._changed:
                self._frames[lane] = frame
                self._changed.notify_all()
                if isinstance(frame, BaseException) or frame[0] != pb.FRAME_MESSAGE:
                    return  # a lane's status (or failure) is its last frame of the call

    def next_frame(self, lane):
        """The lane's next frame, (kind, body), once read; raises what reading it raised, or
        what reading another lane raised first (a lane that broke would leave the call waiting
        on the others)."""
        with self._changed:
            self._changed.wait_for(lambda: self._frames[lane] is not None or any(
                isinstance(frame, BaseException) for frame in self._frames))
            if self._frames[lane] is None:
                raise next(frame for frame in self._frames if isinstance(frame, BaseException))
            frame, self._frames[lane] = self._frames[lane], None
            if not isinstance(frame, BaseException) and frame[0] == pb.FRAME_MESSAGE:
                self._answered = True
        if isinstance(frame, BaseException):
            raise frame
        return frame

    def read_on(self, lane):
        with self._changed:
            self._go[lane] = True
            self._changed.notify_all()

    def stop(self):
        """Ends the threads once their reads end (closing the connections ends those)."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()


class _Turns:
    """A call's messages handed to its lanes' senders in order: message m to lane m mod lanes.
    A sender takes its next message once the one before it has been taken (not sent), so the
    lanes send at once."""

    def __init__(self, messages, lanes):
        self._messages = iter(messages)
        self._lanes = lanes
        self._next = 0
        self._over = False
        self.finished = False  # every message was taken: the lanes may half-close
        self._changed = threading.Condition()

    def take(self, lane):
        """The lane's next message (a list of parts), or None once there are no more (or the
        call has stopped)."""
        with self._changed:
            self._changed.wait_for(lambda: self._over or self._next % self._lanes == lane)
            if self._over:
                return None
            try:
                parts = next(self._messages)
            except StopIteration:
                self.finished = self._over = True
                self._changed.notify_all()
                return None
            except BaseException:
                self._over = True
                self._changed.notify_all()
                raise
            self._next += 1
            self._changed.notify_all()
            return parts

    def stop(self):
        with self._changed:
            self._over = True
            self._changed.notify_all()
