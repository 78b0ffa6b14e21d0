"""What the real lossd_server does while it starts: a shard that is a FIFO is refused rather than
waited on, and a stop signal ends a startup that waits (here on a token file that is a FIFO with
no writer, which blocks the way a slow disk or a hung network mount would)."""
import os
import signal
import subprocess
import time

import numpy as np

from server_process import SERVER_BIN, run_to_exit


def write_safetensors(path, name, array):
    header = ('{"%s": {"dtype": "F32", "shape": [%d, %d], "data_offsets": [0, %d]}}'
              % (name, array.shape[0], array.shape[1], array.nbytes)).encode()
    header += b" " * ((8 - len(header) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header + array.astype(np.float32).tobytes())


def test_a_shard_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    os.mkfifo(model / "model.safetensors")
    code, output = run_to_exit("--listen=127.0.0.1:0", "--metrics_listen=", "--device=cpu",
                               f"--heads=main={model}")
    assert code == 1, output
    assert f"{model}/model.safetensors: not a regular file" in output

    # A link to a FIFO, named as a shard file.
    os.mkfifo(tmp_path / "pipe")
    linked = tmp_path / "linked.safetensors"
    os.symlink(tmp_path / "pipe", linked)
    code, output = run_to_exit("--listen=127.0.0.1:0", "--metrics_listen=", "--device=cpu",
                               f"--heads=main={linked}")
    assert code == 1, output
    assert f"{linked}: expected a model directory, an index (.json) or a safetensors file" in output

    # config.json as a FIFO beside a good shard.
    write_safetensors(model / "real.safetensors", "lm_head.weight", np.ones((10, 4)))
    os.unlink(model / "model.safetensors")
    os.rename(model / "real.safetensors", model / "model.safetensors")
    os.mkfifo(model / "config.json")
    code, output = run_to_exit("--listen=127.0.0.1:0", "--metrics_listen=", "--device=cpu",
                               f"--heads=main={model}")
    assert code == 1, output
    assert f"{model}/config.json: not a regular file" in output


def test_a_stop_signal_ends_a_startup_that_waits(tmp_path):
    token = tmp_path / "token"
    os.mkfifo(token)  # opening it for reading waits for a writer that never comes
    process = subprocess.Popen([SERVER_BIN, "--listen=127.0.0.1:0", "--metrics_listen=",
                                "--device=cpu", f"--token_file={token}"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # The signal is sent once a thread waits in the FIFO's open (wait_for_partner).
        while not _waits_on_fifo(process.pid):
            assert process.poll() is None, process.communicate()[0]
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 128 + signal.SIGTERM, output
    assert "signal 15 while starting; exiting" in output


def _waits_on_fifo(pid):
    """Whether a thread of `pid` is blocked opening or reading a FIFO."""
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/wchan") as f:
                waits_in = f.read()
            if any(word in waits_in for word in ("fifo", "pipe", "partner")):
                return True
    except OSError:
        pass
    return False
