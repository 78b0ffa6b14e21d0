"""Training as people train: transformers.Trainer on several processes (torch.distributed on
gloo, DDP) with gradient accumulation, clipping, a warm-up schedule, evaluation every two steps
and checkpoints, once with a local lm_head and once with lossd.hf.Trainer and the head on a
lossd server that is killed halfway and restarted from its checkpoint directory; the two runs
must end with the same parameters, W included. And the ways a run meets the wrong W (a head that
trained before, another model's head, a server restarted without its checkpoint, a Trainer
checkpoint of another step) each end in an error that says so.

Needs current torch, transformers and accelerate (scripts/python_env.sh's environment).
"""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import transformers

from server_process import ServerProcess, ensure_python_client, free_port

ensure_python_client()
import lossd  # noqa: E402
import lossd.hf  # noqa: E402
from lossd.torch import HeadMovedError  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RANK_SCRIPT = os.path.join(HERE, "trainer_rank.py")
sys.path.insert(0, HERE)
import trainer_rank  # noqa: E402

STEPS, HALF = 8, 4
# float32: the runs differ by the rounding of two float32 heads (products summed in another
# order), carried through eight AdamW steps.
FP32_RTOL, FP32_ATOL = 1e-5, 1e-6
# A key projection's bias has no gradient in exact arithmetic, whatever the head (softmax ignores
# a shift of every score), so what AdamW does with the rounding noise it gets instead is all that
# moves it, and says nothing of the head: measured 6e-7 to 8e-7 apart on 2 cores, and past 1e-6
# once in CI on a loaded machine (four ranks, qwen2). A wrong head moves every other parameter by
# steps of the learning rate (3e-3), far outside FP32_ATOL.
NOISE_ONLY_SUFFIX, NOISE_ONLY_ATOL = "self_attn.k_proj.bias", 1e-5
# bf16 autocast rounds the body's activations and gradients to 8 bits, which turns the float32
# rounding differences of the head into differences 1000 times larger. Their size is measured
# in each run: a local head whose products are computed in float64 (another float32 rounding)
# against the plain local head. lossd must be no further from the local head than that.
BF16_NOISE_FACTOR = 3.0


def run_ranks(world_size, *args, timeout=600):
    """trainer_rank.py on world_size processes joined by torch.distributed; fails with their
    output when any of them fails."""
    environment = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                       WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                       PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"),
                                                                HERE])))
    processes = [subprocess.Popen([sys.executable, RANK_SCRIPT, *map(str, args)],
                                  env=dict(environment, RANK=str(rank), LOCAL_RANK=str(rank)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank in range(world_size)]
    outputs = []
    for process in processes:
        try:
            outputs.append(process.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for p in processes:
                p.kill()
            raise
    failed = [(rank, p.returncode) for rank, p in enumerate(processes) if p.returncode != 0]
    assert not failed, f"ranks {failed} failed:\n" + "\n".join(
        f"--- rank {rank} ---\n{output[-4000:]}" for rank, output in enumerate(outputs))


def relative_distance(a, b):
    """|a - b| / |b| over every parameter together."""
    num = sum(((a[k].double() - b[k].double()) ** 2).sum() for k in b)
    return (num / sum((b[k].double() ** 2).sum() for k in b)).sqrt().item()


@pytest.mark.parametrize("model, world_size, bf16", [
    ("llama", 2, 0),   # float32 throughout: equal to float32 rounding
    ("qwen2", 2, 1),   # tied, under bf16 autocast: W's gradient comes from the embedding and
                       # the head, averaged
    ("qwen2", 4, 0),   # tied, four ranks, float32
])
def test_trainer_on_ranks_with_a_restart_matches_a_local_head(tmp_path, model, world_size, bf16):
    common = ["--model", model, "--max_steps", STEPS, "--bf16", bf16]
    run_ranks(world_size, *common, "--head", "local", "--output_dir", tmp_path / "local",
              "--result", tmp_path / "local.pt")
    checkpoints = tmp_path / "server-checkpoints"
    flags = ("--device=cpu", f"--checkpoint_dir={checkpoints}", "--step_wait_seconds=120")
    remote = common + ["--head", "remote", "--output_dir", tmp_path / "remote"]
    with ServerProcess(*flags, metrics=False) as server:
        run_ranks(world_size, *remote, "--address", server.address, "--stop_after", HALF)
        server.stop(signal.SIGKILL)  # a crash: only what the checkpoints hold survives
    with ServerProcess(*flags, metrics=False) as server:
        assert lossd.Client(server.address).get_head("main").steps == HALF
        run_ranks(world_size, *remote, "--address", server.address, "--resume",
                  "--result", tmp_path / "remote.pt")
    local = torch.load(tmp_path / "local.pt")
    lossd_run = torch.load(tmp_path / "remote.pt")
    assert local["params"].keys() == lossd_run["params"].keys()
    assert "lm_head.weight" in lossd_run["params"]
    # The log of the resumed run carries the first half's entries over from the checkpoint.
    assert len(lossd_run["grad_norm"]) == len(local["grad_norm"]) == STEPS
    if not bf16:
        for name, expected in local["params"].items():
            atol = NOISE_ONLY_ATOL if name.endswith(NOISE_ONLY_SUFFIX) else FP32_ATOL
            torch.testing.assert_close(lossd_run["params"][name], expected, rtol=FP32_RTOL,
                                       atol=atol, msg=lambda m, name=name: f"{name}: {m}")
        # The logged grad_norm includes W's gradient, clipped with the rest: a W gradient of
        # another scale (not averaged over the ranks) shows here even where AdamW hides it.
        torch.testing.assert_close(torch.tensor(lossd_run["grad_norm"]),
                                   torch.tensor(local["grad_norm"]), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(lossd_run["eval_loss"]),
                                   torch.tensor(local["eval_loss"]), rtol=1e-5, atol=0)
        return
    run_ranks(world_size, *common, "--head", "local64", "--output_dir", tmp_path / "local64",
              "--result", tmp_path / "local64.pt")
    control = torch.load(tmp_path / "local64.pt")
    noise = relative_distance(control["params"], local["params"])
    assert 0 < noise < 1e-2, "bf16 rounding noise of the order measured when this was written"
    assert relative_distance(lossd_run["params"], local["params"]) <= BF16_NOISE_FACTOR * noise
    torch.testing.assert_close(torch.tensor(lossd_run["grad_norm"]),
                               torch.tensor(local["grad_norm"]), rtol=1e-3, atol=0)


# The wrong W ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "llama"
    trainer_rank.build_model("llama").save_pretrained(path)
    return path


def train_two_steps(head, model):
    ids = torch.randint(1, trainer_rank.VOCAB, (2, 8))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        head.step("sgd", lr=0.1)


def test_a_head_that_trained_before_is_refused(model_dir):
    """The same script run twice against one server: the second run's model is the checkpoint,
    the server's head is not any more."""
    with ServerProcess("--device=cpu", f"--heads=main={model_dir}", metrics=False) as server:
        first = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        train_two_steps(lossd.hf.offload_head(first, server.address), first)
        again = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        with pytest.raises(ValueError, match="has trained since .2 optimizer steps, version 3"):
            lossd.hf.offload_head(again, server.address)
        # Continuing that training is asked for by name.
        head = lossd.hf.offload_head(again, server.address, resume=True)
        assert head.version == 3


def test_another_models_head_of_the_same_shape_is_refused(model_dir, tmp_path):
    other = trainer_rank.build_model("llama")
    with torch.no_grad():
        other.lm_head.weight.add_(1e-3)  # another revision: same shape, another W
    other.save_pretrained(tmp_path / "other")
    with ServerProcess("--device=cpu", f"--heads=main={tmp_path / 'other'}",
                       metrics=False) as server:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        with pytest.raises(ValueError, match="not this model's lm_head .weight_sha256"):
            lossd.hf.offload_head(model, server.address)


def test_a_server_restarted_without_its_checkpoint_stops_training(model_dir):
    flags = ("--device=cpu", f"--heads=main={model_dir}")
    with ServerProcess(*flags, metrics=False) as server:
        port = server.port
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        head = lossd.hf.offload_head(model, server.address)
        train_two_steps(head, model)
        assert head.version == 3
    # The same address, no --checkpoint_dir: the head comes back at version 1, W from its source.
    with ServerProcess(*flags, f"--listen=127.0.0.1:{port}", metrics=False):
        ids = torch.randint(1, trainer_rank.VOCAB, (2, 8))
        with pytest.raises(HeadMovedError, match="went back from 3 to 1"):
            model(input_ids=ids, labels=ids).loss.backward()


def test_resuming_from_a_trainer_checkpoint_of_another_version_is_refused(model_dir, tmp_path):
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    (checkpoint / lossd.hf.CHECKPOINT_RECORD).write_text(
        '{"head": "main", "version": 7, "weight_sha256": "0", "steps": 6, "paths": ["x"]}')
    with ServerProcess("--device=cpu", f"--heads=main={model_dir}", metrics=False) as server:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        lossd.hf.offload_head(model, server.address)
        args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                              report_to=[], max_steps=1)
        trainer = lossd.hf.Trainer(model=model, args=args, train_dataset=trainer_rank.Tokens())
        with pytest.raises(ValueError, match="saved with head 'main' at version 7, but the "
                                             "server .* holds version 1"):
            trainer.train(resume_from_checkpoint=str(checkpoint))


RANK_THAT_DIES = """
import sys
import time
import lossd
client = lossd.Client(sys.argv[1])
client.step("demo", "sgd", lr=0.5, head_version=int(sys.argv[2]), world_size=2, rank=1)
"""


def test_a_rank_killed_while_it_waits_for_the_step_fails_the_step_on_every_rank():
    """Rank 1 calls Step and dies while it waits for rank 0; rank 0's Step then fails with
    ABORTED (after the grace a rank whose call went away has to come back), and nothing moved."""
    import urllib.request

    with ServerProcess("--device=cpu", "--demo_vocab_size=64", "--demo_hidden_size=8") as server:
        client = lossd.Client(server.address, timeout=120)
        before = client.get_head("demo")
        rank1 = subprocess.Popen([sys.executable, "-c", RANK_THAT_DIES, server.address,
                                  str(before.version)], env=dict(os.environ))

        def metric(line):
            url = f"http://127.0.0.1:{server.metrics_port}/metrics"
            return line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines()

        def wait_for(line, why):
            deadline = time.monotonic() + 60
            while not metric(line):
                assert time.monotonic() < deadline, why
                time.sleep(0.05)

        wait_for("lossd_step_rendezvous_waiting 1", "rank 1 never reached the step")
        rank1.kill()
        rank1.wait()
        # The server has seen rank 1's call go once its Step handler has returned.
        wait_for("lossd_inflight_calls 0", "rank 1's call did not end")
        with pytest.raises(lossd.LossdError) as failed:
            client.step("demo", "sgd", lr=0.5, head_version=before.version, world_size=2,
                        rank=0)
        assert failed.value.code == "ABORTED"
        assert "rank(s) 1 of 2 left (its call was cancelled)" in failed.value.message
        after = client.get_head("demo")
        assert (after.version, after.weight_sha256) == (before.version, before.weight_sha256)
