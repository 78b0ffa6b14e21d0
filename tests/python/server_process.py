"""Starts the real lossd_server binary on loopback for tests and stops it afterwards."""
import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

SERVER_BIN = os.environ.get("LOSSD_SERVER_BIN", "build/bin/lossd_server")


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """lossd_server on 127.0.0.1 with free ports, read back from its startup lines."""

    def __init__(self, *flags, metrics=True, timeout=600, preexec_fn=None, wait=True):
        """`preexec_fn` runs in the child before the server starts (to set resource limits).
        wait=False returns at once: wait_until_serving() then waits (replicas of a group start
        serving only once all of them have started). A --listen among flags overrides the free
        port. `timeout` only keeps a server that never starts from hanging the test: a loaded
        machine can take a long while to start one."""
        self.log = tempfile.NamedTemporaryFile(prefix="lossd-server-", suffix=".log", delete=False)
        self.metrics = metrics
        args = [SERVER_BIN, "--listen=127.0.0.1:0",
                "--metrics_listen=" + ("127.0.0.1:0" if metrics else ""), *flags]
        self.process = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                        preexec_fn=preexec_fn)
        self.port = None
        self.metrics_port = None
        if wait:
            self.wait_until_serving(timeout)

    def wait_until_serving(self, timeout=600):
        metrics = self.metrics
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.output()
            grpc_port = re.search(r"serving gRPC on \S+ \(port (\d+)\)", text)
            metrics_port = re.search(r"metrics on \S+ \(port (\d+)\)", text)
            if grpc_port and (metrics_port or not metrics):
                self.port = int(grpc_port.group(1))
                self.metrics_port = int(metrics_port.group(1)) if metrics_port else None
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"lossd_server exited with {self.process.returncode}:\n{text}")
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"lossd_server did not start within {timeout} s:\n{self.output()}")

    @property
    def address(self):
        return f"127.0.0.1:{self.port}"

    def output(self):
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def metric(self, name):
        """The value of an unlabelled metric on /metrics (0 when it is not there)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=600) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        return 0.0

    def stop(self, sig=signal.SIGTERM, timeout=600):
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        os.unlink(self.log.name)


def demo_server(vocab, hidden, *flags, metrics=False, **kwargs):
    """A CPU server whose embedded demo head is [vocab, hidden], with more `flags`."""
    return ServerProcess("--device=cpu", f"--demo_vocab_size={vocab}",
                         f"--demo_hidden_size={hidden}", *flags, metrics=metrics, **kwargs)


def run_to_exit(*flags, timeout=600):
    """Runs lossd_server with `flags` where it is expected to refuse to start: (exit code, output).
    A server that starts instead is stopped and reported as exit code None."""
    process = subprocess.Popen([SERVER_BIN, *flags], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(timeout=timeout)
        return process.returncode, output
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        return None, output


def run_with_terminal_stderr(command, timeout=600, **kwargs):
    """Runs command with stderr on a pseudo-terminal, as when a person watches, and stdout piped:
    (exit code, stdout, what the terminal received)."""
    import pty  # Unix only, as the server is
    controller, terminal = pty.openpty()
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=terminal, **kwargs)
    os.close(terminal)
    received = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: every writer to the terminal has closed it
                break
            if not chunk:
                break
            received += chunk
        stdout, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        os.close(controller)
        if process.poll() is None:
            process.kill()
            process.wait()
    return process.returncode, stdout.decode(), received.decode(errors="replace")


def generate_stubs(proto_root, out_dir):
    """Python stubs of lossd.proto, generated with Debian's protoc and gRPC plugin."""
    subprocess.run(
        ["protoc", f"-I{proto_root}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}",
         "--plugin=protoc-gen-grpc_python=/usr/bin/grpc_python_plugin",
         os.path.join(proto_root, "lossd/v1/lossd.proto")],
        check=True)
    for package in ("lossd", "lossd/v1"):
        open(os.path.join(out_dir, package, "__init__.py"), "a").close()
    sys.path.insert(0, out_dir)


def ensure_python_client():
    """Makes `import lossd` give the Python client: the build tree's package when PYTHONPATH
    holds it (CMake's lossd_python target), else a copy of client/python/lossd with stubs and
    lossd/_version.py generated in a temporary directory."""
    try:
        import lossd.v1.lossd_pb2_grpc  # noqa: F401
        import lossd.client  # noqa: F401
        return
    except ImportError:
        for name in [name for name in sys.modules if name == "lossd" or name.startswith("lossd.")]:
            del sys.modules[name]
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out_dir = tempfile.mkdtemp(prefix="lossd-python-")
    atexit.register(shutil.rmtree, out_dir, True)
    shutil.copytree(os.path.join(repo, "client", "python", "lossd"), os.path.join(out_dir, "lossd"))
    with open(os.path.join(repo, "VERSION"), encoding="utf-8") as f:
        version = f.read().strip()
    with open(os.path.join(out_dir, "lossd", "_version.py"), "w", encoding="utf-8") as f:
        f.write(f'__version__ = "{version}"\n')
    generate_stubs(os.path.join(repo, "proto"), out_dir)
