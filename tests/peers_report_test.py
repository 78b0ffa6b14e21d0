"""bench/peers.py's report: each target is judged from the run's own figures, and a run's
results.md can be written anew from its raw results."""
import copy
import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20
_spec = importlib.util.spec_from_file_location("peers", os.path.join(REPO, "bench", "peers.py"))
peers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peers)


def sweep_entries(v, h, n, seconds, engine_extra_mib=300, chunk_rows=512):
    """One shape's methods as peers.py records them; `seconds` by method."""
    tensors = 4 * (2 * n * h + 2 * v * h)
    entries = []
    for method, s in seconds.items():
        entry = {"v": v, "h": h, "n": n, "method": method, "tensor_bytes": tensors,
                 "peak_rss_bytes": tensors + 200 * MIB}
        if s is None:
            entry["error"] = "out of memory"
        else:
            entry["seconds"] = s
        if method == "engine":
            entry["peak_rss_bytes"] = tensors + engine_extra_mib * MIB
            entry["chunk"] = {"tokens": min(n, chunk_rows), "vocab": v}
        if method.startswith("remote_"):
            ratio = s / seconds["engine"]
            entry.update(ratio_to_in_process=ratio, round_ratios=[ratio],
                         server_compute_seconds=seconds["engine"])
        entries.append(entry)
    return entries


def good_run():
    """Two vocabularies, every target met: the shapes the tests below spoil one at a time."""
    times = {"torch_naive": 3.0, "torch_chunked": 3.2, "torch_compiled": 3.1, "torch_native": 2.9,
             "torch_floor": 2.35, "engine": 2.5, "floor": 2.4, "remote_cpp": 2.6,
             "remote_python": 2.7}
    entries = (sweep_entries(32000, 64, 256, times) + sweep_entries(32000, 64, 1024, times) +
               sweep_entries(32000, 64, 4096, dict(times, torch_naive=None)) +
               sweep_entries(128256, 64, 512, times))
    entries += [
        {"method": "transport", "dtype": "float32", "streams": 1, "n": 16, "seconds": 1.0,
         "in_gbps": 0.3, "out_gbps": 0.3},
        {"method": "transport_shm", "dtype": "float32", "streams": 1, "n": 16, "seconds": 0.1,
         "in_gbps": 1.9, "out_gbps": 1.8},
        {"method": "memcpy", "gbps": 16.0}]
    return entries


def targets(entries):
    """The target lines by their first words."""
    lines = [line for line in peers.target_lines(entries) if line.startswith("- ")]
    return {line.split(" at every shape")[0].split(" at least")[0].split(" flat")[0][2:]: line
            for line in lines}


def spoil(entries, v, n, method, **changes):
    entries = copy.deepcopy(entries)
    (entry,) = [e for e in entries if e.get("v") == v and e.get("n") == n and e["method"] == method]
    entry.update(changes)
    return entries


def test_a_run_meeting_every_target_says_so():
    lines = targets(good_run())
    assert len(lines) == 8, lines
    for line in lines.values():
        assert "**met**" in line, line
    # A peer that ran out of memory is named, not counted as a loss or a win.
    assert "out of memory at V = 32000, N = 4096" in lines["Engine faster than torch_naive"]


# Each case breaks one target at one shape: the line must say "not met" and name the shape.
@pytest.mark.parametrize("target, v, n, method, changes, named", [
    # The engine slower than the hand-chunked loop at one shape.
    ("Engine faster than torch_chunked", 32000, 1024, "torch_chunked", {"seconds": 2.4},
     "V = 32000, N = 1024 (1.042x)"),
    # A tie is not faster.
    ("Engine faster than torch_naive", 128256, 512, "torch_naive", {"seconds": 2.5},
     "V = 128256, N = 512 (1.000x)"),
    # torch's F.linear_cross_entropy faster than the engine at one shape.
    ("Engine faster than torch_native", 32000, 4096, "torch_native", {"seconds": 2.0},
     "V = 32000, N = 4096 (1.250x)"),
    # torch.compile'd chunks: a tie is not faster.
    ("Engine faster than torch_compiled", 32000, 256, "torch_compiled", {"seconds": 2.5},
     "V = 32000, N = 256 (1.000x)"),
    # 1.2x torch's floor, the faster of the two there (OpenBLAS's is at 1.04x).
    ("Engine within 1.10x of the GEMM floor", 32000, 256, "torch_floor", {"seconds": 2.5 / 1.2},
     "V = 32000, N = 256 (1.200x)"),
    # Past the budget (N >= 512-row chunks) the engine's extra memory grows by 100 MiB.
    ("Engine memory", 32000, 4096, "engine", {"peak_rss_bytes": 4 * (2 * 4096 * 64 + 2 * 32000 * 64)
                                             + 400 * MIB},
     "V = 32000 (grows by 100 MiB)"),
    # One client's median of rounds above 1.10.
    ("Remote Compute within 1.10x of in-process", 128256, 512, "remote_python",
     {"ratio_to_in_process": 1.12}, "V = 128256, N = 512 python (1.120x)"),
])
def test_a_missed_target_names_the_shape(target, v, n, method, changes, named):
    lines = targets(spoil(good_run(), v, n, method, **changes))
    assert "**not met**" in lines[target] and named in lines[target], lines[target]
    # The other targets are still met.
    for other, line in lines.items():
        if other != target:
            assert "**met**" in line, line


def test_memory_below_the_budget_may_differ():
    # N = 256 is below the 512-row chunk: the whole batch is one smaller chunk, and less memory.
    entries = spoil(good_run(), 32000, 256, "engine",
                    peak_rss_bytes=4 * (2 * 256 * 64 + 2 * 32000 * 64) + 100 * MIB)
    assert "**met**" in targets(entries)["Engine memory"]


def test_a_target_without_figures_is_not_met():
    # Every floor run failed: nothing to judge the floor target by.
    entries = [{k: x for k, x in e.items() if k != "seconds"} | {"error": "exit 1"}
               if e["method"] in ("floor", "torch_floor") else e for e in good_run()]
    assert "**not measured**" in targets(entries)["Engine within 1.10x of the GEMM floor"]


def test_the_floor_target_takes_the_faster_floor():
    # OpenBLAS's floor failed at one shape: torch's alone judges it there, and the line says which
    # floor was the faster where.
    entries = spoil(good_run(), 32000, 1024, "floor", seconds=None, error="exit 1")
    line = targets(entries)["Engine within 1.10x of the GEMM floor"]
    assert "**met**" in line and "1.064 to 1.064x" in line, line
    assert "torch_floor 4" in line, line


def test_a_torch_method_missing_from_this_torch_is_named():
    # An older torch without F.linear_cross_entropy: reported, neither a win nor a loss.
    entries = [dict({k: x for k, x in e.items() if k != "seconds"},
                    error="not available: torch 1.13.1 has no F.linear_cross_entropy")
               if e["method"] == "torch_native" else e for e in good_run()]
    line = targets(entries)["Engine faster than torch_native"]
    assert "**not measured**" in line and "not available" in line, line


def test_wire_throughput_below_target():
    entries = [e for e in good_run() if e["method"] != "transport_shm"]
    line = targets(entries)["Wire throughput of one Compute call"]
    assert "**not met** at 0.30 GB/s" in line and "messages, float32, 1 stream" in line, line


def test_report_rewrites_results_md_from_raw_results(tmp_path):
    machine = {"cpu": "Test CPU", "threads": 2, "date": "2026-01-01"}
    with open(tmp_path / "results.jsonl", "w") as f:
        for entry in good_run():
            f.write(json.dumps(dict(entry, machine=machine)) + "\n")
    (tmp_path / "results.md").write_text("# old\n\nCommand: `bench/peers.sh --rounds 9`\n")
    subprocess.run([sys.executable, os.path.join(REPO, "bench", "peers.py"), "--report",
                    str(tmp_path)], check=True, capture_output=True)
    text = (tmp_path / "results.md").read_text()
    assert "Command: `bench/peers.sh --rounds 9`" in text
    assert "| 32000, 64, 1024 | torch_chunked | 3.200 |" in text
    assert "## Against the targets" in text


def test_report_of_an_empty_run_is_refused(tmp_path):
    (tmp_path / "results.jsonl").write_text("")
    done = subprocess.run([sys.executable, os.path.join(REPO, "bench", "peers.py"), "--report",
                           str(tmp_path)], capture_output=True, text=True)
    assert done.returncode != 0
    assert "results.jsonl: expected at least one result" in done.stderr
