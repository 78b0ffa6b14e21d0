"""client/python/examples: the tiny LM trained with a local head and with a RemoteHead agrees,
score_text.py scores a text, and the examples run as their docstrings say, from a checkout whose
build holds the package, showing their progress on a terminal only."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from server_process import ServerProcess, ensure_python_client, run_with_terminal_stderr

ensure_python_client()
import lossd  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "client", "python", "examples"))
import score_text  # noqa: E402
import train_tiny_lm  # noqa: E402

STEPS = 60
# See train_tiny_lm's docstring: 20x the largest difference measured over 60 steps (15 seeds).
MAX_LOSS_DIFFERENCE = 1e-5


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--device=cpu", "--demo_vocab_size=16", "--demo_hidden_size=8",
                       metrics=False) as s:
        yield s


def test_remote_head_training_follows_local_training(server):
    args = train_tiny_lm.parse_args(["--steps", str(STEPS), "--seed", str(os.getpid() % 1000)])
    with lossd.Client(server.address, timeout=600) as client:
        result = train_tiny_lm.compare(args, client)
        assert client.get_head(args.head).steps == STEPS
    assert len(result.remote_losses) == STEPS
    assert result.max_abs_difference < MAX_LOSS_DIFFERENCE, result
    first, last = result.local_losses[0], sum(result.local_losses[-10:]) / 10
    assert first > 5.0 and last < first - 2.5, result


def test_score_text_prints_a_logprob_per_byte(server, capsys):
    text = "the light"
    score_text.main(["--address", server.address, "--text", text, "--train-steps", "5"])
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if "top-3 guesses" in line)
    rows = lines[header + 1:-1]
    assert len(rows) == len(text) - 1
    # Columns: the byte (6 wide), then log p.
    assert all(float(row[6:15]) <= 0 for row in rows), rows
    assert lines[-1].startswith("total log p") and "bits per byte" in lines[-1]


# A few steps of a tiny model: what the docstring's command does, quickly.
SMALL_RUN = ["--steps", "3", "--width", "32", "--layers", "1", "--heads", "2", "--context", "16"]


@pytest.fixture
def checkout(tmp_path):
    """A checkout's layout: the examples, and the build's package in build/python."""
    examples = tmp_path / "client" / "python" / "examples"
    shutil.copytree(os.path.join(REPO, "client", "python", "examples"), examples,
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "build").mkdir()
    os.symlink(os.path.dirname(os.path.dirname(os.path.abspath(lossd.__file__))),
               tmp_path / "build" / "python")
    return examples


def documented_command(server, *extra):
    return ["/usr/bin/python3", "train_tiny_lm.py", "--address", server.address, *SMALL_RUN,
            *extra]


def without_pythonpath():
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_the_documented_command_works_from_a_checkout_with_progress_on_a_terminal(server,
                                                                                   checkout):
    code, out, terminal = run_with_terminal_stderr(documented_command(server), cwd=checkout,
                                                   env=without_pythonpath(), timeout=600)
    assert code == 0, out + terminal
    assert re.search(r"^max \|local - lossd\| over 3 steps: ", out, re.M), out
    for run in ("(A) local head", "(B) lossd head"):
        pattern = rf"\r{re.escape(run)}: step (\d+)/3, loss [\d.]+"
        steps = [int(n) for n in re.findall(pattern, terminal)]
        assert steps == [1, 2, 3], repr(terminal)
    assert terminal.count("\n") == 2, repr(terminal)  # each run's line ends once

    # In a log the progress is plain lines (3 steps: each is a tenth or more of the run).
    piped = subprocess.run(documented_command(server), cwd=checkout, env=without_pythonpath(),
                           capture_output=True, text=True, timeout=600)
    assert piped.returncode == 0 and "max |local - lossd|" in piped.stdout, piped.stderr
    for run in ("(A) local head", "(B) lossd head"):
        lines = re.findall(rf"^{re.escape(run)}: step (\d+)/3, loss [\d.]+$", piped.stderr, re.M)
        assert lines == ["1", "2", "3"], piped.stderr
    assert "\r" not in piped.stderr and "\033" not in piped.stderr, repr(piped.stderr)
    code, out, terminal = run_with_terminal_stderr(documented_command(server, "--quiet"),
                                                   cwd=checkout, env=without_pythonpath(),
                                                   timeout=600)
    assert code == 0 and terminal == "", repr(terminal)


def test_without_lossd_installed_or_built_the_example_says_how_to_get_it(server, checkout):
    os.unlink(checkout.parent.parent.parent / "build" / "python")
    done = subprocess.run(documented_command(server), cwd=checkout, env=without_pythonpath(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "lossd is neither installed nor built in" in done.stderr, done.stderr
    assert "pip install ./client/python" in done.stderr, done.stderr
