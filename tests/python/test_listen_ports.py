"""A second lossd_server on a port the first holds, against the real binary.

gRPC sets SO_REUSEPORT on its listeners unless told otherwise, so a second server on the same
--listen port used to start, and the kernel then spread new connections over both: clients met two
servers with different heads and gradients, and nothing said so. The second must exit non-zero
naming the flag and the address, for --listen and for --metrics_listen alike, and the first must go
on serving every connection.
"""
import os
import urllib.request

import grpc
import pytest

from server_process import ServerProcess, generate_stubs, run_to_exit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIRST_VOCAB, SECOND_VOCAB = 100, 200


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    generate_stubs(os.path.join(REPO, "proto"), str(tmp_path_factory.mktemp("stubs")))
    from lossd.v1 import lossd_pb2, lossd_pb2_grpc
    return lossd_pb2, lossd_pb2_grpc


@pytest.fixture(scope="module")
def first():
    with ServerProcess("--device=cpu", f"--demo_vocab_size={FIRST_VOCAB}",
                       "--demo_hidden_size=16") as s:
        yield s


def second_server(*flags):
    return run_to_exit("--device=cpu", f"--demo_vocab_size={SECOND_VOCAB}", "--demo_hidden_size=16",
                       *flags)


def vocab_sizes_served(stubs, server, connections=8):
    """The demo head's vocabulary as seen over `connections` fresh connections."""
    pb, pb_grpc = stubs
    sizes = []
    for _ in range(connections):
        # A channel of its own is a connection of its own, and the kernel picks a listener for
        # each connection.
        options = [("grpc.use_local_subchannel_pool", 1)]
        with grpc.insecure_channel(server.address, options=options) as channel:
            stub = pb_grpc.LossServiceStub(channel)
            sizes.append(stub.ListHeads(pb.ListHeadsRequest(), timeout=600).heads[0].vocab_size)
    return sizes


def test_second_server_on_the_grpc_port_exits(first, stubs):
    code, output = second_server(f"--listen={first.address}", "--metrics_listen=127.0.0.1:0")
    assert code not in (0, None), f"a second server started on {first.address}:\n{output}"
    assert f"--listen: {first.address} is in use by another process" in output, output
    assert first.process.poll() is None
    assert vocab_sizes_served(stubs, first) == [FIRST_VOCAB] * 8


def test_second_server_on_the_metrics_port_exits(first, stubs):
    metrics_address = f"127.0.0.1:{first.metrics_port}"
    code, output = second_server("--listen=127.0.0.1:0", f"--metrics_listen={metrics_address}")
    assert code not in (0, None), f"a second server started on {metrics_address}:\n{output}"
    assert f"--metrics_listen: {metrics_address} is in use by another process" in output, output
    assert "null context" not in output, output
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=600) as response:
        assert response.status == 200
        assert "lossd_build_info" in response.read().decode()
    assert vocab_sizes_served(stubs, first) == [FIRST_VOCAB] * 8
