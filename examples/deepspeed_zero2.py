"""A DeepSpeed ZeRO-2 training program on zerostack: the same ds_config.json,
the same loop (backward and step on every micro-batch), the optimizer and lr
scheduler from the config. Against the DeepSpeed original only the imports
and the initialize call change:

    -import deepspeed
    +from zerostack.booster import Booster, LowLevelZeroPlugin, launch_from_torch
    -deepspeed.init_distributed()
    +launch_from_torch()
    -engine, optimizer, loader, lr_scheduler = deepspeed.initialize(
    -    args=args, model=model, model_parameters=model.parameters(), training_data=dataset)
    +plugin = LowLevelZeroPlugin.from_deepspeed_config(args.deepspeed_config)
    +booster = Booster(plugin=plugin)
    +model, optimizer, _, loader, lr_scheduler = booster.boost(
    +    model, dataloader=plugin.prepare_dataloader(dataset, shuffle=True))
     for x, y in loader:
    -    loss = next_token_loss(engine(input_ids=x).logits, y)
    -    engine.backward(loss)
    -    engine.step()
    +    loss = next_token_loss(model(input_ids=x).logits, y)
    +    booster.backward(loss, optimizer)
    +    optimizer.step()

Without --deepspeed_config it trains with DeepSpeed's ZeRO-2 guide config
(``GUIDE_CONFIG`` below: bf16, AdamW, WarmupDecayLR, stage 2 with CPU
offload, gradient accumulation, clipping, cpu_checkpointing). The model is a
small transformers GPT-2 whose blocks are activation-checkpointed
(transformers' gradient checkpointing); the data are random token sequences
with a pattern it can learn. --summary writes what the run
did as JSON.

    python examples/deepspeed_zero2.py --smoke
    torchrun --nproc-per-node 2 examples/deepspeed_zero2.py --deepspeed_config ds_config.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from _gpt2 import gpt2, next_token_loss

from zerostack.booster import Booster, LowLevelZeroPlugin, launch_from_torch

# DeepSpeed's ZeRO-2 guide config (the Hugging Face Trainer's
# ds_config_zero2.json with its "auto" values filled in), at a small scale.
GUIDE_CONFIG = {
    "fp16": {"enabled": False, "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                              "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                      "warmup_num_steps": 4, "total_num_steps": 40,
                                                      "warmup_type": "linear"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True,
                          "reduce_bucket_size": "auto", "contiguous_gradients": True},
    "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": True},
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "train_micro_batch_size_per_gpu": 4,
    "wall_clock_breakdown": False,
}  # fmt: skip


def dataset(samples: int, seq: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences that count up from a random start (mod vocab): learnable."""
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, vocab, (samples, 1), generator=gen)
    tokens = (starts + torch.arange(seq + 1)) % vocab
    return [(t[:-1], t[1:]) for t in tokens]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--deepspeed_config", help="a ds_config.json (default: DeepSpeed's ZeRO-2 guide config)"
    )
    ap.add_argument(
        "--epochs", type=int, default=3, help="passes over the data (default %(default)s)"
    )
    ap.add_argument("--smoke", action="store_true", help="a tiny model and data set (CPU, seconds)")
    ap.add_argument(
        "--summary", help="write what the run did (steps, losses, lr) to this JSON file"
    )
    args = ap.parse_args()

    if "RANK" not in os.environ:  # plain `python`: a one-process group
        torch.distributed.init_process_group(
            "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
        )
    launch_from_torch()
    config = args.deepspeed_config or GUIDE_CONFIG
    plugin = LowLevelZeroPlugin.from_deepspeed_config(config)
    booster = Booster(plugin=plugin)

    shape = dict(dim=32, layers=2, vocab=64) if args.smoke else dict(dim=256, layers=6, vocab=512)
    # Activation checkpointing, as Megatron's --checkpoint-activations.
    model = gpt2(**shape, heads=4, seq_len=32, checkpointing=True)
    data = dataset(64 if args.smoke else 4096, 32, shape["vocab"])

    loader = plugin.prepare_dataloader(data, shuffle=True, drop_last=True)
    model, optimizer, _, loader, lr_scheduler = booster.boost(model, dataloader=loader)

    losses, steps = [], 0
    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            loss = next_token_loss(model(input_ids=x).logits, y)
            booster.backward(loss, optimizer)
            steps += optimizer.step() is True
            losses.append(loss.item())
        lr = lr_scheduler.get_last_lr()[0] if lr_scheduler is not None else None
        print(f"epoch {epoch}: loss {sum(losses[-len(loader):]) / len(loader):.4f}, "
              f"{steps} optimizer steps, lr {lr}", flush=True)  # fmt: skip
    if args.summary and torch.distributed.get_rank() == 0:
        summary = {
            "micro_steps": optimizer.micro_steps, "optimizer_steps": steps, "losses": losses,
            "lr": lr, "micro_batch": loader.batch_size,
            "gradient_accumulation_steps": optimizer.gradient_accumulation_steps,
            "world_size": torch.distributed.get_world_size(),
        }  # fmt: skip
        with open(args.summary, "w") as f:
            json.dump(summary, f)


if __name__ == "__main__":
    main()
