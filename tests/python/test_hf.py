"""lossd.hf and Hugging Face checkpoints, against transformers itself, offline.

Tiny random causal LMs are built from transformers configs and saved with save_pretrained in
several shards (model.safetensors.index.json, model-0000k-of-0000n.safetensors, config.json);
one lossd_server serves each model's head from its directory. The same checkpoints loaded by
transformers are the references: with lossd.hf.offload_head, the model's loss and every gradient
but the head's must be the unpatched model's, and W's gradient, held on the server, the model's
lm_head (tied: the tied weight's) gradient. fp32 throughout: bounds are a few float32 roundings
over sums of a few hundred terms.

Needs current torch and transformers (scripts/python_env.sh's environment).
"""
import json
import os
import subprocess

import numpy as np
import pytest
import safetensors.torch
import torch
import transformers

from server_process import SERVER_BIN, ServerProcess, ensure_python_client

ensure_python_client()
import lossd  # noqa: E402
import lossd.hf  # noqa: E402

os.environ["HF_HUB_OFFLINE"] = "1"
transformers.logging.set_verbosity_error()

VOCAB, HIDDEN = 512, 32
LOSS_RTOL = 1e-6
GRAD_RTOL = 1e-5

# Small configs of each supported family: GQA, two layers; Gemma 2 with its logit soft cap.
# tie: whether the model ties lm_head to its input embedding (Qwen2.5-0.5B and Gemma do).
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
MODELS = {
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=False)),
    "mistral": (transformers.MistralConfig, dict(tie_word_embeddings=False)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, dict(tie_word_embeddings=False, head_dim=8)),
    "gemma": (transformers.GemmaConfig, dict(head_dim=8)),
    "gemma2": (transformers.Gemma2Config, dict(head_dim=8, final_logit_softcapping=2.0,
                                               query_pre_attn_scalar=8)),
}


def build(model_type, seed):
    config_class, extra = MODELS[model_type]
    config = config_class(**COMMON, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # Gemma's default init gives W tiny logits, where a cap would hardly bite: larger W.
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each model saved by transformers in shards of at most 40 KB (W alone is 64 KB)."""
    root = tmp_path_factory.mktemp("checkpoints")
    for i, model_type in enumerate(MODELS):
        build(model_type, seed=i).save_pretrained(root / model_type, max_shard_size="40KB")
    return root


@pytest.fixture(scope="module")
def server(checkpoints):
    heads = ",".join(f"{model_type}={checkpoints / model_type}" for model_type in MODELS)
    with ServerProcess("--device=cpu", f"--heads={heads}", metrics=False) as s:
        yield s


def load(checkpoints, model_type):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints / model_type,
                                                              attn_implementation="eager")
    model.train()
    return model


def relative_error(actual, expected):
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    return ((actual - expected).norm() / expected.norm()).item()


def padded_batch(seed, batch=3, length=19):
    """Token ids with right and left padding, the mask that says so and labels as a data
    collator makes them: the ids, -100 where padded."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, -6:] = 0   # right padding
    mask[1, :4] = 0    # left padding
    ids[mask == 0] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def assert_same_gradients(patched, reference, head, tied):
    """Every parameter's gradient but W's equals the reference's; W's (on the server) equals the
    reference's lm_head gradient, which for a tied model is the tied weight's."""
    params = dict(patched.named_parameters())
    for name, expected in reference.named_parameters():
        if name in ("lm_head.weight", "model.embed_tokens.weight") and (tied or "lm_head" in name):
            continue
        assert relative_error(params[name].grad, expected.grad) < GRAD_RTOL, name
    expected_w = reference.get_output_embeddings().weight.grad
    assert relative_error(head.fetch_grad_weight(), expected_w) < GRAD_RTOL


# Checkpoints -----------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", MODELS)
def test_server_loads_the_head_transformers_loads(checkpoints, client, model_type):
    directory = checkpoints / model_type
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "the checkpoint must be sharded"
    model = load(checkpoints, model_type)
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    info = client.get_head(model_type)
    assert info.tied_embeddings == tied
    assert info.logit_softcap == (2.0 if model_type == "gemma2" else 0.0)
    tensor = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert info.source == f"{directory / index['weight_map'][tensor]}#{tensor} (F32)"
    assert torch.equal(torch.from_numpy(client.fetch_weight(model_type)),
                       model.get_output_embeddings().weight.detach())


def test_first_shard_of_an_untied_model_is_refused(checkpoints):
    """The shard that holds the embedding but not lm_head was served as the head once."""
    index = json.loads((checkpoints / "llama" / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.embed_tokens.weight"]
    assert index["weight_map"]["lm_head.weight"] != shard
    result = subprocess.run([SERVER_BIN, "--device=cpu", "--metrics_listen=",
                             "--listen=127.0.0.1:0", f"--heads=x={checkpoints / 'llama' / shard}"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert "'lm_head.weight'" in result.stderr and "is one shard of" in result.stderr, \
        result.stderr


def test_bf16_file_written_by_safetensors(tmp_path):
    """A single bfloat16 file written by the safetensors package, with a config beside it that
    ties the embedding: the head is the embedding, rounded as bfloat16 holds it."""
    weight = np.random.default_rng().standard_normal((VOCAB, HIDDEN), dtype=np.float32)
    bf16 = torch.from_numpy(weight).bfloat16()
    safetensors.torch.save_file({"model.embed_tokens.weight": bf16,
                                 "model.norm.weight": torch.ones(HIDDEN)},
                                tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": HIDDEN,
         "tie_word_embeddings": True}))
    with ServerProcess("--device=cpu", f"--heads=h={tmp_path}", metrics=False) as s, \
            lossd.Client(s.address) as c:
        info = c.get_head("h")
        assert info.tied_embeddings
        assert torch.equal(torch.from_numpy(c.fetch_weight("h")), bf16.float())


# The model's loss and gradients ----------------------------------------------------------------

@pytest.mark.parametrize("model_type", MODELS)
def test_loss_and_gradients_are_the_models(checkpoints, client, model_type):
    reference = load(checkpoints, model_type)
    patched = load(checkpoints, model_type)
    tied = patched.get_input_embeddings().weight is patched.get_output_embeddings().weight
    head = lossd.hf.offload_head(patched, client, head=model_type)
    head.zero_grad()
    ids, mask, labels = padded_batch(seed=7)
    out = patched(input_ids=ids, attention_mask=mask, labels=labels)
    expected = reference(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits is None
    assert out.loss.dtype == torch.float32
    assert relative_error(out.loss.detach(), expected.loss.detach()) < LOSS_RTOL
    out.loss.backward()
    expected.loss.backward()
    assert_same_gradients(patched, reference, head, tied)
    head.zero_grad()


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_gradient_accumulation_with_num_items_in_batch(checkpoints, client, model_type):
    """The Trainer's gradient accumulation: each micro-batch's loss is its sum over the
    whole step's count of labels."""
    reference = load(checkpoints, model_type)
    patched = load(checkpoints, model_type)
    tied = model_type == "qwen2"
    head = lossd.hf.offload_head(patched, client, head=model_type)
    head.zero_grad()
    batches = [padded_batch(seed=s) for s in (1, 2)]
    num_items = torch.tensor(sum(int((labels[:, 1:] != -100).sum()) for _, _, labels in batches))
    for model in (patched, reference):
        for ids, mask, labels in batches:
            loss = model(input_ids=ids, attention_mask=mask, labels=labels,
                         num_items_in_batch=num_items).loss
            loss.backward()
    assert_same_gradients(patched, reference, head, tied)
    head.zero_grad()


def test_shift_labels_argument_is_taken_as_shifted(checkpoints, client):
    reference = load(checkpoints, "mistral")
    patched = load(checkpoints, "mistral")
    head = lossd.hf.offload_head(patched, client, head="mistral")
    head.zero_grad()
    ids, mask, labels = padded_batch(seed=3)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    out = patched(input_ids=ids, attention_mask=mask, shift_labels=shifted)
    expected = reference(input_ids=ids, attention_mask=mask, labels=labels)
    assert relative_error(out.loss.detach(), expected.loss.detach()) < LOSS_RTOL
    out.loss.backward()
    expected.loss.backward()
    assert_same_gradients(patched, reference, head, tied=False)
    head.zero_grad()


# Training: tied weights stay tied --------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_training_steps_match_local_training(checkpoints, client, model_type):
    """Five AdamW steps: the local model updates every parameter, the tied weight once with the
    sum of its two gradients; through lossd the server's AdamW updates W with dL/dW from the head
    and, tied, from the embedding, and the local optimizer the rest. Losses, parameters and W
    agree; without the embedding's share W's gradient would be 0.75 off (relative) for the tied
    model, and W steps away from the local one."""
    torch.manual_seed(0)
    lr, betas, eps, decay = 1e-3, (0.9, 0.95), 1e-8, 0.1
    reference = load(checkpoints, model_type)
    patched = load(checkpoints, model_type)
    head_name = f"trained-{model_type}"
    head = lossd.hf.offload_head(patched, client, head=head_name, upload=True)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=lr, betas=betas, eps=eps,
                                            weight_decay=decay)
    optimizer = torch.optim.AdamW(patched.parameters(), lr=lr, betas=betas, eps=eps,
                                  weight_decay=decay)
    for step in range(5):
        ids, mask, labels = padded_batch(seed=100 + step)
        expected = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
        expected.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        loss = patched(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        head.step("adamw", lr=lr, betas=betas, eps=eps, weight_decay=decay)
        assert relative_error(loss.detach(), expected.detach()) < 1e-5, step
    # AdamW scales each update by its gradient's running RMS, so parameters whose gradient is
    # small come out of identical arithmetic up to a few 1e-6 apart, and k_proj's bias, whose
    # gradient is zero but for rounding (softmax does not see a shift shared by all keys), takes
    # steps of rounding noise in both trainings: it is not compared.
    params = dict(patched.named_parameters())
    for name, expected in reference.named_parameters():
        if name in ("lm_head.weight", "model.embed_tokens.weight") or "k_proj.bias" in name:
            continue
        assert relative_error(params[name].detach(), expected.detach()) < 1e-4, name
    if model_type != "qwen2":
        embedding = reference.get_input_embeddings().weight.detach()
        assert relative_error(params["model.embed_tokens.weight"].detach(), embedding) < 1e-5
    weight = torch.from_numpy(client.fetch_weight(head_name))
    assert relative_error(weight, reference.get_output_embeddings().weight.detach()) < 1e-6
    if model_type == "qwen2":
        assert reference.get_input_embeddings().weight is reference.get_output_embeddings().weight

    lossd.hf.restore_head(patched)
    assert torch.equal(patched.get_output_embeddings().weight.detach(), weight)
    if model_type == "qwen2":
        assert patched.get_input_embeddings().weight is patched.get_output_embeddings().weight
    ids, mask, labels = padded_batch(seed=200)
    with torch.no_grad():
        restored = patched(input_ids=ids, attention_mask=mask, labels=labels)
        expected = reference(input_ids=ids, attention_mask=mask, labels=labels)
    assert relative_error(restored.logits, expected.logits) < 1e-5


# Inference -------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["gemma2", "llama"])
def test_logits_and_generation_without_labels(checkpoints, client, model_type):
    reference = load(checkpoints, model_type).eval()
    patched = load(checkpoints, model_type).eval()
    lossd.hf.offload_head(patched, client, head=model_type)
    ids, mask, _ = padded_batch(seed=11)
    with torch.no_grad():
        for keep in (0, 1, torch.tensor([2, 5])):
            logits = patched(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits
            expected = reference(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits
            assert logits.shape == expected.shape
            assert relative_error(logits, expected) < 1e-6
    prompt = ids[2:, :8]
    generated = patched.generate(prompt, max_new_tokens=6, do_sample=False)
    expected = reference.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(generated, expected)
    with pytest.raises(RuntimeError, match="carry no gradient to W"):
        patched.train()(input_ids=ids)


def test_offload_refuses_heads_that_are_not_the_models(checkpoints, client):
    with pytest.raises(ValueError, match="is not this model's head"):
        lossd.hf.offload_head(load(checkpoints, "llama"), client, head="qwen2")
    with pytest.raises(ValueError, match="has no head 'absent'.*upload=True"):
        lossd.hf.offload_head(load(checkpoints, "llama"), client, head="absent")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        lossd.hf.offload_head(gpt2, client, head="llama")
