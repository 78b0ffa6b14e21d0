"""A lossd_server on loopback with a demo head of [16, H] on the CPU and a Compute socket, for the
benchmarks that time the transport of one server (compute is small there)."""
import re
import subprocess
import time


def start(binary, hidden, log, *flags):
    """(the server's process, its gRPC address); `log` an open file its output goes to."""
    server = subprocess.Popen(
        [binary, "--listen=127.0.0.1:0", "--metrics_listen=", "--device=cpu",
         "--demo_vocab_size=16", f"--demo_hidden_size={hidden}",
         "--compute_socket_listen=127.0.0.1:0", *flags], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not (found := re.search(r"serving gRPC on \S+ \(port (\d+)\)", open(log.name).read())):
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise SystemExit(f"lossd_server did not start: {open(log.name).read()[-500:]}")
        time.sleep(0.1)
    return server, f"127.0.0.1:{found.group(1)}"
