"""bench/distill_peers.py run on the CPU with small shapes: every method is reported, the chunked
torch peer agrees with the naive one, and the engine (distill_bench) computes on the same inputs
as torch: its loss and dL/dh agree with torch's two-logits implementation."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(tmp_path, *flags):
    return subprocess.run([sys.executable, os.path.join(REPO, "bench", "distill_peers.py"),
                           "--device=cpu", "--dtype=fp32", *flags,
                           f"--distill-bench={os.environ['DISTILL_BENCH_BIN']}",
                           f"--out={tmp_path}"], capture_output=True, text=True)


def test_cpu_run_reports_every_method(tmp_path):
    # N = 300 with 128-row chunks: three chunks, the last partial; the teacher's H differs; a
    # 1 MiB budget splits the engine's call too. N = 1: one row.
    done = run(tmp_path, "--shapes=300,64,48,1000;1,32,40,517", "--chunk-rows=128",
               "--budget-mib=1", "--reps=1", "--warmup=1", "--beta=0.3")
    assert done.returncode == 0, done.stderr
    entries = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    for n in (300, 1):
        rows = {e["method"]: e for e in entries if e["n"] == n}
        assert set(rows) == {"floor", "torch_naive", "torch_chunked", "liger", "engine"}
        for method in ("floor", "torch_naive", "torch_chunked", "engine"):
            assert rows[method]["seconds"] > 0, method
            assert rows[method]["ratio_to_torch_naive"] > 0, method
        assert rows["torch_chunked"]["loss_rel_diff"] < 1e-6
        assert rows["torch_chunked"]["grad_hidden_rel_diff"] < 1e-5
        assert rows["engine"]["loss_rel_diff"] < 1e-5
        assert rows["engine"]["grad_hidden_rel_diff"] < 2e-5
        assert rows["engine"]["peak_extra_bytes"] <= 1 << 20
        assert rows["liger"]["error"] == "unavailable: needs a CUDA device"
    assert "| 300, 64, 48, 1000 | engine |" in (tmp_path / "results.md").read_text()


def test_bad_shape_is_named(tmp_path):
    done = run(tmp_path, "--shapes=300,64,1000")
    assert done.returncode != 0
    assert ("--shapes: expected positive N,H,H_t,V quadruples separated by ';', got '300,64,1000'"
            in done.stderr)
