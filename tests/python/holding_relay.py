"""A TCP relay on loopback between clients and a server that can hold back what the server sends
(tests/holding_relay.h is its C++ twin). With it a test loses a call's answer after the server has
committed the call: the server computes, commits and answers, and the client hears nothing until
its deadline passes."""
import socket
import threading


class HoldingRelay:
    """Listens on 127.0.0.1:port and relays every connection to the server's port."""

    def __init__(self, server_port):
        self._server_port = server_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._released = threading.Event()
        self._released.set()
        self._lock = threading.Lock()
        self._sockets = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def address(self):
        return f"127.0.0.1:{self.port}"

    def hold(self):
        """From now on bytes from the server wait in the relay; bytes to it still flow."""
        self._released.clear()

    def release(self):
        """Delivers what waited, in order, and stops holding."""
        self._released.set()

    def drop(self):
        """Breaks every connection made so far, dropping what waited: the client sees the
        connection fail (UNAVAILABLE) without the answer. New connections are relayed, unheld.
        With hold, a test that waits for the server to commit before it drops loses the answer
        for sure, however long the call takes, where a client deadline would race the call."""
        with self._lock:
            for sock in self._sockets:
                _shutdown(sock, socket.SHUT_RDWR)  # first: a released pump delivers nothing more
        self._released.set()

    def close(self):
        self._released.set()
        # Wakes the blocked accept and every blocked recv.
        self._listener.shutdown(socket.SHUT_RDWR)
        with self._lock:
            for sock in self._sockets:
                _shutdown(sock, socket.SHUT_RDWR)
        for thread in list(self._threads):
            thread.join()
        self._listener.close()
        for sock in self._sockets:
            sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _accept(self):
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(("127.0.0.1", self._server_port))
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pumps = [threading.Thread(target=self._pump, args=(client, server, False), daemon=True),
                     threading.Thread(target=self._pump, args=(server, client, True), daemon=True)]
            with self._lock:
                self._sockets += [client, server]
                self._threads += pumps
            for pump in pumps:
                pump.start()

    def _pump(self, source, target, from_server):
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                break
            if not data:
                break
            if from_server:
                self._released.wait()
            try:
                target.sendall(data)
            except OSError:
                break
        _shutdown(target, socket.SHUT_WR)


def _shutdown(sock, how):
    try:
        sock.shutdown(how)
    except OSError:
        pass  # already closed or never connected
