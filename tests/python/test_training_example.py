"""client/python/examples: the tiny LM trained with a local head and with a RemoteHead agrees, and
score_text.py scores a text."""
import os
import sys

import pytest

from server_process import ServerProcess, ensure_python_client

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
    with lossd.Client(server.address, timeout=120) as client:
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
