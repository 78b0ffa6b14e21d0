"""Handler failures, against the real lossd_server binary.

The server runs under an address-space limit (RLIMIT_AS, set in the child before it starts), and
a client asks to upload a 65536 x 65536 float32 head: 16 GiB, within --max_head_bytes but far past
what the process may map. The upload must end with RESOURCE_EXHAUSTED naming the weight it could
not allocate, the server must go on serving, count the call with its code and no longer in
flight, and stop on SIGTERM at once rather than wait out --drain_seconds for a call that is gone.
"""
import os
import re
import resource
import time
import urllib.request

import grpc
import pytest

from server_process import ServerProcess, generate_stubs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The server starts in about 1.2 GB of address space (threads' stacks, OpenBLAS buffers).
ADDRESS_SPACE_BYTES = 3 << 30
# Far beyond what a shutdown with nothing in flight takes: one that waited it out would show.
DRAIN_SECONDS = 600


@pytest.fixture(scope="module")
def pb(tmp_path_factory):
    generate_stubs(os.path.join(REPO, "proto"), str(tmp_path_factory.mktemp("stubs")))
    from lossd.v1 import lossd_pb2, lossd_pb2_grpc
    return lossd_pb2, lossd_pb2_grpc


def limit_address_space():
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))


def sample(exposition, name, **labels):
    """The value of the sample of `name` with (at least) `labels` in an exposition; 0 if none."""
    for line in exposition.splitlines():
        match = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if not match or match.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return 0.0


def test_upload_past_the_address_space_is_refused_counted_and_drained_at_once(pb,
                                                                              record_property):
    lossd, lossd_grpc = pb
    flags = ("--device=cpu", "--demo_vocab_size=1000", "--demo_hidden_size=64",
             f"--drain_seconds={DRAIN_SECONDS}")
    with ServerProcess(*flags, preexec_fn=limit_address_space) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = lossd_grpc.LossServiceStub(channel)
            start = lossd.UploadHeadRequest(start=lossd.UploadHeadStart(
                head="huge", vocab_size=65536, hidden_size=65536, dtype=lossd.DTYPE_FLOAT32))
            with pytest.raises(grpc.RpcError) as refused:
                stub.UploadHead(iter([start]), timeout=600)
            details = refused.value.details()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, details
            assert "weight" in details, details
            assert str(65536 * 65536 * 4) in details, details
            heads = stub.ListHeads(lossd.ListHeadsRequest(), timeout=600).heads
            assert [head.name for head in heads] == ["demo"]

        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=600) as response:
            exposition = response.read().decode()
        assert sample(exposition, "lossd_inflight_calls") == 0
        assert sample(exposition, "lossd_requests_total", method="UploadHead",
                      code="RESOURCE_EXHAUSTED") == 1
        assert sample(exposition, "lossd_requests_total", code="UNKNOWN") == 0

        began = time.monotonic()
        assert server.stop() == 0, server.output()
        took = time.monotonic() - began
        record_property("sigterm_seconds", f"{took:.2f}")
        assert took < DRAIN_SECONDS / 2, \
            f"SIGTERM took {took:.1f} s with no call in flight (drain {DRAIN_SECONDS} s)"
