"""lossctl run as a user would, against the real lossd_server binary on loopback."""
import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "python"))
from server_process import SERVER_BIN, ServerProcess, run_with_terminal_stderr  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOSSCTL = os.environ.get("LOSSCTL_BIN", "build/bin/lossctl")
VOCAB, HIDDEN = 1000, 64
SUBCOMMANDS = ["heads", "head", "compute", "fetch-grad", "fetch-weight", "zero-grad", "step", "save",
               "upload", "bench"]


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def server(checkpoint_dir):
    with ServerProcess("--device=cpu", f"--demo_vocab_size={VOCAB}", f"--demo_hidden_size={HIDDEN}",
                       f"--checkpoint_dir={checkpoint_dir}", metrics=False) as s:
        yield s


def lossctl(*args, server=None, expect=0):
    command = [LOSSCTL, *([f"--server={server.address}"] if server else []), *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == expect, f"{command} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def log_softmax(logits):
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def test_help_describes_every_subcommand():
    top = lossctl("--help")
    for name in SUBCOMMANDS:
        assert name in top.stdout
        sub = lossctl(name, "--help")
        assert f"Usage: lossctl {name}" in sub.stdout
        assert "--server" in sub.stdout
    assert "--grad_out" in lossctl("compute", "--help").stdout


def test_usage_errors_exit_2():
    assert "unknown subcommand" in lossctl("frobnicate", expect=2).stderr
    assert "unknown flag --bogus" in lossctl("heads", "--bogus", expect=2).stderr
    assert "--out is required" in lossctl("fetch-grad", expect=2).stderr
    assert "--synthetic" in lossctl("compute", "--synthetic=abc", expect=2).stderr


def test_heads_lists_the_demo_head(server):
    out = lossctl("heads", server=server).stdout
    assert re.search(rf"^demo\s+{VOCAB}\s+{HIDDEN}\s+float32", out, re.M), out
    assert "vocab_size:         1000" in lossctl("head", "demo", server=server).stdout


def test_compute_from_files_matches_numpy(server, tmp_path):
    lossctl("fetch-weight", "--head=demo", "--out", tmp_path / "w.npy", server=server)
    weight = np.load(tmp_path / "w.npy").astype(np.float64)
    rng = np.random.default_rng(5)
    hidden = rng.standard_normal((3, 40, HIDDEN)).astype(np.float32)  # [batch, seq, H] flattens
    labels = rng.integers(0, VOCAB, (3, 40))
    labels[0, :5] = -100
    np.save(tmp_path / "h.npy", hidden)
    np.save(tmp_path / "y.npy", labels)
    out = lossctl("compute", "--head=demo", "--hidden", tmp_path / "h.npy", "--labels", tmp_path / "y.npy",
                  "--top_k=4", "--out", tmp_path / "o.json", server=server).stdout

    logp = log_softmax(hidden.reshape(-1, HIDDEN).astype(np.float64) @ weight.T)
    flat = labels.reshape(-1)
    counted = flat != -100
    token_logp = logp[np.arange(flat.size), np.where(counted, flat, 0)]
    expected_loss = -token_logp[counted].mean()
    loss = float(re.search(r"^loss (\S+) \(mean\)", out, re.M).group(1))
    assert abs(loss - expected_loss) <= 1e-5 * expected_loss, out
    assert f"{counted.sum()} counted" in out

    results = json.load(open(tmp_path / "o.json"))
    assert results["counted_tokens"] == counted.sum()
    np.testing.assert_allclose(np.array(results["logprob"])[counted], token_logp[counted],
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.array(results["top_k_token"])[:, 0], logp.argmax(axis=1))
    assert len(results["top_k_logprob"][0]) == 4


def test_accumulate_fetch_grad_and_step(server, tmp_path):
    lossctl("zero-grad", "--head=demo", server=server)
    out = lossctl("compute", "--head=demo", "--synthetic=256", "--seed=3", "--accumulate", "--grad",
                  "--grad_out", tmp_path / "dh.npy", server=server).stdout
    assert "dL/dW added to the head's accumulator" in out
    assert re.search(r"^time \S+ s wall", out, re.M), out
    assert np.load(tmp_path / "dh.npy").shape == (256, HIDDEN)

    out = lossctl("fetch-grad", "--head=demo", "--out", tmp_path / "grad.npy", server=server).stdout
    assert "256 accumulated tokens" in out
    grad = np.load(tmp_path / "grad.npy")
    assert grad.shape == (VOCAB, HIDDEN) and grad.dtype == np.float32
    assert np.abs(grad).max() > 0
    bf16 = lossctl("fetch-grad", "--head=demo", "--dtype=bf16", "--out", tmp_path / "grad16.npy",
                   server=server)
    assert "<u2" in bf16.stdout
    widened = (np.load(tmp_path / "grad16.npy").astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_allclose(widened, grad, rtol=1e-2, atol=1e-9)

    described = lossctl("head", "demo", server=server).stdout
    version = int(re.search(r"^version:\s+(\d+)", described, re.M).group(1))
    out = lossctl("step", "--head=demo", "--optimizer=adamw", "--lr=1e-3", "--max_grad_norm=1",
                  server=server).stdout
    assert f"version {version} -> {version + 1}" in out, out
    assert "gradient zeroed" in out
    lossctl("fetch-grad", "--head=demo", "--out", tmp_path / "after.npy", server=server)
    assert not np.load(tmp_path / "after.npy").any()
    assert "momentum is an SGD setting" in lossctl("step", "--head=demo", "--optimizer=adamw", "--lr=1",
                                                   "--momentum=0.9", server=server, expect=2).stderr


def test_step_takes_torchs_adamw_defaults(tmp_path):
    """`step --optimizer=adamw` alone is torch.optim.AdamW() (lr 1e-3, betas (0.9, 0.999), eps
    1e-8, weight_decay 0.01): a first step moves W to W (1 - lr wd) - lr g / (|g| + eps)."""
    with ServerProcess("--device=cpu", "--demo_vocab_size=300", "--demo_hidden_size=16",
                       f"--demo_seed={os.getpid()}", metrics=False) as fresh:
        lossctl("fetch-weight", "--out", tmp_path / "w.npy", server=fresh)
        lossctl("compute", "--synthetic=64", "--accumulate", server=fresh)
        lossctl("fetch-grad", "--out", tmp_path / "g.npy", server=fresh)
        out = lossctl("step", "--optimizer=adamw", server=fresh).stdout
        assert "stepped head demo with adamw" in out, out
        lossctl("fetch-weight", "--out", tmp_path / "after.npy", server=fresh)
        # SGD without --lr takes torch's 1e-3; the accumulator is empty after the AdamW step.
        out = lossctl("step", "--optimizer=sgd", server=fresh).stdout
        assert "stepped head demo with sgd" in out, out
    weight = np.load(tmp_path / "w.npy").astype(np.float64)
    grad = np.load(tmp_path / "g.npy").astype(np.float64)
    lr, weight_decay, eps = 1e-3, 0.01, 1e-8
    expected = weight * (1 - lr * weight_decay) - lr * grad / (np.abs(grad) + eps)
    np.testing.assert_allclose(np.load(tmp_path / "after.npy"), expected, rtol=1e-6, atol=1e-7)


def test_upload_safetensors_then_save(server, tmp_path, checkpoint_dir):
    # With one head on the server, --head may be left out.
    assert "zeroed the gradient of head demo" in lossctl("zero-grad", server=server).stdout
    weight = np.random.default_rng(2).standard_normal((50, HIDDEN)).astype(np.float32)
    header = json.dumps({"lm_head.weight": {"dtype": "F32", "shape": list(weight.shape),
                                            "data_offsets": [0, weight.nbytes]}}).encode()
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + weight.tobytes())
    out = lossctl("upload", "--head=small", "--weight", tmp_path / "model.safetensors", server=server).stdout
    assert "uploaded head small: [50, 64]" in out
    lossctl("fetch-weight", "--head=small", "--out", tmp_path / "back.npy", server=server)
    np.testing.assert_array_equal(np.load(tmp_path / "back.npy"), weight)
    err = lossctl("upload", "--head=small", "--weight", tmp_path / "model.safetensors", server=server,
                  expect=1).stderr
    assert "ALREADY_EXISTS" in err
    # Two heads now: calls that need one must name it.
    assert "name one" in lossctl("zero-grad", server=server, expect=2).stderr

    saved = lossctl("save", "--head=small", server=server).stdout
    path = re.search(r"^saved (\S+)", saved, re.M).group(1)
    assert os.path.exists(path) and path.startswith(str(checkpoint_dir))


def write_safetensors(path, tensors):
    """A safetensors file of float32 arrays, laid out as the format says."""
    header, offset = {}, 0
    for name, array in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.write(b"".join(a.tobytes() for a in tensors.values()))


def test_upload_from_a_sharded_model_directory(server, tmp_path):
    """Read as lossd_server --heads reads it: a tied model serves its embedding, with the tie and
    soft cap of its config.json; the first shard of an untied one alone is refused."""
    rng = np.random.default_rng(3)
    embedding = rng.standard_normal((40, HIDDEN)).astype(np.float32)
    lm_head = rng.standard_normal((40, HIDDEN)).astype(np.float32)
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors",
                      {"model.embed_tokens.weight": embedding})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"model.norm.weight":
                                                                       np.ones(HIDDEN, np.float32)})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "model.norm.weight": "model-00002-of-00002.safetensors"}}))
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gemma2", "vocab_size": 40, "final_logit_softcapping": 30.0}))
    out = lossctl("upload", "--head=tied", "--weight", tmp_path, server=server).stdout
    assert "uploaded head tied: [40, 64]" in out and "tied to the input embedding" in out, out
    described = lossctl("head", "tied", server=server).stdout
    assert "tied_embeddings:    true" in described and "logit_softcap:      30" in described
    lossctl("fetch-weight", "--head=tied", "--out", tmp_path / "back.npy", server=server)
    np.testing.assert_array_equal(np.load(tmp_path / "back.npy"), embedding)

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama",
                                                      "tie_word_embeddings": False}))
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"lm_head.weight": lm_head})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    err = lossctl("upload", "--head=shard", "--weight",
                  tmp_path / "model-00001-of-00002.safetensors", server=server, expect=1).stderr
    assert "'lm_head.weight'" in err and "is one shard of" in err, err


def test_bench_reports_throughput_and_latency(server):
    done = lossctl("bench", "--head=demo", "--tokens=64", "--calls=6", "--streams=2", "--grad", server=server)
    assert re.search(r"^6 calls in \S+ s: \S+ calls/s, \S+ tokens/s", done.stdout, re.M), done.stdout
    assert re.search(r"sent \S+ GB/s, received \S+ GB/s", done.stdout), done.stdout
    assert re.search(r"latency p50 \S+ s, p90 \S+ s, p99 \S+ s", done.stdout), done.stdout
    assert "6/6 calls" in done.stderr  # the progress line's last state


def test_compute_shows_progress_on_a_terminal_only(server):
    rows = 20000
    command = [LOSSCTL, f"--server={server.address}", "compute", "--head=demo",
               f"--synthetic={rows}", "--grad"]
    code, out, terminal = run_with_terminal_stderr(command, timeout=600)
    assert code == 0 and "loss" in out, out + terminal
    # One line redrawn in place: each state after a carriage return, the last one whole.
    states = re.findall(r"\rcompute: (\d+)/(\d+) rows, [\d.]+ s\x1b\[K", terminal)
    assert states and terminal.endswith("\n"), repr(terminal)
    done = [int(d) for d, _ in states]
    assert done == sorted(done) and done[-1] == rows, repr(terminal)
    assert {int(total) for _, total in states} == {rows}

    piped = lossctl("compute", "--head=demo", f"--synthetic={rows}", "--grad", server=server)
    assert piped.stderr == "" and "loss" in piped.stdout, piped.stderr
    code, out, terminal = run_with_terminal_stderr(command + ["--quiet"], timeout=600)
    assert code == 0 and "loss" in out and terminal == "", repr(terminal)
    quiet_bench = lossctl("bench", "--head=demo", "--tokens=64", "--calls=3", "--quiet",
                          server=server)
    assert quiet_bench.stderr == "" and "3 calls in" in quiet_bench.stdout, quiet_bench.stderr


def test_bench_json_counts_every_byte_of_the_rows_each_way(server):
    done = lossctl("bench", "--head=demo", "--tokens=64", "--calls=4", "--streams=2", "--grad",
                   "--json", server=server)
    totals = json.loads(done.stdout)
    assert (totals["calls"], totals["tokens_per_call"], totals["streams"]) == (4, 64, 2)
    rows_bytes = 4 * 64 * HIDDEN * 4  # float32 rows out, float32 dL/dh back
    # Payloads are the rows plus labels and per-token results, so a little more than the rows.
    assert rows_bytes <= totals["bytes_sent"] < 1.1 * rows_bytes + 4096
    assert rows_bytes <= totals["bytes_received"] < 1.1 * rows_bytes + 4096
    assert 0 < totals["latency_p50"] <= totals["latency_max"] <= totals["seconds"]
    assert totals["tokens_per_second"] == pytest.approx(4 * 64 / totals["seconds"], rel=1e-3)
    assert 0 < totals["server_compute_seconds"]


def test_bench_warms_up_on_the_first_rows_when_asked(server, tmp_path):
    lossctl("zero-grad", "--head=demo", server=server)
    lossctl("bench", "--head=demo", "--tokens=64", "--calls=1", "--warmup=2", "--warmup_tokens=16",
            "--accumulate", server=server)
    out = lossctl("fetch-grad", "--head=demo", "--out", tmp_path / "grad.npy", server=server).stdout
    assert "96 accumulated tokens" in out, out  # 2 warm-up calls of 16 rows, 1 timed call of 64
    err = lossctl("bench", "--head=demo", "--tokens=64", "--warmup_tokens=65", server=server,
                  expect=2).stderr
    assert "--warmup_tokens: expected 0 (all of --tokens) to 64, got 65" in err, err


def test_wrong_hidden_size_exits_1_with_the_servers_message(server, tmp_path):
    np.save(tmp_path / "narrow.npy", np.zeros((4, 32), np.float32))
    err = lossctl("compute", "--head=demo", "--hidden", tmp_path / "narrow.npy", server=server,
                  expect=1).stderr
    assert f"INVALID_ARGUMENT: hidden_size: expected {HIDDEN} (head 'demo'), got 32" in err, err


def test_unreachable_server_exits_1():
    err = lossctl("--server=127.0.0.1:1", "--deadline_seconds=5", "heads", expect=1).stderr
    assert "UNAVAILABLE" in err


@pytest.mark.skipif(not os.path.exists("/usr/bin/openssl"), reason="needs openssl to make a certificate")
def test_tls_and_bearer_token(tmp_path):
    cert, key, token = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "token"
    subprocess.run(["/usr/bin/openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", key, "-out", cert], check=True, capture_output=True)
    token.write_text("s3cret\n")
    with ServerProcess("--device=cpu", "--demo_vocab_size=100", "--demo_hidden_size=16",
                       f"--tls_cert_file={cert}", f"--tls_key_file={key}", f"--token_file={token}",
                       metrics=False) as secured:
        out = lossctl("heads", f"--tls_ca_file={cert}", f"--token_file={token}", server=secured).stdout
        assert re.search(r"^demo\s+100\s+16", out, re.M), out
        lossctl("compute", "--synthetic=8", f"--tls_ca_file={cert}", f"--token_file={token}", server=secured)
        err = lossctl("heads", f"--tls_ca_file={cert}", server=secured, expect=1).stderr
        assert "UNAUTHENTICATED" in err, err


def test_one_version_everywhere(tmp_path):
    """VERSION is the one source: lossctl, lossd_server and its lossd_build_info say the same."""
    with open(os.path.join(REPO, "VERSION"), encoding="utf-8") as f:
        version = f.read().strip()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    assert lossctl("--version").stdout == f"lossctl {version}\n"
    server_version = subprocess.run([SERVER_BIN, "--version"], capture_output=True, text=True,
                                    timeout=600)
    assert server_version.stdout == f"lossd_server {version}\n", server_version
    with ServerProcess("--device=cpu", "--demo_vocab_size=16", "--demo_hidden_size=8") as s:
        with urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_port}/metrics", timeout=600) as r:
            metrics = r.read().decode()
    assert re.search(rf'^lossd_build_info\{{[^}}]*version="{re.escape(version)}"', metrics, re.M), \
        metrics


def test_server_help_names_the_program_once():
    done = subprocess.run([SERVER_BIN, "--help"], capture_output=True, text=True, timeout=600)
    first_line = (done.stdout + done.stderr).splitlines()[0]
    assert first_line == "lossd_server: linear cross-entropy as a service.", first_line


def test_replicas_score_pinned_and_refuse_training(server, tmp_path):
    """A target that lists two servers of the same demo head (its seed fixes W): scoring pinned to
    W's SHA-256 runs over both, training is refused before anything is sent, and `head` prints the
    hash that W's bytes give."""
    with ServerProcess("--device=cpu", f"--demo_vocab_size={VOCAB}", f"--demo_hidden_size={HIDDEN}",
                       metrics=False) as second:
        lossctl("fetch-weight", "--head=demo", "--out", tmp_path / "w.npy", server=second)
        weight = np.load(tmp_path / "w.npy")
        expected = hashlib.sha256(f"lossd-head-v1 float32 {VOCAB} {HIDDEN}\n".encode()
                                  + weight.tobytes()).hexdigest()
        assert f"weight_sha256:      {expected}" in lossctl("head", "demo", server=second).stdout

        replicas = f"--server=ipv4:{second.address},{server.address}"
        fresh = f"--server=ipv4:{second.address}"  # the module's server may have stepped its head
        out = lossctl(fresh, "compute", "--head=demo", "--synthetic=64", "--pin_weights").stdout
        assert f"W pinned to SHA-256 {expected}" in out, out
        err = lossctl(replicas, "compute", "--head=demo", "--synthetic=64", "--accumulate",
                      expect=1).stderr
        assert "FAILED_PRECONDITION: address: expected one server for a call that accumulates " \
               "dL/dW" in err, err
        assert "lists 2 addresses" in err, err
        err = lossctl(replicas, "step", "--head=demo", "--optimizer=sgd", "--lr=0.1",
                      expect=1).stderr
        assert "expected one server for an optimizer step" in err, err
