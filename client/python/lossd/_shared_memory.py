"""Shared memory between a client and a server on one host (SharedMemory and HandoverRequest in
lossd.proto): memfds handed over on the server's handover socket for handles, kept in a pool
between calls, and the layout of a call's rows and dL/dh in one.
"""
import collections
import mmap
import os
import threading
import weakref

import numpy as np

from lossd._errors import LossdError, _code_name
from lossd.v1 import lossd_pb2 as pb

# The server's rule for both offsets into a shared-memory call's memfd (SharedMemory in the proto).
_SHARED_MEMORY_ALIGNMENT = 64


# Below this a thread's hand-off costs more than it saves; above it two threads copied 128 MiB in
# 10 ms where one took 14 on a 2-core host (numpy releases the GIL while it copies).
_PARALLEL_COPY_MIN_BYTES = 16 << 20
_MAX_COPY_THREADS = 4
_copy_pool = None
_copy_pool_lock = threading.Lock()


def copy_rows(target, source):
    """np.copyto(target, source) for C-contiguous arrays of one shape, split by rows over a few
    threads when it is large: a shared-memory call's rows go in and its dL/dh comes out while the
    server waits."""
    global _copy_pool
    threads = min(_MAX_COPY_THREADS, os.cpu_count() or 1,
                  max(1, source.nbytes // _PARALLEL_COPY_MIN_BYTES))
    if threads < 2 or source.ndim == 0 or source.shape[0] < threads:
        np.copyto(target, source)
        return
    with _copy_pool_lock:
        if _copy_pool is None:
            from concurrent.futures import ThreadPoolExecutor
            _copy_pool = ThreadPoolExecutor(_MAX_COPY_THREADS, thread_name_prefix="lossd-copy")
    step = -(-source.shape[0] // threads)
    pieces = [_copy_pool.submit(np.copyto, target[r0:r0 + step], source[r0:r0 + step])
              for r0 in range(step, source.shape[0], step)]
    np.copyto(target[:step], source[:step])  # this thread copies the first piece
    for piece in pieces:
        piece.result()


# Where the server says it pays (SharedMemorySocket.rows_follow_pays), rows copied into shared
# memory go after the call's start in pieces of about this size, each announced once it is in
# place (SharedMemory.rows_follow): the server computes its first chunk while the rest are copied.
# Large enough that copy_rows splits each piece over two threads (16 MiB pieces, copied by one,
# measured 5% slower). A server computing on the host's own cores says it does not pay: there
# pieces measured level to 5% slower than copying every row first.
_FOLLOWING_PIECE_BYTES = 32 << 20


class _FollowingRows:
    """The messages of a shared-memory call whose rows follow its start (SharedMemory.rows_follow):
    the start, then for each piece of rows a copy of them into the memfd and a message announcing
    them, into `buffer` from offset 0. gRPC draws the messages on a thread of its own while the
    caller reads results; stop() ends the copying and waits for a piece in progress. A view of the
    buffer lives only while its piece is copied, so that a failed call's buffer closes at once."""

    def __init__(self, buffer, source, piece_rows):
        self._buffer = buffer
        self._source = source
        self._piece_rows = piece_rows
        self._lock = threading.Lock()
        self._stopped = False

    @staticmethod
    def piece_rows(source, connection, asked):
        """Rows per piece: `asked` when the call says (> 0), else pieces of about
        _FOLLOWING_PIECE_BYTES where the server says the overlap pays, else every row in one
        piece (copied before the start)."""
        if asked:
            return asked
        if not connection.rows_follow_pays:
            return max(1, source.shape[0])
        return max(1, _FOLLOWING_PIECE_BYTES // max(1, source[:1].nbytes))

    def messages(self, start_message):
        yield start_message
        rows = self._source.shape[0]
        for r0 in range(0, rows, self._piece_rows):
            r1 = min(rows, r0 + self._piece_rows)
            with self._lock:
                if self._stopped:
                    return
                target = self._buffer.array(0, self._source.dtype, self._source.shape)
                copy_rows(target[r0:r1], self._source[r0:r1])
                del target
            yield pb.ComputeRequest(chunk=pb.ComputeChunk(shared_rows=r1)).SerializeToString()

    def stop(self):
        with self._lock:
            self._stopped = True


class _HandoverConnection:
    """One connection to the server's handover socket (HandoverRequest in lossd.proto), where
    memfds are handed over with SCM_RIGHTS for handles. The handles it registers live as long as
    it does: the server revokes them when it closes."""

    # A reply from a server that is up comes within microseconds; this bounds a hung one.
    _TIMEOUT_SECONDS = 30
    _MAX_REPLY_BYTES = 4096

    def __init__(self, abstract_name, rows_follow_pays=False):
        import socket  # Unix only: imported here so that the client still imports elsewhere
        # What the server said of copying rows while it computes (SharedMemorySocket).
        self.rows_follow_pays = rows_follow_pays
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._socket.settimeout(self._TIMEOUT_SECONDS)
        try:
            self._socket.connect("\0" + abstract_name)
        except OSError as error:
            self._socket.close()
            # The socket lives in the server's network namespace.
            raise LossdError("GetSharedMemorySocket", "UNAVAILABLE",
                             f"cannot connect to the server's handover socket @{abstract_name} "
                             f"(client and server must share a network namespace): "
                             f"{error}") from None
        self._lock = threading.Lock()

    def register(self, fd):
        """Hands the memfd `fd` over; returns its handle."""
        return self._exchange(pb.HandoverRequest(register_memfd=pb.RegisterMemfd()), [fd]).handle

    def release(self, handle):
        self._exchange(pb.HandoverRequest(release_handle=pb.ReleaseHandle(handle=handle)), [])

    def is_open(self):
        """False once the server has closed the connection (it shut down or restarted)."""
        import select
        if self._socket.fileno() < 0:
            return False
        poller = select.poll()
        # The server never speaks first: anything to read is the end of the connection.
        poller.register(self._socket, select.POLLIN | select.POLLRDHUP)
        return not poller.poll(0)

    def close(self):
        self._socket.close()

    def _exchange(self, request, fds):
        import socket
        with self._lock:
            try:
                socket.send_fds(self._socket, [request.SerializeToString()], fds)
                data = self._socket.recv(self._MAX_REPLY_BYTES)
            except OSError as error:
                # A request without its reply would pair the next request with this one's reply:
                # the connection is closed, and the client opens a new one (is_open).
                self._socket.close()
                raise LossdError("handover", "UNAVAILABLE",
                                 f"the server's handover socket: {error}") from None
        if not data:
            self._socket.close()
            raise LossdError("handover", "UNAVAILABLE",
                             "the server closed its handover connection")
        reply = pb.HandoverReply.FromString(data)
        if reply.code != 0:
            raise LossdError("handover", _code_name(reply.code), reply.message)
        return reply


class _SharedBuffer:
    """A memfd that carries a call's rows to a server on this host and its dL/dh back
    (ComputeStart.shared_memory): sealed against shrinking, since the server maps it and a shrunk
    mapping would kill the server, and mapped read-write here. It is handed over once per handover
    connection, and its handle kept for the calls after."""

    def __init__(self, size, name="lossd-rows"):
        if not hasattr(os, "memfd_create"):
            raise OSError("shared_memory: needs memfd_create (Linux)")
        import fcntl  # Unix only: imported here so that the client still imports elsewhere
        # A zero-length mapping is not allowed; a call without rows still names a memfd.
        self.size = max(size, 1)
        # The name is what /proc/<pid>/maps and fd links show ("memfd:<name>").
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self._registered_on = None
        self._handle = None
        self._handle_lock = threading.Lock()  # a shared array's buffer serves concurrent calls
        try:
            os.ftruncate(self.fd, self.size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            self._mapping = mmap.mmap(self.fd, self.size)  # MAP_SHARED, read-write
        except BaseException:
            os.close(self.fd)
            raise

    def handle_on(self, connection):
        """Its handle on `connection`, registering it there first unless it is already."""
        with self._handle_lock:
            if self._registered_on is not connection:
                # A handle on an earlier connection died with it.
                self._registered_on = None
                self._handle = connection.register(self.fd)
                self._registered_on = connection
            return self._handle

    def array(self, offset, dtype, shape):
        """A numpy view of the mapping at offset: valid only until the buffer goes back to its
        pool, so results are copied out of it, never returned as views."""
        count = int(np.prod(shape))
        return np.frombuffer(self._mapping, dtype=dtype, count=count, offset=offset).reshape(shape)

    @property
    def closed(self):
        return self._mapping.closed

    def close(self, release_handle=True):
        # Without it the server would keep the memfd alive until the connection closes.
        if release_handle and self._registered_on is not None and self._registered_on.is_open():
            try:
                self._registered_on.release(self._handle)
            except LossdError:
                pass  # the server let go of it already
        self._registered_on = None
        try:
            self._mapping.close()
        except BufferError:
            pass  # a view still alive (say, in a traceback) keeps it mapped until it goes
        os.close(self.fd)


class _Lease:
    """The owner of an array that lives in a _SharedBuffer. numpy keeps it as the array's base,
    and every view and torch tensor made from the array keeps the array, so the lease ends when
    the last of them goes: then the buffer can serve another call."""

    def __init__(self, buffer, offset, dtype, shape):
        dtype = np.dtype(dtype)
        self.buffer = buffer
        # An export of the mapping, so that it cannot be unmapped while the lease lives.
        self._bytes = np.frombuffer(buffer._mapping, dtype=np.uint8,
                                    count=int(np.prod(shape)) * dtype.itemsize, offset=offset)
        self.__array_interface__ = {"shape": tuple(shape), "typestr": dtype.str, "version": 3,
                                    "data": (self._bytes.ctypes.data, False)}

    @property
    def address(self):
        return self._bytes.ctypes.data

    @property
    def end(self):
        return self.address + self._bytes.nbytes


class _SharedBufferPool:
    """Buffers between calls: a call takes one at least as large as it needs (or a new one) and
    gives it back, so that the pages of a batch's size are allocated once, not on every call.

    A buffer may also be lent out as an array: a call's dL/dh, returned where the server wrote
    it instead of copied out, comes back to the pool once the caller lets go of the array; a
    shared array (Client.shared_array) is a buffer of its own, closed once its array goes.
    Shared by the threads that use one Client."""

    # As many as calls a client typically runs at once; more are closed on release.
    _MAX_IDLE = 4
    # dL/dh arrays lent out at once: beyond them, dL/dh is copied out, so that a caller keeping
    # many results does not hold a memfd (and a server handle) for each.
    _MAX_LENT = 4

    def __init__(self):
        self._lock = threading.Lock()
        self._idle = []
        self._closed = False
        self._lent = 0
        # Buffers whose lease ended, for the next call to take back: a lease ends during garbage
        # collection, which may run on any thread at any point, holding any lock, so its
        # callback only appends (deque.append is atomic) and never waits.
        self._returned = collections.deque()
        self._shared_arrays = []  # (weak reference to the lease, buffer) of each shared array

    def acquire(self, size):
        self._take_back_returned()
        with self._lock:
            # The smallest that fits, so that large buffers stay for large calls.
            fitting = [buffer for buffer in self._idle if buffer.size >= size]
            if fitting:
                best = min(fitting, key=lambda buffer: buffer.size)
                self._idle.remove(best)
                return best
        return _SharedBuffer(size)

    def release(self, buffer):
        with self._lock:
            if self._closed:
                surplus = buffer
            else:
                self._idle.append(buffer)
                surplus = None
                if len(self._idle) > self._MAX_IDLE:
                    # The smallest goes: the calls to come are likeliest to be as large as the
                    # largest seen.
                    surplus = min(self._idle, key=lambda idle: idle.size)
                    self._idle.remove(surplus)
        if surplus is not None:
            surplus.close()

    def lend(self, buffer, offset, dtype, shape):
        """The array [shape] of dtype at `offset` of `buffer`, which comes back to the pool once
        the array and everything made from it are gone; None when _MAX_LENT are out already
        (the caller copies instead, and releases the buffer)."""
        self._take_back_returned()
        with self._lock:
            if self._closed or self._lent >= self._MAX_LENT:
                return None
            self._lent += 1
        return self._lease(buffer, offset, dtype, shape, keep=True)

    # Smaller arrays cost little to allocate afresh, and would hold a lending slot and a memfd.
    _MIN_LENT_ARRAY_BYTES = 4 << 20

    def new_array(self, dtype, shape):
        """An uninitialized array [shape] of dtype for a result that arrives in messages: lent from
        a pooled buffer when it is large (see lend), so that a call's dL/dh lands in pages that
        earlier calls touched already. A fresh array of a batch's dL/dh is a fresh mapping whose
        every page the kernel faults in and zeroes: a fifth of the Python client's time in a
        call that moved 128 MiB each way."""
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if nbytes < self._MIN_LENT_ARRAY_BYTES:
            return np.empty(shape, dtype)
        try:
            buffer = self.acquire(nbytes)
        except OSError:  # no memfd to be had (not Linux, descriptors used up, a sandbox)
            return np.empty(shape, dtype)
        lent = self.lend(buffer, 0, dtype, shape)
        if lent is None:
            self.release(buffer)
            return np.empty(shape, dtype)
        return lent

    def shared_array(self, size, dtype, shape):
        """A new array in a buffer of its own, registered so that find() knows it."""
        self._take_back_returned()
        buffer = _SharedBuffer(size, "lossd-region")
        array = self._lease(buffer, 0, dtype, shape, keep=False)
        with self._lock:
            self._shared_arrays.append((weakref.ref(array.base), buffer))
        return array

    def find(self, array):
        """(buffer, offset) of the shared array holding all of C-contiguous `array`, or None."""
        begin = array.__array_interface__["data"][0]
        end = begin + array.nbytes
        with self._lock:
            for lease_ref, buffer in self._shared_arrays:
                lease = lease_ref()
                if lease is not None and lease.address <= begin and end <= lease.end:
                    return buffer, begin - lease.address
        return None

    def _lease(self, buffer, offset, dtype, shape, keep):
        lease = _Lease(buffer, offset, dtype, shape)
        ended = weakref.finalize(lease, self._lease_ended, buffer, keep)
        ended.atexit = False  # at exit the memfds go with the process
        return np.asarray(lease)

    def _lease_ended(self, buffer, keep):
        # During garbage collection: no lock, no waiting (see _returned).
        if self._closed:
            # The handover connection is closed already: nothing to release on it.
            buffer.close(release_handle=False)
        else:
            self._returned.append((buffer, keep))

    def _take_back_returned(self):
        while True:
            try:
                buffer, keep = self._returned.popleft()
            except IndexError:
                return
            if keep:
                with self._lock:
                    self._lent -= 1
                self.release(buffer)
            else:
                with self._lock:
                    self._shared_arrays = [(ref, kept) for ref, kept in self._shared_arrays
                                           if kept is not buffer]
                buffer.close()

    def close(self):
        self._take_back_returned()
        with self._lock:
            idle, self._idle = self._idle, []
            self._closed = True
        for buffer in idle:
            buffer.close()
        # Any that came back meanwhile.
        while self._returned:
            buffer, _ = self._returned.popleft()
            buffer.close()
