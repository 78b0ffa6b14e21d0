"""Hugging Face transformers causal LMs whose loss lossd computes, in one call.

    model = AutoModelForCausalLM.from_pretrained("/models/Qwen2.5-0.5B")
    head = lossd.hf.offload_head(model, lossd.Client("127.0.0.1:50051"), head="main")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)   # after offload_head
    for batch in data:
        loss = model(**batch).loss          # input_ids, attention_mask, labels
        loss.backward()
        optimizer.step(); optimizer.zero_grad()
        head.step("adamw", lr=1e-5)         # W on the server

After offload_head the model's lm_head is a lossd.torch.RemoteHead on the server's head, and
`model(input_ids, labels=labels)` returns the loss transformers' own forward returns, with the
gradients it gives, without ever building the [tokens, vocabulary] logits:

* The loss is transformers' ForCausalLMLoss: labels shifted by one within each row of the batch
  (the server shifts them, ComputeStart.shift_labels), the last position of each row and labels
  equal to ignore_index (default -100) ignored, the mean over the shifted labels that count, in
  float32. A `shift_labels` argument is taken as already shifted, as transformers takes it.
  `num_items_in_batch` (the Trainer's count over all micro-batches of a gradient-accumulation
  step) makes it the sum divided by that count, sent as the call's mean denominator so that the
  upstream gradient stays 1. The attention mask does not enter the loss, in transformers either:
  padding counts only where its labels are not ignore_index (DataCollatorForLanguageModeling
  sets them to -100).
* Gemma 2's final_logit_softcapping is applied on the server: the head carries the model's cap
  (from config.json, or the upload).
* Tied models (Qwen2.5-0.5B, Llama 3.2 1B, Gemma 2) use W at both ends. Their input embedding is
  replaced by a lossd.torch.RemoteEmbedding that looks its rows up on the server and sends their
  gradient into the head's accumulator, so that head.step updates the one matrix as the local
  model's optimizer would update the tied weight.
* Without labels (inference, generate()) forward returns logits for the positions asked
  (`logits_to_keep`, as transformers' forward), from a copy of W fetched from the server and
  fetched again when the head's version moves (one GetHead per forward); with the soft cap.
  Those logits carry no gradient to W, so forward refuses to build them under autograd (hidden
  states that require grad): pass labels to train, or run under torch.no_grad().
* With labels, the output's logits are None: not building them is the point.

Supported model types: those whose causal-LM forward transformers writes as decoder, lm_head,
optional soft cap and ForCausalLMLoss, which this module's forward reproduces:
SUPPORTED_MODEL_TYPES.
Create optimizers after offload_head: the model's own lm_head (and tied embedding) parameters are
gone from it. lossd.hf.restore_head puts the server's trained W back into the model (before
save_pretrained, say).
"""
import dataclasses
import types
from typing import Optional

import torch

from lossd import _tensors
from lossd._address import replica_address
from lossd.client import Client, LossdError
from lossd.torch import RemoteEmbedding, RemoteHead, data_parallel_world

# Checked against transformers 5.23 (tests/python/test_hf.py builds each from its config).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")


class _Offload:
    """What offload_head changed in a model, to compute the loss and to undo it."""

    def __init__(self, head, embedding, softcap):
        self.head = head                      # the RemoteHead now at lm_head
        self.embedding = embedding            # the RemoteEmbedding, for tied models, else None
        self.softcap = softcap                # the model's final logit soft cap, or None
        self.original_embedding = None        # tied: the model's embedding, emptied of W
        self.cache_field = _output_cache_field()  # the output's name for the cache


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _keep_positions(hidden, logits_to_keep):
    """The rows of hidden [B, T, H] whose logits are asked for, as transformers' forward keeps
    them: an int k, the last k positions (0: all); a tensor, those positions."""
    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.dim() == 2:
        if logits_to_keep.dtype == torch.bool:
            return hidden[logits_to_keep]
        return torch.take_along_dim(hidden, logits_to_keep[..., None], dim=1)
    if isinstance(logits_to_keep, int):
        logits_to_keep = slice(-logits_to_keep, None)
    return hidden[:, logits_to_keep, :]


# The body's key-value cache: transformers 5.24 renamed past_key_values to cache (the old name
# deprecated until 5.40), so the forward passes on whichever the caller used, under its name,
# and the output carries it under the name the output class has.
_CACHE_NAMES = ("cache", "past_key_values")


def _output_cache_field():
    from transformers.modeling_outputs import CausalLMOutputWithPast

    fields = {field.name for field in dataclasses.fields(CausalLMOutputWithPast)}
    return next(name for name in _CACHE_NAMES if name in fields)


def _causal_lm_forward(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):
    """transformers' causal-LM forward with the loss computed by lossd (see the module
    docstring); bound to the model by offload_head. Everything but the loss's arguments goes to
    the model's body as it came."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    offload = self._lossd_offload
    return_dict = kwargs.pop("return_dict", None)
    shifted = kwargs.pop("shift_labels", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    outputs = getattr(self, self.base_model_prefix)(input_ids=input_ids, **kwargs)
    hidden = outputs[0]
    loss = logits = None
    if labels is not None or shifted is not None:
        if torch.is_tensor(num_items):
            num_items = num_items.item()
        targets = shifted if shifted is not None else labels
        if num_items is not None and num_items <= 0:
            # transformers divides the sum by it, whatever comes out.
            loss = offload.head(hidden, targets, reduction="sum", ignore_index=ignore_index,
                                shift_labels=shifted is None) / num_items
        else:
            loss = offload.head(hidden, targets, ignore_index=ignore_index,
                                mean_denominator=0.0 if num_items is None else float(num_items),
                                shift_labels=shifted is None)
    else:
        kept = _keep_positions(hidden, logits_to_keep)
        if torch.is_grad_enabled() and kept.requires_grad:
            raise RuntimeError(
                "lossd.hf: forward without labels builds logits from a copy of W, which carry no "
                "gradient to W on the server; pass labels to train, or compute logits under "
                "torch.no_grad() (generate() does)")
        logits = offload.head.logits(kept)
    cache = next((getattr(outputs, name) for name in _CACHE_NAMES
                  if getattr(outputs, name, None) is not None), None)
    output = CausalLMOutputWithPast(loss=loss, logits=logits, **{offload.cache_field: cache},
                                    hidden_states=getattr(outputs, "hidden_states", None),
                                    attentions=getattr(outputs, "attentions", None))
    return output.to_tuple() if return_dict is False else output


def _model_weight_sha256(weight, dtype):
    """HeadInfo.weight_sha256 of the model's lm_head weight as a server storing it in dtype
    would hold it."""
    weight = weight.detach().to("cpu", torch.float32).contiguous().numpy()
    return _tensors.weight_sha256(weight, dtype)


def _check_server_head(client, head, info, model_head, resume):
    """Refuses a server head that is not the model's lm_head W, saying what differs and what to
    do; with resume, takes the server's W as the run's (it trained on from this model)."""
    expected_sha256 = _model_weight_sha256(model_head, info.dtype)
    if info.weight_sha256 == expected_sha256 or resume:
        return
    where = f"the server at {client.address} serves {head!r} from {info.source}"
    if info.steps > 0 or info.version > 1:
        raise ValueError(
            f"head: {where}, and it has trained since ({info.steps} optimizer steps, version "
            f"{info.version}): its W is no longer this model's lm_head. To continue that "
            f"training, pass resume=True (with the trainer's checkpoint of the same step); to "
            f"start over, restart the server without its checkpoints, or pass upload=True to "
            f"replace the head with this model's W")
    raise ValueError(
        f"head: {where} (version {info.version}, weight_sha256 {info.weight_sha256[:16]}...), "
        f"which is not this model's lm_head (weight_sha256 {expected_sha256[:16]}... as "
        f"{info.dtype}) though the shapes agree: another model's checkpoint, or another "
        f"revision. Serve this model's directory (--heads={head}=<its directory>), use another "
        f"head name, or pass upload=True to replace it with this model's W")


def offload_head(model, client, head="main", *, upload=False, storage_dtype="float32",
                 shared_memory=None, resume=False, process_group=None,
                 replicas=None) -> RemoteHead:
    """Makes `model`, a transformers causal LM of one of SUPPORTED_MODEL_TYPES, compute its loss
    through lossd's head `head`, and returns that head (a lossd.torch.RemoteHead, now the
    model's lm_head: head.step(...) trains W on the server).

    client: a lossd.Client or its address. upload=False: the server already serves the head,
    loaded from this model's checkpoint (`lossd_server --heads=main=/models/<model>`); its shape,
    tie and soft cap must be the model's, and so must W itself (its SHA-256 as the server stores
    it): a head that has trained since it was loaded (a script run twice against one server),
    or another model's W of the same shape, is refused with a ValueError that says which and
    what to do. resume=True takes the server's W as it is, to continue a run from a checkpoint
    (lossd.hf.Trainer checks the version against the trainer's checkpoint). upload=True: the
    model's own lm_head weight becomes the head (replacing one of that name), stored as
    storage_dtype, with the model's tie and soft cap. Under torch.distributed every rank offloads
    to the same head; upload on one rank (say rank 0, before a barrier) and offload on all.
    shared_memory, process_group: see lossd.torch.RemoteHead.

    Several servers training the head as a replica group (lossd_server --replicas=R): pass the
    replicas' addresses, replica 0 first, as `client`; this rank trains with replica
    rank % R (lossd.replica_address), and steps meet there (RemoteHead's replicas). Or pass this
    rank's replica as client and replicas=R. Each replica serves the head (start them all with the
    same --heads or checkpoint; with upload, the first rank of each replica, ranks 0 to R - 1,
    uploads to its own).
    """
    if getattr(model, "_lossd_offload", None) is not None:
        raise ValueError("model: its head is already offloaded (lossd.hf.restore_head undoes it)")
    config = _text_config(model.config)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model: model_type {model_type!r} is not one lossd.hf knows the forward "
                         f"of; expected one of {', '.join(SUPPORTED_MODEL_TYPES)}")
    lm_head = model.get_output_embeddings()
    if not isinstance(lm_head, torch.nn.Linear) or lm_head.bias is not None:
        raise ValueError(f"model: expected lm_head to be a torch.nn.Linear without bias, got "
                         f"{type(lm_head).__name__}")
    embedding = model.get_input_embeddings()
    tied = embedding.weight is lm_head.weight
    # Gemma's embeddings multiply their rows by embed_scale and are otherwise nn.Embedding's.
    embed_scale = getattr(embedding, "embed_scale", None)
    plain = type(embedding) is torch.nn.Embedding or (
        isinstance(embedding, torch.nn.Embedding) and embed_scale is not None and
        type(embedding).__name__.endswith("ScaledWordEmbedding"))
    if tied and (embedding.max_norm is not None or embedding.sparse or not plain):
        raise ValueError(f"model: a tied input embedding must be a torch.nn.Embedding (no "
                         f"max_norm, not sparse), or a scaled one, got {embedding!r}")
    softcap = getattr(config, "final_logit_softcapping", None) or None
    vocab_size, hidden_size = lm_head.weight.shape
    if isinstance(client, (list, tuple)):
        if replicas is not None and replicas != len(client):
            raise ValueError(f"replicas: {replicas}, but client lists {len(client)} replica "
                             f"addresses")
        replicas = len(client)
        client = replica_address(client, data_parallel_world(process_group)[1])
    client = client if isinstance(client, Client) else Client(client)

    if upload:
        client.upload_head(head, lm_head.weight.detach().float().cpu().numpy(),
                           storage_dtype=storage_dtype, replace=True, tied_embeddings=tied,
                           logit_softcap=softcap or 0.0)
    else:
        try:
            info = client.get_head(head)
        except LossdError as error:
            if error.code != "NOT_FOUND":
                raise
            raise ValueError(f"head: the server at {client.address} has no head {head!r}: start "
                             f"it with --heads={head}=<the model's directory>, or pass "
                             f"upload=True") from None
        expected = dict(vocab_size=vocab_size, hidden_size=hidden_size, tied_embeddings=tied,
                        logit_softcap=float(softcap or 0.0))
        found = {key: getattr(info, key) for key in expected}
        if found != expected:
            raise ValueError(f"head: the server's {head!r} ({info.source}) is not this model's "
                             f"head: it has {found}, the model {expected}")
        _check_server_head(client, head, info, lm_head.weight, resume)

    remote_head = RemoteHead(client, head, shared_memory=shared_memory,
                             process_group=process_group, replicas=replicas)
    remote_embedding = None
    if tied:
        remote_embedding = RemoteEmbedding(client, head, hidden_size,
                                           padding_idx=embedding.padding_idx,
                                           dtype=embedding.weight.dtype,
                                           device=embedding.weight.device,
                                           embed_scale=embed_scale, process_group=process_group)
        model.set_input_embeddings(remote_embedding)
    model.set_output_embeddings(remote_head)
    model._lossd_offload = _Offload(remote_head, remote_embedding, softcap)
    if tied:
        # Kept without its weight (W lives on the server), for restore_head to refill.
        del embedding.weight
        embedding.weight = None
        model._lossd_offload.original_embedding = embedding
    model.forward = types.MethodType(_causal_lm_forward, model)
    return remote_head


def _tensors_from_master(head):
    """W [V, H] as float32: a 16-bit head's fp32 master weights where it has them."""
    return torch.from_numpy(head.client.fetch_weight(head.head, "float32", master=True))


def restore_head(model, dtype: Optional[torch.dtype] = None):
    """Undoes offload_head: the model gets back a local lm_head (and, tied, input embedding)
    holding the server's current W, in dtype (default: the model's), and its own forward.
    Returns the model."""
    offload = getattr(model, "_lossd_offload", None)
    if offload is None:
        raise ValueError("model: its head is not offloaded")
    device = offload.embedding.grad_anchor.device if offload.embedding is not None else \
        next(model.parameters()).device
    # A 16-bit head that trained holds fp32 master weights: the model gets those.
    weight = _tensors_from_master(offload.head).to(device=device, dtype=dtype or model.dtype)
    vocab_size, hidden_size = weight.shape
    lm_head = torch.nn.Linear(hidden_size, vocab_size, bias=False, device=device,
                              dtype=weight.dtype)
    lm_head.weight = torch.nn.Parameter(weight)
    if offload.embedding is not None:
        offload.original_embedding.weight = lm_head.weight
        model.set_input_embeddings(offload.original_embedding)
    model.set_output_embeddings(lm_head)
    del model.forward
    del model._lossd_offload
    return model


# ---- transformers.Trainer ----------------------------------------------------------------------

# The Trainer's optimizers whose update the server's AdamW or SGD is (torch.optim's semantics).
_ADAMW_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")
_SGD_OPTIMIZERS = ("sgd",)
CHECKPOINT_RECORD = "lossd_head.json"  # in each of the Trainer's checkpoint directories


def _head_optimizer(args):
    """The server optimizer and hyperparameters that step W as the Trainer's optimizer steps the
    model's other parameters (W is one of the Trainer's decayed parameters)."""
    optim = getattr(args.optim, "value", args.optim)
    if optim in _ADAMW_OPTIMIZERS:
        return "adamw", dict(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                             weight_decay=args.weight_decay)
    if optim in _SGD_OPTIMIZERS:
        return "sgd", dict(weight_decay=args.weight_decay)
    raise ValueError(f"args.optim: lossd steps W with torch's AdamW or SGD, expected one of "
                     f"{', '.join(_ADAMW_OPTIMIZERS + _SGD_OPTIMIZERS)}, got {optim!r}")


def _offloaded_head(model):
    """The RemoteHead of a model offload_head patched, through DDP's and Accelerate's wrappers."""
    while not hasattr(model, "_lossd_offload") and hasattr(model, "module"):
        model = model.module
    offload = getattr(model, "_lossd_offload", None)
    if offload is None:
        raise ValueError("model: its head is not offloaded; call lossd.hf.offload_head(model, "
                         "client) before building the Trainer")
    return offload.head


class TrainerMixin:
    """What a transformers.Trainer (or a subclass, such as TRL's) needs to train a model whose
    head lossd.hf.offload_head put on a lossd server, as it trains a local one:

        class MyTrainer(lossd.hf.TrainerMixin, trl.SFTTrainer): ...
        trainer = lossd.hf.Trainer(model=model, args=args, train_dataset=data)  # both in one

    * W steps with the Trainer's optimizer (AdamW or SGD as args.optim says, with its betas, eps
      and weight decay) at the learning rate its schedule gives each step, once per optimizer
      step however many ranks train (a collective step on the server).
    * W's gradient is in the gradient clipping and the logged grad_norm: after the last
      micro-batch of each step the head's norm_proxy parameter gets |dL/dW| as its gradient, so
      that the Trainer's clip_grad_norm_ over the model's parameters takes the global norm of
      the whole model, W included, and the multiplier it clips by reaches W's step.
    * Gradient accumulation and ranks: each micro-batch's backward commits its share, averaged
      over the ranks as DDP averages the body's gradients.
    * Checkpoints: each of the Trainer's checkpoints saves the server's head too
      (SaveCheckpoint) and records its version and SHA-256 in lossd_head.json beside the
      Trainer's files; train(resume_from_checkpoint=...) refuses a server whose head is not at
      that version (restart the server from its --checkpoint_dir, which then holds it).
    Evaluation runs under torch.no_grad() and trains nothing."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._lossd_head = _offloaded_head(self.model)
        self._lossd_optimizer = _head_optimizer(self.args)
        self._lossd_proxy = self._lossd_head.norm_proxy()
        self._lossd_norm = None
        self.add_callback(_HeadCallback(self))

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients:
            # Every rank's last backward of the step is in once the collective norm returns.
            self._lossd_norm = self._lossd_head.grad_norm().grad_norm
            self._lossd_proxy.grad = torch.full_like(self._lossd_proxy, self._lossd_norm)
        return loss

    def _lossd_step(self, optimizer):
        """W's step, with the Trainer's learning rate for this step and the multiplier its
        clipping left on the norm proxy."""
        norm = self._lossd_norm
        proxy_grad = self._lossd_proxy.grad
        clip = 1.0 if not norm or proxy_grad is None else float(proxy_grad.item()) / norm
        kind, hyper = self._lossd_optimizer
        lr = optimizer.param_groups[0]["lr"]
        self._lossd_head.step(kind, lr=lr, grad_multiplier=clip, **hyper)
        self._lossd_proxy.grad = None
        self._lossd_norm = None

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        path = resume_from_checkpoint
        if path is True:
            from transformers.trainer_utils import get_last_checkpoint
            path = get_last_checkpoint(self.args.output_dir)
        if path:
            self._lossd_check_resume(path)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _lossd_check_resume(self, path):
        """Refuses to resume from a Trainer checkpoint whose head the server does not hold."""
        import json
        import os

        record_path = os.path.join(path, CHECKPOINT_RECORD)
        if not os.path.exists(record_path):
            raise ValueError(f"resume_from_checkpoint: {path} has no {CHECKPOINT_RECORD}: it was "
                             f"not saved by lossd.hf.Trainer, so the server's head cannot be "
                             f"matched to it")
        with open(record_path, encoding="utf-8") as f:
            record = json.load(f)
        head = self._lossd_head
        info = head.info()
        if (info.version, info.weight_sha256) != (record["version"], record["weight_sha256"]):
            raise ValueError(
                f"resume_from_checkpoint: {path} was saved with head {record['head']!r} at "
                f"version {record['version']}, but the server at {head.client.address} holds "
                f"version {info.version} ({info.source}): start the server with the "
                f"--checkpoint_dir that holds {', '.join(record['paths']) or 'that checkpoint'}, "
                f"or resume from the Trainer checkpoint of version {info.version}")
        head.version = info.version
        head.trained = True

    def _lossd_save(self, checkpoint_dir):
        """Saves the server's head beside the Trainer's checkpoint and records which."""
        import json
        import os

        head = self._lossd_head
        paths = head.client.save_checkpoint(head.head)
        info = head.info()
        record = dict(head=head.head, version=info.version, weight_sha256=info.weight_sha256,
                      steps=info.steps, paths=paths, address=head.client.address)
        os.makedirs(checkpoint_dir, exist_ok=True)
        temporary = os.path.join(checkpoint_dir, CHECKPOINT_RECORD + ".tmp")
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
        os.replace(temporary, os.path.join(checkpoint_dir, CHECKPOINT_RECORD))


def _callback_base():
    from transformers import TrainerCallback
    return TrainerCallback


class _HeadCallback:
    """The Trainer's events that reach W: its step, and the checkpoints."""

    def __new__(cls, trainer):
        base = _callback_base()

        class HeadCallback(base):
            def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
                trainer._lossd_step(optimizer if optimizer is not None else trainer.optimizer)

            def on_save(self, args, state, control, **kwargs):
                import os

                from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

                if state.is_world_process_zero:
                    trainer._lossd_save(os.path.join(
                        args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"))

        return HeadCallback()


def __getattr__(name):
    # lossd.hf.Trainer: transformers.Trainer with TrainerMixin, built on first use so that
    # importing lossd.hf does not import the Trainer's dependencies.
    if name == "Trainer":
        import transformers

        trainer = type("Trainer", (TrainerMixin, transformers.Trainer),
                       {"__doc__": TrainerMixin.__doc__, "__module__": __name__})
        globals()["Trainer"] = trainer
        return trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
