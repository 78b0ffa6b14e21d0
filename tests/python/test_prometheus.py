"""A real Prometheus scrapes a real lossd_server; its metrics are then queried through the HTTP API."""
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request

import grpc
import numpy as np
import pytest

from server_process import ServerProcess, free_port, generate_stubs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    generate_stubs(os.path.join(REPO, "proto"), str(tmp_path_factory.mktemp("stubs")))
    from lossd.v1 import lossd_pb2, lossd_pb2_grpc
    return lossd_pb2, lossd_pb2_grpc


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--device=cpu", "--demo_vocab_size=4000", "--demo_hidden_size=64") as s:
        yield s


def compute_once(server, stubs):
    pb, pb_grpc = stubs
    stub = pb_grpc.LossServiceStub(grpc.insecure_channel(server.address))
    rng = np.random.default_rng()
    n, h = 32, 64
    hidden = rng.standard_normal((n, h), dtype=np.float32)
    start = pb.ComputeStart(head="demo", num_tokens=n, hidden_size=h, hidden_dtype=pb.DTYPE_FLOAT32,
                            labels=rng.integers(0, 4000, n).tolist(),
                            outputs=pb.OutputSelection(grad_hidden=True, accumulate_grad_weight=True))
    requests = [pb.ComputeRequest(start=start), pb.ComputeRequest(chunk=pb.ComputeChunk(hidden=hidden.tobytes()))]
    responses = list(stub.Compute(iter(requests)))
    assert responses[-1].HasField("summary")


def scrape(server):
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=600) as r:
        return r.read().decode()


def test_promtool_accepts_the_exposition(server, stubs):
    compute_once(server, stubs)
    text = scrape(server)
    for name in ("lossd_requests_total", "lossd_device_memory_total_bytes", "lossd_memory_bytes",
                 "lossd_compute_seconds_bucket", "lossd_logits_bytes_avoided_total",
                 "lossd_head_version", "lossd_queue_depth", "lossd_inflight_calls",
                 "lossd_host_buffer_bytes"):
        assert name in text, name
    checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def query(port, expr):
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=600) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_prometheus_scrapes_and_queries(server, stubs):
    compute_once(server, stubs)
    work = tempfile.mkdtemp(prefix="lossd-prometheus-")
    config = os.path.join(work, "prometheus.yml")
    with open(config, "w") as f:
        f.write("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: lossd\n"
                f"    static_configs:\n      - targets: ['127.0.0.1:{server.metrics_port}']\n")
    port = free_port()
    prometheus = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={work}/data",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600  # a hang guard: a loaded machine scrapes late
        result = []
        while time.monotonic() < deadline and not result:
            time.sleep(1)
            try:
                result = query(port, 'lossd_requests_total{method="Compute",code="OK"}')
            except OSError:
                continue
        assert result, "Prometheus never returned lossd_requests_total"
        assert float(result[0]["value"][1]) >= 1
        memory = query(port, "lossd_device_memory_total_bytes")
        assert memory and float(memory[0]["value"][1]) > 0
        weights = query(port, 'lossd_memory_bytes{purpose="weights"}')
        assert weights and float(weights[0]["value"][1]) == 4000 * 64 * 4
        # The calls' [32, 64] rows and dL/dh, kept on the host for the next call.
        idle = query(port, 'lossd_host_buffer_bytes{state="idle"}')
        assert idle and float(idle[0]["value"][1]) == 2 * 32 * 64 * 4
        in_use = query(port, 'lossd_host_buffer_bytes{state="in_use"}')
        assert in_use and float(in_use[0]["value"][1]) == 0
        up = query(port, 'up{job="lossd"}')
        assert up and up[0]["value"][1] == "1"
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=600)
        shutil.rmtree(work, ignore_errors=True)


def test_sigterm_drains_and_exits_cleanly(stubs):
    with ServerProcess("--device=cpu", "--demo_vocab_size=500", "--demo_hidden_size=16", metrics=False) as s:
        assert s.stop() == 0
        assert "stopped" in s.output()
