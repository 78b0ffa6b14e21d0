"""Crash safety of checkpoints, against the real lossd_server binary.

The server trains a 20 MB head (V=20000, H=256, fp32, AdamW: 60 MB per checkpoint) and saves it
again and again while a timer kills it with SIGKILL at a random moment, often in the middle of a
save. After every kill it is restarted on the same --checkpoint_dir and must resume from the newest
complete checkpoint, bitwise identical to the W fetched right before that save, and remove the
temporary files the interrupted saves left. Truncated or corrupted checkpoint files are refused with a
"skipped checkpoint: <path>: <reason>" startup line and the previous complete one is used.
"""
import collections
import itertools
import os
import random
import re
import shutil
import signal
import tempfile
import threading
import time

import grpc
import numpy as np
import pytest

from server_process import ServerProcess, generate_stubs, run_to_exit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB, HIDDEN = 20000, 256
HEAD = "demo"
KILL_TRIALS = 20
# Kills not aimed at a save land uniformly in this window after the server is up, which spans
# about two rounds of compute, step, fetch and save on 2 cores.
KILL_WINDOW_S = (0.05, 1.2)
CHECKPOINT_NAME = re.compile(HEAD + r"-v(\d{20})\.safetensors$")


@pytest.fixture(scope="module")
def pb(tmp_path_factory):
    generate_stubs(os.path.join(REPO, "proto"), str(tmp_path_factory.mktemp("stubs")))
    from lossd.v1 import lossd_pb2, lossd_pb2_grpc
    return lossd_pb2, lossd_pb2_grpc


@pytest.fixture
def checkpoint_dir():
    path = tempfile.mkdtemp(prefix="lossd-crash-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start_server(checkpoint_dir):
    return ServerProcess("--device=cpu", f"--demo_vocab_size={VOCAB}", f"--demo_hidden_size={HIDDEN}",
                         f"--checkpoint_dir={checkpoint_dir}", "--keep_checkpoints=3", metrics=False)


def open_channel(server):
    return grpc.insecure_channel(server.address, options=[("grpc.max_receive_message_length", 64 << 20)])


def train_and_step(pb, stub, rng):
    """One training call that accumulates dL/dW, then an AdamW step; returns the new version."""
    lossd = pb[0]
    n = 16
    hidden = rng.standard_normal((n, HIDDEN), dtype=np.float32)
    start = lossd.ComputeStart(head=HEAD, num_tokens=n, hidden_size=HIDDEN, hidden_dtype=lossd.DTYPE_FLOAT32,
                               labels=rng.integers(0, VOCAB, n).tolist(),
                               outputs=lossd.OutputSelection(accumulate_grad_weight=True))
    requests = [lossd.ComputeRequest(start=start),
                lossd.ComputeRequest(chunk=lossd.ComputeChunk(hidden=hidden.tobytes()))]
    assert list(stub.Compute(iter(requests)))[-1].summary.grad_weight_accumulated
    return stub.Step(lossd.StepRequest(head=HEAD, adamw=lossd.AdamWConfig(learning_rate=1e-3))).head_version


def fetch_weight(pb, stub):
    """(version, W bytes) from one consistent snapshot."""
    chunks = list(stub.FetchWeight(pb[0].FetchTensorRequest(head=HEAD)))
    assert len({c.head_version for c in chunks}) == 1
    return chunks[0].head_version, b"".join(c.data for c in chunks)


def save(pb, stub):
    return list(stub.SaveCheckpoint(pb[0].SaveCheckpointRequest(head=HEAD)).paths)


def checkpoint_files(checkpoint_dir):
    """{version: path} of the files under checkpoint names."""
    head_dir = os.path.join(checkpoint_dir, HEAD)
    found = {}
    for name in os.listdir(head_dir) if os.path.isdir(head_dir) else []:
        match = CHECKPOINT_NAME.match(name)
        if match:
            found[int(match.group(1))] = os.path.join(head_dir, name)
    return found


def complete_path(checkpoint_dir, version):
    return os.path.join(checkpoint_dir, HEAD, f"{HEAD}-v{version:020d}.safetensors")


def temporary_files(checkpoint_dir):
    head_dir = os.path.join(checkpoint_dir, HEAD)
    return {name for name in os.listdir(head_dir) if ".tmp" in name} if os.path.isdir(head_dir) else set()


def skipped_lines(server):
    return [line for line in server.output().splitlines() if "skipped checkpoint: " in line]


def test_sigkill_at_random_moments_resumes_the_newest_complete_checkpoint(pb, checkpoint_dir, record_property):
    seed = random.SystemRandom().randrange(2 ** 32)
    record_property("seed", seed)
    rng = np.random.default_rng(seed)
    saved = {}  # version -> W fetched right before a save of that version
    initial = None  # the demo head's W, served while no checkpoint exists
    acked = 0  # the newest version whose save returned
    kills = collections.Counter()
    save_seconds = []
    for trial in range(KILL_TRIALS):
        left_behind = temporary_files(checkpoint_dir)
        with start_server(checkpoint_dir) as server, open_channel(server) as channel:
            stub = pb[1].LossServiceStub(channel)
            version, weight = fetch_weight(pb, stub)
            complete = checkpoint_files(checkpoint_dir)
            context = f"trial {trial} (seed {seed}): resumed version {version}, files {sorted(complete)}"
            if complete:
                assert version == max(complete), context
                assert weight == saved[version], context + ": W differs from what was saved"
            else:
                assert version == 1, context
                initial = initial or weight
                assert weight == initial, context
            assert version >= acked, context + f": the save of version {acked} returned, but was lost"
            # Interrupted saves' temporary files are reported and removed, never loaded.
            reported = set()
            for line in skipped_lines(server):
                assert line.endswith(": temporary file of an interrupted save, removed"), \
                    context + ": " + line
                reported.add(os.path.basename(line.split("skipped checkpoint: ", 1)[1].rsplit(": ", 1)[0]))
            assert reported == left_behind, context
            assert not temporary_files(checkpoint_dir), context

            # Most kills aim into a save's write: a watcher kills the server as soon as it sees the
            # save's temporary file, whatever the machine's load makes a save take. The rest land
            # anywhere in the first rounds.
            temporaries = temporary_files(checkpoint_dir)
            kill = lambda: os.kill(server.process.pid, signal.SIGKILL)  # noqa: E731

            def kill_mid_write(process=server.process, before=temporaries, kill=kill):
                while process.poll() is None:
                    if temporary_files(checkpoint_dir) - before:
                        kill()
                        return
                    time.sleep(0.0002)

            aimed = rng.random() < 0.75
            killers = [threading.Thread(target=kill_mid_write) if aimed
                       else threading.Timer(rng.uniform(*KILL_WINDOW_S), kill)]
            for killer in killers:
                killer.start()
            in_save = False
            try:
                for _ in itertools.count():
                    # Mostly a new version; sometimes the same one again, which replaces its file.
                    if version == 1 or rng.random() < 0.75:
                        version = train_and_step(pb, stub, rng)
                    version, saved[version] = fetch_weight(pb, stub)
                    in_save = True
                    began = time.monotonic()
                    assert save(pb, stub) == [complete_path(checkpoint_dir, version)]
                    save_seconds.append(time.monotonic() - began)
                    in_save = False
                    acked = version
            except grpc.RpcError as error:
                assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), error
            for killer in killers:
                killer.join()
            assert server.process.wait(timeout=600) == -signal.SIGKILL
            left_temporary = bool(temporary_files(checkpoint_dir) - temporaries)
            kills["mid_write" if left_temporary else "in_save_outside_the_write" if in_save else "between_saves"] += 1

    with start_server(checkpoint_dir) as server, open_channel(server) as channel:
        version, weight = fetch_weight(pb, pb[1].LossServiceStub(channel))
        assert version == max(checkpoint_files(checkpoint_dir)) and weight == saved[version]
    record_property("kill_trials", KILL_TRIALS)
    for where, count in sorted(kills.items()):
        record_property(f"kills_{where}", count)
    record_property("saves_completed", len(save_seconds))
    record_property("mean_save_seconds", round(sum(save_seconds) / max(len(save_seconds), 1), 3))
    # Most kills are aimed into writes; a few would prove little.
    assert kills["mid_write"] >= KILL_TRIALS // 5, f"only {kills['mid_write']} kills landed mid-write"


def flip_bytes(path, offset, count=4):
    with open(path, "r+b") as f:
        f.seek(offset)
        data = bytearray(f.read(count))
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def test_truncated_or_corrupt_checkpoints_are_skipped_never_half_loaded(pb, checkpoint_dir):
    rng = np.random.default_rng()
    saved = {}
    with start_server(checkpoint_dir) as server, open_channel(server) as channel:
        stub = pb[1].LossServiceStub(channel)
        initial = fetch_weight(pb, stub)
        for _ in range(3):
            train_and_step(pb, stub, rng)
            version, saved[version] = fetch_weight(pb, stub)
            save(pb, stub)
    oldest, middle, newest = sorted(checkpoint_files(checkpoint_dir))
    paths = checkpoint_files(checkpoint_dir)

    def resumed(expected_version, expected_weight, refused):
        with start_server(checkpoint_dir) as server, open_channel(server) as channel:
            stub = pb[1].LossServiceStub(channel)
            assert fetch_weight(pb, stub) == (expected_version, expected_weight)
            info = stub.GetHead(pb[0].GetHeadRequest(head=HEAD))
            assert info.optimizer == pb[0].OptimizerState.KIND_ADAMW or expected_version == 1
            lines = skipped_lines(server)
            for path, reason in refused.items():
                assert any(line.split("skipped checkpoint: ", 1)[1].startswith(path + ": ") and
                           re.search(reason, line) for line in lines), (path, reason, lines)

    truncated = {paths[newest]: r"exceed the data buffer .* \(truncated\?\)"}
    corrupt = {paths[middle]: r"CRC-32C of the data is \w+, the metadata says \w+ \(corrupt file\)"}
    unreadable = {paths[oldest]: r"header: not valid JSON"}
    # Cut the newest file in half: its tensors end early.
    os.truncate(paths[newest], os.path.getsize(paths[newest]) // 2)
    resumed(middle, saved[middle], truncated)
    # Flip bytes in the middle of the next one's tensor data: a checksum no longer matches.
    flip_bytes(paths[middle], os.path.getsize(paths[middle]) // 2)
    resumed(oldest, saved[oldest], {**truncated, **corrupt})
    # Break the last one's JSON header: no complete checkpoint is left, and none is half-loaded.
    # The server then refuses to start, naming every file and what is wrong with it, rather than
    # serve the demo head as if it had never been trained; with the head's directory moved aside
    # it starts afresh.
    flip_bytes(paths[oldest], 8, 16)
    code, output = run_to_exit("--listen=127.0.0.1:0", "--metrics_listen=", "--device=cpu",
                               f"--demo_vocab_size={VOCAB}", f"--demo_hidden_size={HIDDEN}",
                               f"--checkpoint_dir={checkpoint_dir}")
    assert code == 1, output
    assert f"DATA_LOSS: --checkpoint_dir: every checkpoint of head '{HEAD}'" in output, output
    for path, reason in {**truncated, **corrupt, **unreadable}.items():
        assert re.search(re.escape(path) + ": [^;]*" + reason, output), (path, reason, output)
    shutil.rmtree(os.path.join(checkpoint_dir, HEAD))
    resumed(1, initial[1], {})
