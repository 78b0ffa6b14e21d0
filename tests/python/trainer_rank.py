"""One rank of a data-parallel transformers.Trainer run on a tiny causal LM, with its lm_head
local or on a lossd server; test_trainer.py starts world_size of these (torch.distributed on
gloo, as torchrun would) and compares what they end with.

    trainer_rank.py --model llama --head local|remote [--address A | --replicas A0,A1,...]
                    --output_dir D --max_steps N [--resume] [--result R] [--digests F]

The model is built from a config with a fixed seed, so every rank and every run starts from the
same weights; the data is fixed too. The local head runs in float32 outside autocast, as lossd
computes its head (float32 products from the body's hidden states), so that the two runs differ
only by float32 rounding. Rank 0 writes R: the parameters at the end (W as float32, the
server's master weights for the remote head), the logged losses and grad norms.

With --replicas, several servers train the head as a replica group: rank r trains with replica
r % R, the first rank of each replica uploads the head to it, and after every step rank 0 appends
to F (--digests) a JSON line with the version and weight_sha256 that every rank's replica reports.
"""
import argparse
import json
import os

import torch
import transformers

import lossd
import lossd.hf

VOCAB, HIDDEN, SEQUENCE, SAMPLES = 96, 32, 16, 64
CONFIGS = {
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=False)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
}


def build_model(model_type):
    config_class, extra = CONFIGS[model_type]
    config = config_class(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          pad_token_id=0, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(1234)
    return transformers.AutoModelForCausalLM.from_config(config)


class Fp32Head(torch.nn.Module):
    """The model's lm_head, computed in float32 whatever autocast says; with float64 products
    (rounded to float32) when `exact`."""

    def __init__(self, linear, exact=False):
        super().__init__()
        self.weight = linear.weight
        self.exact = exact

    def forward(self, hidden):
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            if self.exact:
                return (hidden.double() @ self.weight.double().T).float()
            return hidden.float() @ self.weight.float().T


class Tokens(torch.utils.data.Dataset):
    """Fixed token sequences whose labels ignore a padded tail, as a collator would mark it."""

    def __init__(self):
        generator = torch.Generator().manual_seed(99)
        self.ids = torch.randint(1, VOCAB, (SAMPLES, SEQUENCE), generator=generator)
        self.lengths = torch.randint(SEQUENCE // 2, SEQUENCE + 1, (SAMPLES,), generator=generator)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[self.lengths[i]:] = -100
        return {"input_ids": self.ids[i], "labels": labels}


class ReplicaDigests(transformers.TrainerCallback):
    """After every step, the version and SHA-256 of W that each rank's server holds, gathered
    over the ranks; rank 0 appends them to a file as a JSON line."""

    def __init__(self, head, path):
        self.head, self.path = head, path

    def on_step_end(self, args, state, control, **kwargs):
        info = self.head.info()
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, [info.version, info.weight_sha256])
        if torch.distributed.get_rank() == 0:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": state.global_step, "replicas": gathered}) + "\n")
        return control


class StopAfter(transformers.TrainerCallback):
    """Ends training after a step whose checkpoint was saved, with the schedule of the whole
    run: the first half of a run that a restart resumes."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=CONFIGS, required=True)
    parser.add_argument("--head", choices=("local", "local64", "remote"), required=True,
                        help="local64: the local head's products in float64, rounded to float32 "
                             "(the rounding noise of another float32 head)")
    parser.add_argument("--address")
    parser.add_argument("--replicas", help="the replicas' addresses, replica 0 first, by commas")
    parser.add_argument("--digests", help="with --replicas: where rank 0 records each step's W")
    parser.add_argument("--head_name", default="main")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--stop_after", type=int, default=0,
                        help="end the run after this step, as a crash would (after its save)")
    parser.add_argument("--result")
    parser.add_argument("--bf16", type=int, default=1, help="bf16 autocast (1) or float32 (0)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    model = build_model(args.model)
    training = transformers.TrainingArguments(
        output_dir=args.output_dir, use_cpu=True, ddp_backend="gloo", seed=0,
        per_device_train_batch_size=2, per_device_eval_batch_size=4,
        gradient_accumulation_steps=2, max_steps=args.max_steps, learning_rate=3e-3,
        lr_scheduler_type="linear", warmup_steps=2, weight_decay=0.01, optim="adamw_torch",
        max_grad_norm=0.5, bf16=bool(args.bf16), eval_strategy="steps", eval_steps=2,
        save_strategy="steps", save_steps=2, logging_steps=1, report_to=[],
        prediction_loss_only=True, dataloader_num_workers=0, disable_tqdm=True)
    if args.head != "remote":
        model.lm_head = Fp32Head(model.lm_head, exact=args.head == "local64")
        trainer_class = transformers.Trainer
    else:
        addresses = args.replicas.split(",") if args.replicas else [args.address]
        replicas = len(addresses) if args.replicas else None
        rank = training.process_index
        client = lossd.Client(lossd.replica_address(addresses, rank), timeout=300)
        # One upload per server: the first rank that trains with it.
        if not args.resume and rank < len(addresses):
            lossd.hf.offload_head(model, client, args.head_name, upload=True)
            lossd.hf.restore_head(model)  # the model as it was: every rank offloads below
        torch.distributed.barrier()  # the head is uploaded before any rank looks at it
        lossd.hf.offload_head(model, client, args.head_name, resume=args.resume,
                              replicas=replicas)
        trainer_class = lossd.hf.Trainer
    data = Tokens()
    trainer = trainer_class(model=model, args=training, train_dataset=data,
                            eval_dataset=torch.utils.data.Subset(data, range(8)))
    if args.stop_after:
        trainer.add_callback(StopAfter(args.stop_after))
    if args.digests:
        trainer.add_callback(ReplicaDigests(model.get_output_embeddings(), args.digests))
    trainer.train(resume_from_checkpoint=True if args.resume else None)

    if training.process_index == 0 and args.result:
        if args.head == "remote":
            lossd.hf.restore_head(model, dtype=torch.float32)
        params = {name: p.detach().float().clone() for name, p in model.named_parameters()
                  if "grad_norm_proxy" not in name and "grad_anchor" not in name}
        # W under one name, tied or not, local or restored from the server.
        params["lm_head.weight"] = model.get_output_embeddings().weight.detach().float().clone()
        history = trainer.state.log_history
        torch.save({"params": params,
                    "loss": [entry["loss"] for entry in history if "loss" in entry],
                    "grad_norm": [entry["grad_norm"] for entry in history if "grad_norm" in entry],
                    "eval_loss": [entry["eval_loss"] for entry in history if "eval_loss" in entry]},
                   args.result)
        print(json.dumps({"steps": trainer.state.global_step}))
    if torch.distributed.is_initialized():
        # No rank leaves while another still talks to it: a Gloo peer that vanishes
        # mid-exchange aborts the ranks still connected to it.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
