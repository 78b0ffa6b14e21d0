"""A lossd_server on loopback with a demo head of [16, H] on the CPU and a Compute socket, for the
benchmarks that time the transport of one server (compute is small there)."""
import contextlib
import re
import subprocess
import tempfile
import time


@contextlib.contextmanager
def running(binary, hidden, *flags):
    """(the server's process, its gRPC address) while the block runs; the server stopped after."""
    with tempfile.NamedTemporaryFile(prefix="lossd-bench-", suffix=".log") as log:
        server = subprocess.Popen(
            [binary, "--listen=127.0.0.1:0", "--metrics_listen=", "--device=cpu",
             "--demo_vocab_size=16", f"--demo_hidden_size={hidden}",
             "--compute_socket_listen=127.0.0.1:0", *flags],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while not (found := re.search(r"serving gRPC on \S+ \(port (\d+)\)",
                                          open(log.name).read())):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"lossd_server did not start: {open(log.name).read()[-500:]}")
                time.sleep(0.1)
            yield server, f"127.0.0.1:{found.group(1)}"
        finally:
            server.terminate()
            server.wait()


