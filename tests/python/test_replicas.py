"""Scoring over replicas of one head with the Python client, against real lossd_server processes.

Three servers serve the demo head of one seed (the same W on each) and a fourth another seed's:
a client whose target lists the three spreads its calls over all of them (each server's own
request counter, from its /metrics, says how many it served) with the results one server gives;
a replica killed (SIGKILL) or drained (SIGTERM) mid-run costs no call; a client pinned to W's
SHA-256 is refused by the server with the other W; training refuses a target that lists several
servers, and trainer ranks map onto the servers of a training replica group. Results are checked
against torch's float64 log-softmax of W fetched from a replica.
"""
import hashlib
import os
import re
import signal
import tempfile
import threading
import time
import urllib.request

import numpy as np
import pytest
import grpc
import torch

from server_process import ServerProcess, ensure_python_client, run_to_exit

ensure_python_client()
import lossd  # noqa: E402
from lossd.torch import RemoteHead  # noqa: E402
from lossd.v1 import lossd_pb2 as pb  # noqa: E402

VOCAB, HIDDEN = 3001, 64
SEED, OTHER_SEED = 7, 8


def start_server(seed, *flags):
    return ServerProcess("--device=cpu", f"--demo_vocab_size={VOCAB}",
                         f"--demo_hidden_size={HIDDEN}", f"--demo_seed={seed}",
                         "--workspace_budget_mib=1", *flags)


@pytest.fixture
def replicas():
    servers = [start_server(SEED) for _ in range(3)]
    yield servers
    for server in servers:  # all at once: each takes seconds to close its metrics endpoint
        if server.process.poll() is None:
            server.process.send_signal(signal.SIGTERM)
    for server in servers:
        server.__exit__(None, None, None)


@pytest.fixture(scope="module")
def other():
    with start_server(OTHER_SEED) as server:
        yield server


def target(servers):
    return "ipv4:" + ",".join(server.address for server in servers)


def served_with(server, method, code):
    """Calls of `method` the server ended with `code`, from its /metrics; None once it is gone."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                    timeout=600) as response:
            text = response.read().decode()
    except OSError:
        return None
    total = 0.0
    for labels, value in re.findall(r'^lossd_requests_total\{([^}]*)\} (\S+)$', text, re.M):
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if pairs.get("method") == method and pairs.get("code") == code:
            total += float(value)
    return int(total)


def served(server, method="Compute"):
    """Calls of `method` the server answered OK."""
    return served_with(server, method, "OK")


def in_flight(server):
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                timeout=600) as response:
        text = response.read().decode()
    return float(re.search(r"^lossd_inflight_calls (\S+)$", text, re.M).group(1))


def batch(rows, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, HIDDEN), dtype=np.float32),
            rng.integers(0, VOCAB, rows))


def expect_same(result, expected):
    assert np.array_equal(result.logprob, expected.logprob)
    assert np.array_equal(result.entropy, expected.entropy)
    assert np.array_equal(result.top_k_token, expected.top_k_token)
    assert np.array_equal(result.top_k_logprob, expected.top_k_logprob)


def one_servers_result(server, hidden, labels):
    """What one replica alone answers, checked against torch's float64 log-softmax of its W."""
    with lossd.Client(server.address, timeout=600) as one:
        result = one.score("demo", hidden, labels, top_k=3, entropy=True)
        weight = torch.from_numpy(one.fetch_weight("demo")).double()
    logp = torch.log_softmax(torch.from_numpy(hidden).double() @ weight.T, dim=-1)
    expected = logp.gather(1, torch.from_numpy(labels).long()[:, None])[:, 0].numpy()
    np.testing.assert_allclose(result.logprob, expected, rtol=1e-5, atol=2e-5)
    return result


def test_replicas_serve_one_hash_that_the_bytes_give(replicas, other):
    hashes = set()
    for server in replicas:
        with lossd.Client(server.address) as client:
            info = client.get_head("demo")
            weight = client.fetch_weight("demo")
        header = f"lossd-head-v1 float32 {VOCAB} {HIDDEN}\n".encode()
        assert info.weight_sha256 == hashlib.sha256(header + weight.tobytes()).hexdigest()
        hashes.add(info.weight_sha256)
    assert len(hashes) == 1
    with lossd.Client(other.address) as client:
        assert client.get_head("demo").weight_sha256 not in hashes


def test_scoring_spreads_over_every_replica_with_one_servers_results(replicas):
    hidden, labels = batch(300, 1)
    expected = one_servers_result(replicas[0], hidden, labels)
    with lossd.Client(target(replicas), timeout=600) as client:
        assert client.target.listed_addresses == 3
        # Round robin connects to every address and reads go round too: once each replica has
        # answered one, all three are in the rotation.
        deadline = time.monotonic() + 600  # a hang guard
        while min(served(s, "GetHead") for s in replicas) == 0:
            assert time.monotonic() < deadline, "a replica never joined the rotation"
            client.get_head("demo")
        before = [served(s) for s in replicas]
        calls = 12
        for _ in range(calls):
            result = client.score("demo", hidden, labels, top_k=3, entropy=True)
            expect_same(result, expected)
            assert result.attempts == 1
    counts = [served(s) - b for s, b in zip(replicas, before)]
    assert sum(counts) == calls
    assert min(counts) >= calls // 3 - 1, counts


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "drained"])
def test_a_replica_that_goes_away_mid_run_costs_no_call(replicas, stop):
    """SIGKILL: the call running there fails with UNAVAILABLE and the client sends it again to
    the next replica. SIGTERM (a rolling update): the replica finishes what it runs, refuses what
    comes, and its health turns NOT_SERVING, which takes it out of the rotation."""
    hidden, labels = batch(4000, 2)  # long enough that one call is running when the stop comes
    expected = one_servers_result(replicas[0], hidden, labels)
    results, errors = [], []
    done = threading.Event()
    with lossd.Client(target(replicas), timeout=600,
                      retry=lossd.RetryPolicy(initial_backoff=0.05)) as client:
        def caller():
            while not done.is_set():
                try:
                    results.append(client.score("demo", hidden, labels, top_k=3, entropy=True))
                except lossd.LossdError as error:
                    errors.append(error)

        thread = threading.Thread(target=caller)
        thread.start()
        try:
            victim = replicas[2]
            deadline = time.monotonic() + 600  # a hang guard
            while in_flight(victim) < 1:
                assert time.monotonic() < deadline, "no call reached the third replica"
            victim.process.send_signal(stop)
            at_stop = len(results)
            deadline = time.monotonic() + 600  # a hang guard
            while len(results) < at_stop + 6 and not errors:
                assert time.monotonic() < deadline, "calls stopped after the replica went away"
                time.sleep(0.05)
        finally:
            done.set()
            thread.join()
        assert not errors, errors
        for result in results:
            expect_same(result, expected)
        if stop == signal.SIGKILL:
            assert any(result.attempts > 1 for result in results), \
                "the call on the killed replica was retried elsewhere"
        assert victim.process.wait(timeout=600) == (-9 if stop == signal.SIGKILL else 0)
        # The rest of the run, on the two that are left.
        for _ in range(4):
            expect_same(client.score("demo", hidden, labels, top_k=3, entropy=True), expected)


def test_a_pinned_session_is_refused_by_a_replica_with_another_w(replicas, other):
    """The session pins the W of whichever server answers its first get_head (round robin); the
    other then refuses every call it gets, naming both hashes, and none of its results reach the
    caller."""
    hidden, labels = batch(200, 3)
    servers = [replicas[0], other]
    hashes = []
    for server in servers:
        with lossd.Client(server.address) as client:
            hashes.append(client.get_head("demo").weight_sha256)
    assert hashes[0] != hashes[1]
    expected = [one_servers_result(server, hidden, labels) for server in servers]
    with lossd.Client(target(servers), timeout=600) as client:
        head = RemoteHead(client, "demo")
        pinned = hashes.index(head.pin_weights())
        refusing = servers[1 - pinned]
        before = served(refusing)
        outcomes = {"served": 0, "refused": 0}
        for _ in range(8):
            try:
                scores = head.score(torch.from_numpy(hidden), torch.from_numpy(labels))
            except lossd.LossdError as error:
                assert error.code == "FAILED_PRECONDITION", error
                assert hashes[0] in error.message and hashes[1] in error.message, error.message
                outcomes["refused"] += 1
                continue
            assert np.array_equal(scores.logprob.numpy(), expected[pinned].logprob)
            outcomes["served"] += 1
        assert outcomes["served"] > 0 and outcomes["refused"] > 0, outcomes
        assert served(refusing) == before, "the other W computed nothing"
        # Without the pin the same target mixes the two heads' answers: what the pin is for.
        mixed = [client.score("demo", hidden, labels).logprob for _ in range(4)]
        for e in expected:
            assert any(np.array_equal(m, e.logprob) for m in mixed)


def test_training_refuses_a_target_that_lists_several_servers(replicas):
    hidden, labels = batch(64, 4)
    with lossd.Client(target(replicas)) as client:
        head = RemoteHead(client, "demo")
        h = torch.from_numpy(hidden).requires_grad_()
        refusals = {
            "a call that accumulates dL/dW": lambda: head(h, torch.from_numpy(labels)),
            "an optimizer step": lambda: head.step("sgd", lr=0.1),
            "zeroing the gradient": lambda: head.zero_grad(),
            "the accumulated dL/dW": lambda: head.fetch_grad_weight(),
            "an upload": lambda: client.upload_head("new", np.zeros((10, HIDDEN), np.float32)),
            "a checkpoint": lambda: client.save_checkpoint(),
            "shared memory": lambda: client.compute("demo", hidden, labels, shared_memory=True),
            "an embedding gradient": lambda: client.accumulate_embedding_grad(
                "demo", labels[:2], hidden[:2]),
        }
        for what, call in refusals.items():
            with pytest.raises(lossd.LossdError) as refused:
                call()
            assert refused.value.code == "FAILED_PRECONDITION", what
            assert f"address: expected one server for {what}" in refused.value.message
            assert "lists 3 addresses" in refused.value.message
    for server in replicas:
        assert served(server) == 0, "a refused call reached a server"
    # One server in gRPC's URI forms trains as HOST:PORT does.
    with lossd.Client(f"ipv4:{replicas[0].address}") as client:
        loss = RemoteHead(client, "demo")(h, torch.from_numpy(labels))
        loss.backward()
        assert client.get_head("demo").accumulated_calls == 1


def test_a_unix_socket_target_passes_through():
    path = os.path.join(tempfile.mkdtemp(prefix="lossd-unix-"), "lossd.sock")
    with start_server(SEED, f"--listen=unix:{path}") as server, \
            lossd.Client(f"unix:{path}") as client:
        assert client.target == lossd.Target(f"unix:{path}", 1, local=True)
        assert client.get_head("demo").weight_sha256
        assert server.process.poll() is None


@pytest.mark.parametrize("address,listed,local", [
    ("lossd:50051", 1, False),                             # HOST:PORT, resolved by DNS
    ("dns:///lossd-scoring:50051", 1, False),              # may resolve to several; names one
    ("ipv4:127.0.0.1:5001,127.0.0.1:5002,127.0.0.1:5003", 3, False),  # several: replicas
    ("ipv4:///127.0.0.1:1,127.0.0.1:2", 2, False),         # the URI form, empty authority
    ("ipv6:[::1]:5001,[::1]:5002", 2, False),
    ("unix:/run/lossd/lossd.sock", 1, True),
    ("unix-abstract:lossd", 1, True),
    ("127.0.0.1:50051", 1, True),                          # loopback: shared memory may serve
    ("localhost:50051", 1, True),
    ("[::1]:50051", 1, True),
    ("dns:///localhost:50051", 1, True),
    ("10.0.0.7:50051", 1, False),
])
def test_parse_target_lists_what_the_target_names_and_keeps_it(address, listed, local):
    assert lossd.parse_target(address) == lossd.Target(address, listed, local)


@pytest.mark.parametrize("address", ["", "ipv4:", "ipv4:127.0.0.1:1,,127.0.0.1:2", None])
def test_parse_target_refuses_what_names_no_server(address):
    with pytest.raises(ValueError, match="^address: expected"):
        lossd.parse_target(address)


def test_connections_age_out_so_that_clients_reach_new_replicas():
    """--max_connection_age_seconds: the server ends each connection after about that long
    (GOAWAY); calls in flight finish, and the client connects again, resolving its target anew,
    which is how clients of a headless Service reach the replicas a scale-up adds."""
    hidden, labels = batch(64, 5)
    # Scoring in messages, over the round-robin channel watched here.
    with start_server(SEED, "--max_connection_age_seconds=1") as server, \
            lossd.Client(server.address, timeout=600, shared_memory=False) as client:
        states = []
        # The client's round-robin channel, watched from the outside: READY each time it connects.
        client._channel.subscribe(states.append, try_to_connect=False)
        # Until the client has connected a second time: however slow the machine, the first
        # connection ages out (a hang guard stops a server that never closes it).
        deadline = time.monotonic() + 600
        calls = 0
        while states.count(grpc.ChannelConnectivity.READY) < 2:
            assert time.monotonic() < deadline, (calls, states)
            client.score("demo", hidden, labels)  # raises if a call fails
            calls += 1
            time.sleep(0.05)


def test_a_negative_connection_age_is_refused_at_startup():
    code, output = run_to_exit("--device=cpu", "--demo_vocab_size=10", "--demo_hidden_size=4",
                               "--listen=127.0.0.1:0", "--metrics_listen=",
                               "--max_connection_age_seconds=-1")
    assert code == 1, output
    assert "--max_connection_age_seconds: expected 0 (unlimited) or a positive duration, got -1s" \
        in output


def test_grpc_retries_the_read_only_calls_and_makes_steps_once():
    """The channels' retryPolicy: a draining server refuses every call with UNAVAILABLE, and
    counts each attempt it refuses. gRPC sends a read of one message (fetch_grad_weight) the
    policy's 4 times; a step, which a lost answer could have applied, once."""
    # A call kept in flight by its client, which holds back its last rows until the checks are
    # done, keeps the server draining however fast the machine computes.
    vocab, hidden_size, tokens, drain = 3000, 64, 256, 600
    rng = np.random.default_rng(6)
    hidden = rng.standard_normal((tokens, hidden_size), dtype=np.float32)
    labels = rng.integers(0, vocab, tokens)
    last_rows = threading.Event()

    def requests():
        yield pb.ComputeRequest(start=pb.ComputeStart(
            head="demo", num_tokens=tokens, hidden_size=hidden_size,
            hidden_dtype=pb.DTYPE_FLOAT32, labels=labels.tolist()))
        yield pb.ComputeRequest(chunk=pb.ComputeChunk(hidden=hidden[:tokens // 2].tobytes()))
        last_rows.wait()
        yield pb.ComputeRequest(chunk=pb.ComputeChunk(hidden=hidden[tokens // 2:].tobytes()))

    with ServerProcess("--device=cpu", f"--demo_vocab_size={vocab}",
                       f"--demo_hidden_size={hidden_size}", f"--drain_seconds={drain}") as server, \
            lossd.Client(server.address, timeout=2 * drain) as busy, \
            lossd.Client(server.address, timeout=2 * drain,
                         retry=lossd.RetryPolicy(max_attempts=4, initial_backoff=0.01)) as idle:
        idle.zero_grad("demo")  # connected before the drain
        caller = threading.Thread(
            target=lambda: list(busy._stub.Compute(requests(), timeout=2 * drain)))
        caller.start()
        # In flight: the server has read the call's first rows.
        while server.metric("lossd_received_bytes_total") == 0:
            time.sleep(0.01)
        server.process.send_signal(signal.SIGTERM)
        while "draining in-flight calls" not in server.output():
            time.sleep(0.01)
        for call in (lambda: idle.fetch_grad_weight("demo"),
                     lambda: idle.step("demo", "sgd", lr=0.1)):
            with pytest.raises(lossd.LossdError) as refused:
                call()
            assert refused.value.code == "UNAVAILABLE"
            assert "shutting down" in refused.value.message
        refusals = {method: served_with(server, method, "UNAVAILABLE")
                    for method in ("FetchGradWeight", "Step")}
        last_rows.set()
        caller.join()
    assert refusals == {"FetchGradWeight": 4, "Step": 1}, refusals


def test_trainer_ranks_spread_over_a_replica_group():
    """Rank r trains with replica r % R; a step meets the ranks of one replica (their number,
    this rank's place among them), while commits still average over the whole world."""
    from lossd._address import replica_group

    addresses = ["a:1", "b:1", "c:1"]
    assert [lossd.replica_address(addresses, r) for r in range(7)] == \
        ["a:1", "b:1", "c:1", "a:1", "b:1", "c:1", "a:1"]
    # Seven ranks over three replicas: replica 0 serves ranks 0, 3, 6; the others two each.
    assert [replica_group(7, r, 3) for r in range(7)] == \
        [(3, 0), (2, 0), (2, 0), (3, 1), (2, 1), (2, 1), (3, 2)]
    assert replica_group(4, 3, 1) == (4, 3)
    with pytest.raises(ValueError, match="3 server replicas for 2 trainer ranks"):
        replica_group(2, 0, 3)
    with pytest.raises(ValueError, match=r"addresses\[1\]: .*which has no port"):
        lossd.replica_address(["a:1", "b"], 0)
    with pytest.raises(ValueError, match="replicas: expected an int >= 1"):
        replica_group(2, 0, 0)
