"""scripts/gpu_round.sh's failures before it touches a GPU, in a copy of the scripts folder: a
missing or unknown step is a usage error, and without .gpu/ (git-ignored, so absent on a GPU
machine unless its tool carried it) a step stops at once saying how to bring it."""
import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def bare_checkout(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(os.path.join(REPO, "scripts", "gpu_round.sh"), tmp_path / "scripts")
    return tmp_path


def run(checkout, *args):
    return subprocess.run([str(checkout / "scripts" / "gpu_round.sh"), *args],
                          capture_output=True, text=True, timeout=600, cwd="/",
                          env=dict(os.environ, OUT=str(checkout / "out")))


@pytest.mark.parametrize("args", [(), ("everything",)])
def test_a_step_must_be_named(bare_checkout, args):
    done = run(bare_checkout, *args)
    assert done.returncode == 2
    assert "usage: scripts/gpu_round.sh tests|bench|service [check ...]" in done.stderr


@pytest.mark.parametrize("step", ["tests", "bench", "service"])
def test_without_gpu_folder_a_step_says_to_carry_it(bare_checkout, step):
    done = run(bare_checkout, step)
    assert done.returncode == 2
    assert ".gpu/lossd-gpu.tar.xz is missing" in done.stderr
    assert 'carry: [".gpu"]' in done.stderr
    assert "scripts/gpu_pack.sh" in done.stderr
    assert not (bare_checkout / "out").exists()
