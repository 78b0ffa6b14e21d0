"""bench/gpu_service.py run on the CPU with a small head: the engine in-process, then the real
lossd_server called by lossctl and by the Python client with messages (over gRPC and over the
Compute socket) and shared memory, each row
with its time, its ratio to the engine's and its GB/s each way, and a clean exit of the server;
without an importable Python client its rows say why and the others still run."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N, H, V = 512, 64, 1000
# The table's transports, and how the Python client says its rows travelled by each.
TRANSPORTS = {"gRPC messages": "grpc", "socket messages": "compute_socket",
              "shared memory": "shared_memory"}


def run_service(out, python_path):
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "gpu_service.py"), "--device=cpu",
         f"--shape={N},{H},{V}", "--budget-mib=1", "--calls=2", "--warmup=1",
         f"--server={os.environ['LOSSD_SERVER_BIN']}", f"--lossctl={os.environ['LOSSCTL_BIN']}",
         f"--engine-bench={os.environ['ENGINE_BENCH_BIN']}", f"--python-path={python_path}",
         f"--out={out}"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    entries = [json.loads(line) for line in open(out / "results.jsonl")]
    rows = {(e.get("client"), e.get("transport")): e for e in entries}
    return rows, entries[-1], (out / "results.md").read_text()


def test_every_client_and_transport_is_timed_beside_the_engine(tmp_path):
    rows, last, report = run_service(tmp_path, os.environ["LOSSD_PYTHON_DIR"])
    assert rows["engine in-process", None]["seconds"] > 0
    bf16_bytes = N * H * 2
    for client in ("lossctl", "python"):
        for transport in TRANSPORTS:
            row = rows[client, transport]
            assert row["calls"] == 2, row
            assert row["hidden_bytes_per_call"] == bf16_bytes, row
            assert row["grad_hidden_bytes_per_call"] == bf16_bytes, row
            assert row["rows_gbps"] > 0 and row["grad_hidden_gbps"] > 0, row
            assert row["ratio_to_in_process"] > 0, row
            assert row["server_compute_seconds"] > 0, row
    for transport, travelled in TRANSPORTS.items():
        assert rows["python", transport]["travelled"] == travelled
    assert last["server_exit_status"] == 0
    assert "| python | shared memory |" in report
    assert "the server exited with status 0 after SIGTERM" in report


def test_without_the_python_client_its_rows_say_why(tmp_path):
    rows, _, _ = run_service(tmp_path, str(tmp_path / "no-such-folder"))
    for transport in TRANSPORTS:
        assert rows["python", transport]["error"].startswith(
            "skipped: the Python client cannot be imported (No module named 'lossd')")
        assert rows["lossctl", transport]["seconds"] > 0
