"""bench/gpu_peers.py run on the CPU with small shapes: every method is reported for both passes,
the engine first, the chunked torch peer agrees with the naive one, the engine's rows come from
engine_bench, and a peer that fails (in its calls or while it is made), runs out of memory, runs
past its own deadline or comes after the run's is recorded as such while the others, the engine
included, are still timed; --methods picks the methods."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))
import gpu_peers  # noqa: E402

PEERS = {"floor", "torch_naive", "torch_chunked", "torch_compiled", "torch_lce", "liger", "cce"}


def cpu_argv(out, shapes="300,64,1000", budgets="1,2", extra=()):
    # N = 300 with 128-row chunks: three chunks, the last partial; budgets of 1 and 2 MiB: two
    # engine rows per pass, several token chunks each.
    return ["--device=cpu", "--dtype=fp32", f"--shapes={shapes}", "--chunk-rows=128",
            f"--budgets-mib={budgets}", "--reps=2", "--warmup=1",
            f"--engine-bench={os.environ['ENGINE_BENCH_BIN']}", f"--out={out}", *extra]


def read_entries(out):
    return [json.loads(line) for line in open(out / "results.jsonl")]


def test_cpu_run_reports_every_method_for_both_passes(tmp_path):
    # N = 1: one row.
    subprocess.run([sys.executable, os.path.join(REPO, "bench", "gpu_peers.py"),
                    *cpu_argv(tmp_path, shapes="300,64,1000;1,32,517")],
                   check=True, capture_output=True)
    entries = read_entries(tmp_path)
    # The engine is timed before any peer, of each shape.
    assert [e["method"] for e in entries[:4]] == ["lossd_1MiB"] * 2 + ["lossd_2MiB"] * 2
    for n in (300, 1):
        for pass_name in ("fwd_bwd", "fwd"):
            rows = {e["method"]: e for e in entries if e["n"] == n and e["pass"] == pass_name}
            assert set(rows) == PEERS | {"lossd_1MiB", "lossd_2MiB"}
            for method in ("floor", "torch_naive", "torch_chunked", "lossd_1MiB", "lossd_2MiB"):
                row = rows[method]
                assert row["min_seconds"] <= row["seconds"] <= row["max_seconds"], method
                assert row["wall_seconds"] > 0 and row["reps"] == 2, method
                assert row["tflops"] > 0, method
            assert rows["torch_naive"]["ratio_to_floor"] > 0
            assert rows["torch_chunked"]["loss_rel_diff"] < 1e-6
            if pass_name == "fwd_bwd":
                assert rows["torch_chunked"]["grad_hidden_rel_diff"] < 1e-5
            else:
                assert "grad_hidden_rel_diff" not in rows["torch_chunked"]
            assert rows["lossd_1MiB"]["peak_extra_bytes"] <= 1 << 20
            assert rows["lossd_2MiB"]["peak_extra_bytes"] <= 2 << 20
            assert rows["liger"]["error"] == "unavailable: needs a CUDA device"
            if not hasattr(torch, "compile"):
                assert rows["torch_compiled"]["error"].startswith("unavailable: torch ")
    report = (tmp_path / "results.md").read_text()
    assert "| 300, 64, 1000 | fwd_bwd | torch_chunked |" in report
    assert "| 1, 32, 517 | fwd | lossd_2MiB |" in report
    # lossd's chunking in its own column: rows per chunk, and its vocabulary tile where it tiles.
    header = next(line for line in report.splitlines() if line.startswith("| N, H, V |"))
    for line in report.splitlines():
        if line.startswith("| 300, 64, 1000 | fwd_bwd | lossd_1MiB |"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            assert len(cells) == header.count("|") - 1
            chunk = next(e["chunk"] for e in entries if e["method"] == "lossd_1MiB"
                         and e["n"] == 300 and e["pass"] == "fwd_bwd")
            rows_cell = cells[header.strip("|").split("|").index(" rows ")]
            assert rows_cell.split(" x ")[0] == str(chunk["tokens"])
            assert (" x " in rows_cell) == (chunk["vocab"] < 1000)
    assert report.startswith("Device: cpu\n")
    assert "Command: `bench/gpu_peers.py --device=cpu" in report


def test_failing_peers_are_recorded_and_the_others_and_the_engine_still_run(tmp_path,
                                                                            monkeypatch):
    real_methods = gpu_peers.peer_methods

    def with_failing_peers(device, chunk_rows):
        methods = real_methods(device, chunk_rows)
        calls = {"n": 0}

        def fails_on_its_second_call(h, weight, labels):
            calls["n"] += 1
            if calls["n"] == 2:
                raise ValueError("kernel launch failed\nsecond line of the message")
            return gpu_peers.naive_loss(h, weight, labels)

        def out_of_memory(h, weight, labels):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64 GiB")

        def stuck(h, weight, labels):
            time.sleep(30)

        # Before torch_chunked, so that the methods after them must still run.
        ordered = {"floor": methods.pop("floor"), "torch_naive": methods.pop("torch_naive"),
                   "flaky": fails_on_its_second_call, "greedy": out_of_memory, "stuck": stuck}
        ordered.update(methods)
        return ordered

    monkeypatch.setattr(gpu_peers, "peer_methods", with_failing_peers)
    monkeypatch.setattr(gpu_peers, "METHODS", gpu_peers.METHODS + ("flaky", "greedy", "stuck"))
    gpu_peers.main(cpu_argv(tmp_path, budgets="1", extra=["--passes=fwd_bwd",
                                                          "--peer-seconds=3"]))
    rows = {e["method"]: e for e in read_entries(tmp_path)}
    assert rows["flaky"]["error"] == "failed: ValueError: kernel launch failed"
    assert rows["greedy"]["error"] == "out of memory"
    assert rows["stuck"]["error"] == "timeout: past its 3 s deadline"
    assert rows["torch_chunked"]["seconds"] > 0
    assert rows["lossd_1MiB"]["seconds"] > 0
    assert "| flaky | failed: ValueError: kernel launch failed |" in (
        tmp_path / "results.md").read_text()


def test_a_peer_that_fails_while_it_is_made_is_recorded(tmp_path, monkeypatch):
    def broken_triton():
        raise RuntimeError("Triton does not know this GPU\nmore")

    monkeypatch.setattr(gpu_peers, "make_torch_lce", broken_triton)
    gpu_peers.main(cpu_argv(tmp_path, budgets="1", extra=["--passes=fwd"]))
    rows = {e["method"]: e for e in read_entries(tmp_path)}
    assert rows["torch_lce"]["error"] == "failed: RuntimeError: Triton does not know this GPU"
    assert rows["torch_chunked"]["seconds"] > 0 and rows["lossd_1MiB"]["seconds"] > 0


def test_methods_picks_what_runs(tmp_path):
    gpu_peers.main(cpu_argv(tmp_path, budgets="1,default",
                            extra=["--passes=fwd", "--methods=lossd,floor",
                                   "--lossd-modes=default,exact"]))
    entries = read_entries(tmp_path)
    assert [e["method"] for e in entries] == ["lossd_1MiB", "lossd_1MiB_exact", "lossd_default",
                                              "lossd_default_exact", "floor"]
    assert {e["host_memory"] for e in entries[:4]} == {"server"}
    assert entries[2]["budget_bytes"] >= 256 << 20  # the CPU's default budget
    report = (tmp_path / "results.md").read_text()
    assert "| 300, 64, 1000 | fwd | lossd_default_exact |" in report
    # The engine ran before the floor; its ratio to it is taken in the report.
    floor = entries[4]["seconds"]
    line = next(row for row in report.splitlines() if "| lossd_1MiB |" in row)
    assert f"| {entries[0]['seconds'] / floor:.2f} |" in line


def test_the_pageable_mode_gives_the_engine_plain_memory(tmp_path):
    gpu_peers.main(cpu_argv(tmp_path, budgets="1", extra=["--passes=fwd", "--methods=lossd",
                                                          "--lossd-modes=default,pageable"]))
    entries = read_entries(tmp_path)
    assert [(e["method"], e["host_memory"]) for e in entries] == [
        ("lossd_1MiB", "server"), ("lossd_1MiB_pageable", "pageable")]
    assert all(e["seconds"] > 0 for e in entries)


def test_the_chunks_mode_plans_the_engine_without_windows(tmp_path):
    # A wrapper that notes the engine process's LOSSD_CUDA_WINDOWS, then runs engine_bench.
    wrapper = tmp_path / "engine_bench"
    wrapper.write_text("#!/bin/sh\n"
                       f"echo \"${{LOSSD_CUDA_WINDOWS-unset}}\" >> {tmp_path}/windows.txt\n"
                       f"exec {os.environ['ENGINE_BENCH_BIN']} \"$@\"\n")
    wrapper.chmod(0o755)
    gpu_peers.main(cpu_argv(tmp_path, budgets="1", extra=["--passes=fwd", "--methods=lossd",
                                                          "--lossd-modes=default,chunks",
                                                          f"--engine-bench={wrapper}"]))
    entries = read_entries(tmp_path)
    assert [e["method"] for e in entries] == ["lossd_1MiB", "lossd_1MiB_chunks"]
    assert all(e["seconds"] > 0 for e in entries)
    assert (tmp_path / "windows.txt").read_text().split() == ["unset", "0"]


def test_peers_past_the_deadline_are_skipped_but_the_engine_is_timed(tmp_path):
    gpu_peers.main(cpu_argv(tmp_path, budgets="1", extra=["--deadline-seconds=0"]))
    for row in read_entries(tmp_path):
        if row["method"] == "lossd_1MiB":
            assert row["seconds"] > 0
        elif row["method"] in ("floor", "torch_naive", "torch_chunked"):
            assert row["error"] == "skipped: the run's 0 s were spent"


def test_an_engine_that_fails_is_recorded(tmp_path):
    gpu_peers.main(cpu_argv(tmp_path, budgets="1", extra=["--passes=fwd",
                                                          "--engine-bench=/bin/false"]))
    rows = {e["method"]: e for e in read_entries(tmp_path)}
    assert rows["lossd_1MiB"]["error"] == "failed: exit status 1"
    assert rows["torch_naive"]["seconds"] > 0


@pytest.mark.parametrize("flag, message", [
    ("--shapes=300,64", "--shapes: expected positive N,H,V triples separated by ';', got '300,64'"),
    ("--budgets-mib=1,x",
     "--budgets-mib: expected positive integers or 'default' separated by ',', got '1,x'"),
    ("--methods=lossd,torch", "--methods: expected a comma-separated subset of lossd, floor, "
     "torch_naive, torch_chunked, torch_lce, liger, cce, torch_compiled, got 'lossd,torch'"),
    ("--passes=bwd", "--passes: expected fwd_bwd, fwd or both, got 'bwd'"),
    ("--lossd-modes=fast",
     "--lossd-modes: expected a comma-separated subset of default, exact, pageable, chunks, got "
     "'fast'"),
])
def test_bad_flags_are_named(tmp_path, flag, message):
    done = subprocess.run([sys.executable, os.path.join(REPO, "bench", "gpu_peers.py"),
                           "--device=cpu", flag, f"--out={tmp_path}"],
                          capture_output=True, text=True)
    assert done.returncode != 0
    assert message in done.stderr
