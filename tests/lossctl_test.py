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
SUBCOMMANDS = ["heads", "head", "compute", "fetch-grad", "fetch-weight", "zero-grad", "step",
               "grad-norm", "commit-grad", "discard-grad", "save", "upload", "bench"]
# Ratios on both sides of each ppo bound (0.8, 1.28) and past the dual clip 3, far enough from
# them that float rounding cannot move a token across.
RATIO_TARGETS = np.array([0.3, 0.79, 0.81, 1.0, 1.1, 1.27, 1.29, 2.5, 3.2, 0.95])


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
    compute_help = lossctl("compute", "--help").stdout
    for flag in ["--grad_out", "--objective", "--kl_estimator", "--teacher_head", "--outputs",
                 "--sequence_lengths", "--sparse_teacher_mass"]:
        assert flag in compute_help, flag
    # Choices and output names come from the wire contract itself.
    assert "cross_entropy, importance_sampling, ppo, cispo, logprob_gradient, distill" in compute_help
    assert "sequence_mean_token_mean" in compute_help and "ratio, clip, kl, kd, ce" in compute_help
    assert "--skip_nonfinite" in lossctl("step", "--help").stdout


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

    # Without --out the top-k is not lost silently: row 0's is printed, with where the rest goes.
    out = lossctl("compute", "--head=demo", "--hidden", tmp_path / "h.npy", "--labels",
                  tmp_path / "y.npy", "--top_k=3", server=server).stdout
    shown = re.search(r"^top-3 of row 0 \(token:logprob\) (\S+) (\S+) (\S+); every row's top-3: "
                      r"--out FILE.json$", out, re.M)
    assert shown, out
    best = np.argsort(-logp[0])[:3]
    assert [int(entry.split(":")[0]) for entry in shown.groups()] == best.tolist()


# Over shared memory, with the rows copied after the start 7 at a time (--shared_rows_per_piece),
# every per-token output is the same as through messages, bit for bit.
def test_compute_with_rows_that_follow_matches_messages(server, tmp_path):
    rng = np.random.default_rng(6)
    np.save(tmp_path / "h.npy", rng.standard_normal((50, HIDDEN)).astype(np.float32))
    np.save(tmp_path / "y.npy", rng.integers(0, VOCAB, 50))
    results = []
    for how in (["--shared_memory=false"], ["--shared_memory", "--shared_rows_per_piece=7"]):
        lossctl("compute", "--head=demo", "--hidden", tmp_path / "h.npy", "--labels",
                tmp_path / "y.npy", "--top_k=2", *how, "--out", tmp_path / "o.json", server=server)
        timed = json.load(open(tmp_path / "o.json"))
        results.append({key: value for key, value in timed.items() if "seconds" not in key})
    assert results[0] == results[1]
    assert len(results[0]["logprob"]) == 50 and len(results[0]["top_k_token"]) == 50


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


def small_server():
    return ServerProcess("--device=cpu", "--demo_vocab_size=300", "--demo_hidden_size=16",
                         f"--demo_seed={os.getpid()}", metrics=False)


def test_compute_ppo_matches_numpy(tmp_path):
    """An RL objective named on the command line: ppo with dual clip and a k3 KL term, with its
    per-token ratio, clip state and KL in --out and its statistics printed, against numpy."""
    n = 60
    rng = np.random.default_rng(7)
    hidden = rng.standard_normal((n, 16)).astype(np.float32)
    labels = rng.integers(0, 300, n)
    labels[:4] = -100
    with small_server() as s:
        lossctl("fetch-weight", "--out", tmp_path / "w.npy", server=s)
        weight = np.load(tmp_path / "w.npy").astype(np.float64)
        logp = log_softmax(hidden.astype(np.float64) @ weight.T)[np.arange(n), np.maximum(labels, 0)]
        sampling = (logp - np.log(RATIO_TARGETS[np.arange(n) % 10])).astype(np.float32)
        advantages = (rng.choice([-1.0, 1.0], n) * rng.uniform(0.5, 2.0, n)).astype(np.float32)
        reference = (logp + rng.normal(0.0, 0.5, n)).astype(np.float32)
        for name, array in [("h", hidden), ("y", labels), ("q", sampling), ("a", advantages),
                            ("r", reference)]:
            np.save(tmp_path / f"{name}.npy", array)
        out = lossctl("compute", "--hidden", tmp_path / "h.npy", "--labels", tmp_path / "y.npy",
                      "--objective=ppo", "--clip_low=0.2", "--clip_high=0.28", "--dual_clip=3",
                      "--kl_estimator=k3", "--kl_coef=0.05", "--reduction=sum",
                      "--sampling_logprobs", tmp_path / "q.npy", "--advantages", tmp_path / "a.npy",
                      "--reference_logprobs", tmp_path / "r.npy",
                      "--outputs=token_loss,ratio,clip,kl", "--out", tmp_path / "o.json",
                      server=s).stdout

    q, adv = sampling.astype(np.float64), advantages.astype(np.float64)
    ratio = np.exp(logp - q)
    term = -np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.28) * adv)
    dual = (adv < 0) & (term > -3 * adv)
    term = np.where(dual, -3 * adv, term)
    delta = reference.astype(np.float64) - logp
    kl = np.exp(delta) - delta - 1
    counted = labels != -100
    state = np.where(dual, 3, np.where((adv > 0) & (ratio > 1.28), 1,
                                       np.where((adv < 0) & (ratio < 0.8), 2, 0)))
    state[~counted] = 0
    expected_loss = (term + 0.05 * kl)[counted].sum()

    loss = float(re.search(r"^loss (\S+) \(sum\)", out, re.M).group(1))
    assert abs(loss - expected_loss) <= 1e-4 * np.abs(term + 0.05 * kl)[counted].sum(), out
    clipped = int((state != 0).sum())
    assert f"clip fraction {clipped / counted.sum():.6f} ({clipped} of {counted.sum()} counted " \
           "tokens clipped)" in out, out
    assert {1, 2, 3} <= set(state.tolist()), "the batch reaches every clip state"
    mean_kl = float(re.search(r"^mean KL (\S+) \(k3\)", out, re.M).group(1))
    assert mean_kl == pytest.approx(kl[counted].mean(), rel=1e-4), out

    results = json.load(open(tmp_path / "o.json"))
    assert results["counted_tokens"] == counted.sum()
    assert results["clipped_tokens"] == clipped
    np.testing.assert_array_equal(results["clip"], state)
    np.testing.assert_allclose(np.array(results["ratio"])[counted], ratio[counted], rtol=1e-4)
    np.testing.assert_allclose(np.array(results["kl"])[counted], kl[counted], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(results["token_loss"])[counted],
                               (term + 0.05 * kl)[counted], rtol=1e-4, atol=1e-5)
    assert "logprob" not in results, "only the outputs asked for"


def kl_divergence(p, logp, logq):
    return (p * (logp - logq)).sum(axis=1)


def test_compute_distill_matches_numpy(tmp_path):
    """Distillation on the command line: a teacher head served beside the student (the JSD at
    temperature 2, without labels) and a sparse teacher's top-k (forward KL, half cross-entropy),
    their per-token KD and CE in --out and their means printed, against numpy."""
    n, k = 40, 5
    rng = np.random.default_rng(11)
    hidden = rng.standard_normal((n, 16)).astype(np.float32)
    teacher_hidden = rng.standard_normal((n, 8)).astype(np.float32)
    teacher_weight = (0.5 * rng.standard_normal((300, 8))).astype(np.float32)
    labels = rng.integers(0, 300, n)
    labels[::7] = -100
    np.save(tmp_path / "h.npy", hidden)
    np.save(tmp_path / "th.npy", teacher_hidden)
    np.save(tmp_path / "tw.npy", teacher_weight)
    np.save(tmp_path / "y.npy", labels)
    teacher_logp = log_softmax(teacher_hidden.astype(np.float64) @ teacher_weight.T.astype(np.float64))
    top = np.argsort(-teacher_logp, axis=1)[:, :k]
    np.save(tmp_path / "tk.npy", top.astype(np.int32))
    np.save(tmp_path / "tl.npy", np.take_along_axis(teacher_logp, top, 1).astype(np.float32))
    with small_server() as s:
        lossctl("fetch-weight", "--out", tmp_path / "w.npy", server=s)
        lossctl("upload", "--head=teacher", "--weight", tmp_path / "tw.npy", server=s)
        dense = lossctl("compute", "--head=demo", "--hidden", tmp_path / "h.npy",
                        "--objective=distill", "--teacher_head=teacher", "--teacher_hidden",
                        tmp_path / "th.npy", "--distill_beta=0.5", "--distill_temperature=2",
                        "--outputs=kd,ce", "--out", tmp_path / "dense.json", server=s).stdout
        sparse = lossctl("compute", "--head=demo", "--hidden", tmp_path / "h.npy", "--labels",
                         tmp_path / "y.npy", "--objective=distill", "--distill_alpha=0.5",
                         "--teacher_top_k_tokens", tmp_path / "tk.npy", "--teacher_top_k_logprobs",
                         tmp_path / "tl.npy", "--outputs=kd,ce", "--out", tmp_path / "sparse.json",
                         server=s).stdout
    logits = hidden.astype(np.float64) @ np.load(tmp_path / "w.npy").astype(np.float64).T

    # The JSD with beta 0.5 at tau 2, times tau^2; every row counts without labels.
    logq = log_softmax(logits / 2)
    logp = log_softmax(teacher_hidden.astype(np.float64) @ teacher_weight.T.astype(np.float64) / 2)
    logm = np.log(0.5 * np.exp(logp) + 0.5 * np.exp(logq))
    kd = 4 * (0.5 * kl_divergence(np.exp(logp), logp, logm) +
              0.5 * kl_divergence(np.exp(logq), logq, logm))
    results = json.load(open(tmp_path / "dense.json"))
    assert results["counted_tokens"] == n and results["labels"] == []
    np.testing.assert_allclose(results["kd"], kd, rtol=1e-4, atol=1e-6)
    assert results["mean_kd"] == pytest.approx(kd.mean(), rel=1e-4)
    loss = float(re.search(r"^loss (\S+) \(mean\)", dense, re.M).group(1))
    assert loss == pytest.approx(kd.mean(), rel=1e-4), dense
    assert re.search(r"^mean KD \S+, mean CE 0 \(teacher at version \d+\)", dense, re.M), dense

    # The top-k renormalized, against the student at tau 1; half the label's cross-entropy.
    student = log_softmax(logits)
    top_logp = np.take_along_axis(teacher_logp, top, 1)
    top_logp -= np.log(np.exp(top_logp).sum(axis=1, keepdims=True))
    kd = kl_divergence(np.exp(top_logp), top_logp, np.take_along_axis(student, top, 1))
    ce = -student[np.arange(n), np.maximum(labels, 0)]
    counted = labels != -100
    results = json.load(open(tmp_path / "sparse.json"))
    np.testing.assert_allclose(np.array(results["kd"])[counted], kd[counted], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.array(results["ce"])[counted], ce[counted], rtol=1e-4)
    assert results["mean_ce"] == pytest.approx(ce[counted].mean(), rel=1e-4)
    loss = float(re.search(r"^loss (\S+) \(mean\)", sparse, re.M).group(1))
    assert loss == pytest.approx((0.5 * ce + 0.5 * kd)[counted].mean(), rel=1e-4), sparse


def test_staged_gradient_norm_and_skipped_step(tmp_path):
    """compute --stage keeps dL/dW on the server until commit-grad adds it times a scale;
    grad-norm reads the norm; a step whose multiplied gradient overflows is skipped."""
    with small_server() as s:
        # A gradient norm far above 1, which a multiplier of 3e38 takes past float32.
        lossctl("compute", "--synthetic=32", "--seed=1", "--grad_scale=100", "--accumulate",
                server=s)
        lossctl("fetch-grad", "--out", tmp_path / "g1.npy", server=s)
        lossctl("zero-grad", server=s)
        out = lossctl("compute", "--synthetic=32", "--seed=1", "--grad_scale=100", "--accumulate",
                      "--stage", "--call_id=staged-1", server=s).stdout
        assert "dL/dW is staged, waiting for commit-grad" in out and "staged-1" in out, out
        assert "staged_gradients:   1" in lossctl("head", "demo", server=s).stdout
        out = lossctl("commit-grad", "--call_id=staged-1", "--scale=0.5", server=s).stdout
        assert out.startswith("committed the dL/dW staged by call staged-1"), out
        out = lossctl("commit-grad", "--call_id=staged-1", "--scale=0.5", server=s).stdout
        assert out.startswith("had already committed"), out
        lossctl("fetch-grad", "--out", tmp_path / "g2.npy", server=s)
        norm = float(re.search(r"^grad norm (\S+)", lossctl("grad-norm", server=s).stdout).group(1))
        assert "discarded 0 of 2" in lossctl("discard-grad", "--call_id=staged-1,other",
                                             server=s).stdout
        out = lossctl("step", "--optimizer=sgd", "--grad_multiplier=3e38", "--skip_nonfinite",
                      "--keep_grad", server=s).stdout
        assert out.startswith("skipped the step of head demo"), out
        out = lossctl("step", "--optimizer=sgd", "--grad_multiplier=2", server=s).stdout
        assert re.search(r"version \d+ -> \d+, grad norm (\S+)", out), out
        stepped_norm = float(re.search(r"grad norm (\S+)", out).group(1))
        err = lossctl("step", "--optimizer=sgd", "--world_size=2", "--rank=2", server=s,
                      expect=2).stderr
        assert "--rank: expected a rank in [0, 2), got 2" in err, err
    g1, g2 = np.load(tmp_path / "g1.npy"), np.load(tmp_path / "g2.npy")
    np.testing.assert_allclose(g2, 0.5 * g1, rtol=1e-5, atol=1e-9)
    assert norm == pytest.approx(np.linalg.norm(g2.astype(np.float64)), rel=1e-5)
    assert stepped_norm == pytest.approx(2 * norm, rel=1e-5)


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


def test_server_help_names_the_program_once_and_ends_well():
    """--help is a request that succeeds: on stdout, status 0, the flags listed under the
    program's name rather than the path of the file that defines them in the build tree."""
    done = subprocess.run([SERVER_BIN, "--help"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done
    first_line = done.stdout.splitlines()[0]
    assert first_line == "lossd_server: linear cross-entropy as a service.", first_line
    assert "Flags from lossd_server:" in done.stdout, done.stdout
    assert "--step_wait_seconds" in done.stdout and "main.cc" not in done.stdout, done.stdout
    assert subprocess.run([SERVER_BIN, "--no_such_flag"], capture_output=True,
                          timeout=600).returncode != 0


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
