"""engine_bench's reports: the comparison of the engine with the naive baseline round by round,
checked against the rounds' own times as it reports them (rounds won, median ratio and the sign
test's tail), the useful flops it credits each pass with, and the gradient mode it passes on."""
import json
import math
import os
import statistics
import subprocess


def test_paired_comparison_follows_the_round_times():
    rounds = 7
    done = subprocess.run([os.environ["ENGINE_BENCH_BIN"], "--shapes=96,64,1000;1,64,517",
                           f"--reps={rounds}", "--rep-seconds=100"],
                          check=True, capture_output=True, text=True)
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    compared = 0
    for engine in (e for e in lines if e["method"].startswith("engine_")):
        naive = next(e for e in lines if e["shape"] == engine["shape"]
                     and e["method"] == engine["method"].replace("engine_", "naive_"))
        pairs = list(zip(engine["round_seconds"], naive["round_seconds"]))
        assert len(pairs) == rounds
        paired = engine["paired_to_naive"]
        won = sum(e < n for e, n in pairs)
        assert paired["rounds"] == rounds
        assert paired["faster_rounds"] == won
        assert math.isclose(paired["median_ratio"], statistics.median(e / n for e, n in pairs),
                            rel_tol=1e-12)
        tail = sum(math.comb(rounds, k) for k in range(won, rounds + 1)) / 2 ** rounds
        assert math.isclose(paired["sign_test_p"], tail, rel_tol=1e-12)
        assert "paired_to_naive" not in naive
        compared += 1
    assert compared == 4  # two shapes, forward and forward+backward
    assert f"of {rounds} (sign test p" in done.stderr


def test_frozen_head_pass_counts_two_gemms_of_useful_work():
    # fwd_dh is a call that wants dL/dh but not dL/dW: 4NHV useful flops for every method, and the
    # engine's dL/dh must still agree with the naive baseline's (else the exit status is 1).
    n, h, v = 96, 64, 1000
    done = subprocess.run([os.environ["ENGINE_BENCH_BIN"], f"--shapes={n},{h},{v}",
                           "--passes=fwd_dh", "--reps=2"],
                          check=True, capture_output=True, text=True)
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert sorted(e["method"] for e in lines) == ["engine_fwd_dh", "floor_fwd_dh", "naive_fwd_dh"]
    for e in lines:
        assert math.isclose(e["gflops"] * 1e9 * e["seconds"], 4.0 * n * h * v, rel_tol=1e-9)
    assert "agree" in done.stderr


def test_gradient_mode_is_a_flag_and_is_reported():
    # On the CPU both modes compute exact fp32 gradients; the flag reaches LossOptions and the
    # report either way, and a mode it does not know is named.
    done = subprocess.run([os.environ["ENGINE_BENCH_BIN"], "--shapes=96,64,1000", "--reps=1",
                           "--methods=engine", "--passes=fwd_bwd", "--gradients=exact"],
                          check=True, capture_output=True, text=True)
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [e["gradients"] for e in lines] == ["exact"]
    # The CPU has no device clock: wall time only.
    assert "device_seconds" not in lines[0]
    bad = subprocess.run([os.environ["ENGINE_BENCH_BIN"], "--gradients=fast"],
                         capture_output=True, text=True)
    assert bad.returncode == 1
    assert "--gradients: expected default or exact, got 'fast'" in bad.stderr
