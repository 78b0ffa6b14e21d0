"""scripts/gpu_round.sh without a GPU. Its failures before it touches one: a missing or unknown
call is a usage error, and without .gpu/ (git-ignored, so absent on a GPU machine unless its tool
carried it) a call stops at once saying how to bring it. And a dry run of each call of the
runbook on fakes (nvidia-smi, compute-sanitizer, the packed programs, the benchmark scripts, an xz
that is not there): every check runs in the runbook's order and passes, each call writes only
its summary and archive under its own OUT subfolder, within the device tool's limits on what comes
back, and the planned time of each call fits the timeout_s its runbook entry gives."""
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "gpu_round.sh")


@pytest.fixture
def bare_checkout(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts")
    return tmp_path


def run(checkout, *args, env=None, timeout=600):
    return subprocess.run([str(checkout / "scripts" / "gpu_round.sh"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd="/",
                          env=env or dict(os.environ, OUT=str(checkout / "out")))


@pytest.mark.parametrize("args", [(), ("everything",), ("tests",)])
def test_a_call_must_be_named(bare_checkout, args):
    done = run(bare_checkout, *args)
    assert done.returncode == 2
    assert "usage: scripts/gpu_round.sh call1|call2|bench [check ...]" in done.stderr


@pytest.mark.parametrize("call", ["call1", "call2", "bench"])
def test_without_gpu_folder_a_call_says_to_carry_it(bare_checkout, call):
    done = run(bare_checkout, call)
    assert done.returncode == 2
    assert ".gpu/lossd-gpu.tar.xz is missing" in done.stderr
    assert 'carry: [".gpu"]' in done.stderr
    assert "scripts/gpu_pack.sh" in done.stderr
    assert not (bare_checkout / "out").exists()


# ---- The dry run ------------------------------------------------------------------------------

def executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


# A packed GoogleTest program: passes its tests, writes the JUnit file it is asked for, and says
# which filter it ran with.
FAKE_GTEST = """#!/bin/sh
for arg in "$@"; do
  case "$arg" in
    --gtest_output=xml:*) echo '<testsuites tests="2"/>' >"${arg#--gtest_output=xml:}" ;;
    --gtest_filter=*) echo "filter ${arg#--gtest_filter=}" ;;
  esac
done
echo "[==========] 2 tests from 1 test suite ran. (5 ms total)"
echo "[  PASSED  ] 2 tests."
"""

FAKE_PROBE = FAKE_GTEST.replace(
    'echo "[  PASSED', 'echo "bf16 GEMM dA W (blocks of 16k) on fake: K = 128256"\necho "[  PASSED')

# The server: a module built for other GPUs is refused at start, as the real one refuses it.
FAKE_SERVER = """#!/bin/sh
if [ -n "${LOSSD_CUDA_MODULE:-}" ]; then
  echo "lossd_server: FakeGPU (sm_90) cannot run this CUDA module, built for architectures 100-real"
  exit 1
fi
echo "serving gRPC on 127.0.0.1:1 (port 1)"
"""

# compute-sanitizer: runs the program (its kernel filter in SANITIZER_KERNEL_NAME), reports no
# error and exits as the program did.
FAKE_SANITIZER = """#!/bin/sh
while [ $# -gt 0 ]; do
  case "$1" in
    --kernel-name) export SANITIZER_KERNEL_NAME="$2"; shift 2 ;;
    --tool|--error-exitcode|--target-processes) shift 2 ;;
    *) break ;;
  esac
done
"$@"
status=$?
echo "========= ERROR SUMMARY: 0 errors"
exit $status
"""

# Nsight Compute: writes one kernel's row where --log-file says and runs the program.
FAKE_NCU = """#!/bin/sh
log=""
while [ $# -gt 0 ]; do
  case "$1" in
    --log-file) log="$2"; shift 2 ;;
    --clock-control|--target-processes|--metrics|--page) shift 2 ;;
    --csv) shift ;;
    *) break ;;
  esac
done
printf '"ID","Kernel Name","gpu__time_duration.sum"\n"","","us"\n"0","lossd::RowStatsKernel(float*)","1,500"\n' >"$log"
"$@"
"""

FAKE_NVIDIA_SMI = """#!/bin/sh
case "$*" in
  *--query-gpu*) echo "NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04" ;;
  *) echo "Fake NVIDIA-SMI 580.159.04" ;;
esac
"""

# python3: the benchmark scripts write a row and a table where --out says; anything else goes to
# the real interpreter (gpu_round.sh uses it to unpack wheels and, without xz, the archive).
FAKE_PYTHON = """#!/bin/sh
case "$1" in
  bench/gpu_peers.py|bench/gpu_service.py|bench/transport_bench.py)
    script="$1"
    out=""
    for arg in "$@"; do
      case "$arg" in --out=*) out="${arg#--out=}" ;; esac
    done
    previous=""
    for arg in "$@"; do
      [ "$previous" = "--out" ] && out="$arg"
      previous="$arg"
    done
    mkdir -p "$out"
    echo "$script $*" >"$out/argv.txt"
    echo '{"method": "lossd_default", "pass": "fwd_bwd", "seconds": 0.04}' >"$out/results.jsonl"
    printf '| N, H, V | pass | method |\\n| 16384, 4096, 128256 | fwd_bwd | lossd_default |\\n' \\
      >"$out/results.md"
    ;;
  *) exec REAL_PYTHON "$@" ;;
esac
"""


def add_file(archive, name, text, mode=0o755):
    data = text.encode()
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    archive.addfile(info, io.BytesIO(data))


@pytest.fixture
def dry_run(tmp_path):
    """A checkout with a fake .gpu/, a PATH of fakes, and the environment to run it with."""
    checkout = tmp_path / "checkout"
    shutil.copytree(os.path.join(REPO, "scripts"), checkout / "scripts")
    (checkout / "bench").mkdir()
    (checkout / ".gpu" / "wheels" / "peers").mkdir(parents=True)
    (checkout / ".gpu" / "wheels" / "grpc").mkdir(parents=True)
    with tarfile.open(checkout / ".gpu" / "lossd-gpu.tar.xz", "w:xz") as archive:
        add_file(archive, "MANIFEST.txt",
                 "commit 0123abc\nglibc_needed 2.34\nglibcxx_needed GLIBCXX_3.4.29\n"
                 "cublas_sonames libcublas.so.13 libcublasLt.so.13\n", 0o644)
        for program in ("engine_test", "device_fault_test", "engine_bench", "distill_bench",
                        "lossctl"):
            add_file(archive, f"bin/{program}", FAKE_GTEST)
        add_file(archive, "bin/cuda_gemm_probe_test", FAKE_PROBE)
        add_file(archive, "bin/lossd_server", FAKE_SERVER)
        add_file(archive, "bin/liblossd_cuda.so", "not a library", 0o644)
        add_file(archive, "sm100/liblossd_cuda.so", "not a library", 0o644)
        add_file(archive, "python/lossd/__init__.py", "", 0o644)
    fakes = tmp_path / "fakes"
    fakes.mkdir()
    executable(fakes / "nvidia-smi", FAKE_NVIDIA_SMI)
    executable(fakes / "compute-sanitizer", FAKE_SANITIZER)
    executable(fakes / "ncu", FAKE_NCU)
    executable(fakes / "python3", FAKE_PYTHON.replace("REAL_PYTHON", sys.executable))
    executable(fakes / "xz", "#!/bin/sh\necho 'xz: not installed here' >&2\nexit 127\n")
    cublas = tmp_path / "cublas"
    cublas.mkdir()
    (cublas / "libcublas.so.13").write_text("")
    env = dict(os.environ, OUT=str(tmp_path / "out"), LOSSD_GPU_LIBRARY_DIRS=str(cublas),
               PATH=f"{fakes}:{os.environ['PATH']}")
    return checkout, env, tmp_path / "out"


def runbook(call):
    """The command, carry and timeout_s the runbook at the top of gpu_round.sh gives a call."""
    header = open(SCRIPT).read().split("\nset -uo pipefail")[0]
    entry = re.search(rf"^# +command: +(scripts/gpu_round.sh {call})$.*?^# +carry: +(.+?)$"
                      r".*?^# +timeout_s: +(\d+)$", header, re.S | re.M)
    assert entry, f"no runbook entry for {call}"
    return entry.group(1).strip(), json.loads(entry.group(2)), int(entry.group(3))


def checks_of(summary):
    return [line.split()[1] for line in summary.splitlines()
            if re.match(r"^(PASS|FAIL|TIME|SKIP) ", line)]


@pytest.mark.parametrize("call, checks", [
    ("call1", ["table", "probe", "foreign", "scale", "peers", "memcheck", "profile",
               "profile_fwd"]),
    ("call2", ["fault", "fault_drain", "racecheck", "synccheck", "initcheck", "service",
               "transport_floor", "transport"]),
    ("bench", ["peers"]),
])
def test_dry_run_of_a_call(dry_run, call, checks):
    checkout, env, out = dry_run
    command, carry, timeout_s = runbook(call)
    assert command == f"scripts/gpu_round.sh {call}"
    assert carry == [".gpu"]
    done = subprocess.run(command.split(), capture_output=True, text=True, timeout=120,
                          cwd=checkout, env=env)
    assert done.returncode == 0, done.stdout + done.stderr

    # Only this call's folder, holding its summary and its archive: 2 of the 8 files that come
    # back, 2 folders down at most.
    assert sorted(os.listdir(out)) == [call]
    assert sorted(os.listdir(out / call)) == sorted([f"{call}.tar.gz", "summary.txt"])
    summary = (out / call / "summary.txt").read_text()
    assert summary == done.stdout[:len(summary)]
    assert checks_of(summary) == checks
    assert f"RESULT: {call} PASS" in summary
    assert "unpack: python3's lzma (xz failed)" in summary

    # The plan fits the call: the checks' limits, the setup and the archive within the call's
    # own time, and that within the timeout_s of its runbook entry.
    plan = re.search(r"plan: .*?; (\d+) s of checks within the call's (\d+) s", summary)
    planned, call_seconds = int(plan.group(1)), int(plan.group(2))
    assert planned + 30 <= call_seconds
    assert call_seconds + 25 <= timeout_s
    assert timeout_s <= (300 if call == "call2" else 540)

    with tarfile.open(out / call / f"{call}.tar.gz") as archive:
        names = archive.getnames()
    for check in checks:
        assert f"{call}/{check}.log" in names, check
    assert f"{call}/summary.txt" in names and f"{call}/MANIFEST.txt" in names

    if call == "call1":
        with tarfile.open(out / call / f"{call}.tar.gz") as archive:
            table = archive.extractfile("call1/table.log").read().decode()
            peers = archive.extractfile("call1/peers/argv.txt").read().decode()
        assert "filter *cuda*:-*AtScale*" in table
        assert "--shapes=16384,4096,128256" in peers and "--lossd-modes=default,exact,pageable" in peers
        assert "bench/gpu_peers.py 16384,4096,128256: 1 rows, 0 failed" in summary
        assert "a module for sm_100 only is refused at start" in summary
        assert "1.50 ms     1x  lossd::RowStatsKernel" in summary
    if call == "bench":
        with tarfile.open(out / call / f"{call}.tar.gz") as archive:
            peers = archive.extractfile("bench/peers/argv.txt").read().decode()
        assert "--shapes=8192,4096,128256;16384,4096,128256;8192,2304,256000" in peers
        assert "--budgets-mib=default,1024,2048" in peers
        assert "--lossd-modes=default,chunks " in peers and "torch_lce" in peers


def test_dry_run_of_named_checks_only(dry_run):
    checkout, env, out = dry_run
    done = subprocess.run(["scripts/gpu_round.sh", "call1", "probe", "foreign"],
                          capture_output=True, text=True, timeout=60, cwd=checkout, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (out / "call1" / "summary.txt").read_text()
    assert checks_of(summary) == ["probe", "foreign"]
    assert "40 s of checks" in summary


def test_a_skipped_gpu_test_fails_the_check_with_its_reason(dry_run):
    checkout, env, out = dry_run
    skipping = FAKE_GTEST.replace(
        'echo "[  PASSED  ] 2 tests."',
        'echo "tests/engine_test.cc:492: Skipped"\n'
        'echo "cuda backend not available: UNAVAILABLE: no GPU found (no NVIDIA driver)"\n'
        'echo "[  PASSED  ] 1 test."\necho "[  SKIPPED ] 1 test, listed below:"')
    replace_program(checkout, "engine_test", skipping)
    done = subprocess.run(["scripts/gpu_round.sh", "call1", "table"], capture_output=True,
                          text=True, timeout=60, cwd=checkout, env=env)
    assert done.returncode != 0
    summary = (out / "call1" / "summary.txt").read_text()
    assert ("FAIL table" in summary and "a GPU test skipped: cuda backend not available: "
            "UNAVAILABLE: no GPU found (no NVIDIA driver)" in summary)


def replace_program(checkout, name, text):
    """Puts `text` in the packed archive as bin/`name`."""
    archive_path = checkout / ".gpu" / "lossd-gpu.tar.xz"
    with tarfile.open(archive_path) as archive:
        members = [(m, archive.extractfile(m).read() if m.isfile() else None)
                   for m in archive.getmembers()]
    with tarfile.open(archive_path, "w:xz") as archive:
        for member, data in members:
            if member.name == f"bin/{name}":
                data = text.encode()
                member.size = len(data)
            archive.addfile(member, io.BytesIO(data) if data is not None else None)


# engine_test as a device fault leaves it: the first test faults (the sanitizer failing to handle
# the exception), every later CUDA test of the process skips; run without the faulting test, the
# others pass. WATCHED, when set, is the only kernel filter under which the test faults.
FAULTING_GTEST = """#!/bin/sh
filter=""
for arg in "$@"; do
  case "$arg" in --gtest_filter=*) filter="${arg#--gtest_filter=}" ;; esac
done
echo "filter $filter"
if [ -n "${WATCHED:-}" ] && [ "${SANITIZER_KERNEL_NAME:-}" != "$WATCHED" ]; then
  filter="${filter#*faults_first}"
fi
case "$filter" in
  *faults_first*)
    echo "[ RUN      ] Cases/T.faults_first"
    echo "========= Internal Sanitizer Error: The Sanitizer failed to handle a hardware exception."
    echo "UNAVAILABLE: device fault: cudaStreamSynchronize: cudaErrorIllegalAddress"
    echo "[  FAILED  ] Cases/T.faults_first (5 ms)"
    for t in later_a later_b; do
      echo "[ RUN      ] Cases/T.$t"
      echo "cuda backend not available: UNAVAILABLE: cuda:0 (device fault: cudaErrorIllegalAddress)"
      echo "[  SKIPPED ] Cases/T.$t (0 ms)"
    done
    echo "[  SKIPPED ] 2 tests, listed below:"
    echo "[  SKIPPED ] Cases/T.later_a"
    echo "[  SKIPPED ] Cases/T.later_b"
    echo "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)"
    exit 3 ;;
esac
echo "[  PASSED  ] 2 tests."
"""


def run_faulting_racecheck(dry_run, watched=""):
    checkout, env, out = dry_run
    replace_program(checkout, "engine_test", FAULTING_GTEST)
    env = dict(env, LOSSD_GPU_SANITIZER_CASES="*faults_first:*later_a:*later_b", WATCHED=watched)
    done = subprocess.run(["scripts/gpu_round.sh", "call2", "racecheck"], capture_output=True,
                          text=True, timeout=60, cwd=checkout, env=env)
    summary = (out / "call2" / "summary.txt").read_text()
    line = next(x for x in summary.splitlines() if " racecheck " in x)
    with tarfile.open(out / "call2" / "call2.tar.gz") as archive:
        log = archive.extractfile("call2/racecheck.log").read().decode()
    return done, line, log


def test_a_device_fault_under_a_sanitizer_reruns_the_tests_it_skipped(dry_run):
    """The tests a fault skipped run again in a process of their own; a fault the sanitizer meets
    also when it watches no kernel is its own, and passes, said so."""
    done, line, log = run_faulting_racecheck(dry_run)
    assert done.returncode == 0, done.stdout + done.stderr
    assert line.startswith("PASS racecheck")
    assert "2 round(s)" in line
    assert ("device fault in: Cases/T.faults_first (the sanitizer failed to handle a hardware "
            "exception)") in line
    assert "the sanitizer's own fault: it fails in the same tests watching no kernel" in line
    assert "---- round 2: Cases/T.later_a:Cases/T.later_b" in log
    assert "filter Cases/T.later_a:Cases/T.later_b" in log
    assert "---- watching no kernel: Cases/T.faults_first" in log


def test_a_fault_only_while_lossd_kernels_are_watched_fails_the_check(dry_run):
    """A fault that goes away when racecheck watches no kernel may be lossd's: the check fails."""
    done, line, log = run_faulting_racecheck(dry_run, watched="kns=lossd")
    assert done.returncode != 0
    assert line.startswith("FAIL racecheck")
    assert "watching no kernel it failed in 0 of those tests" in line
    assert "---- watching no kernel: Cases/T.faults_first" in log
