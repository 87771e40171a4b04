"""LowLevelZeroPlugin.from_deepspeed_config: what maps, what is accepted,
every key that cannot be honoured in one error, every key without effect in
one warning, the batch keys, "auto", and the config's optimizer and scheduler."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch import nn

from zerostack.booster import Booster, DeepSpeedConfigError, LowLevelZeroPlugin
from zerostack.booster._plugins._deepspeed import DeepSpeedSettings, deepspeed_to_kwargs
from zerostack.booster._plugins._deepspeed_train import (
    WarmupDecayLR,
    WarmupLR,
    hidden_size,
    resolve_batch,
)
from zerostack.fused_adam import HybridAdam
from zerostack.testing import GPTConfig, TinyGPT, one_torch_thread

# A typical ZeRO-2 config, every mapped key set away from our defaults.
FULL = {
    "zero_optimization": {
        "stage": 2,
        "reduce_bucket_size": 2**22,
        "overlap_comm": False,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True,
        "contiguous_gradients": True,
        "reduce_scatter": True,
    },
    "fp16": {
        "enabled": True,
        "initial_scale_power": 12,
        "loss_scale_window": 500,
        "hysteresis": 3,
        "min_loss_scale": 4,
        "loss_scale": 0,
    },
    "gradient_clipping": 1.0,
    "communication_data_type": "bf16",
    "gradient_accumulation_steps": 1,
    "wall_clock_breakdown": False,
    "zero_allow_untested_optimizer": True,
}
CONFIG = GPTConfig(bias=False, vocab_size=64, dim=16, max_seq_len=16, num_layers=2)


def _quiet(config):
    """from_deepspeed_config, failing on any warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return LowLevelZeroPlugin.from_deepspeed_config(config)


def test_every_mapped_key_reaches_the_plugin(tmp_path):
    kwargs = deepspeed_to_kwargs(FULL)
    assert kwargs == dict(
        stage=2,
        reduce_bucket_size_in_m=4.0,
        overlap_communication=False,
        cpu_offload=True,
        precision="fp16",
        initial_scale=2.0**12,
        growth_interval=500,
        hysteresis=3,
        min_scale=4,
        max_norm=1.0,
        communication_dtype=torch.bfloat16,
    )
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(FULL))
    plugin = LowLevelZeroPlugin.from_deepspeed_config(str(path), verbose=True)
    assert plugin.precision == "fp16" and plugin.stage == 2 and plugin.verbose
    assert plugin.zero_kwargs == dict(
        stage=2, reduce_bucket_size=2**22, overlap_communication=False,
        communication_dtype=torch.bfloat16, cpu_offload=True, master_weights=True, max_norm=1.0,
        overlap_cpu_step=True, gpu_update_fraction=None, cpu_update_numel=2**26,  # ZeroConfig's
        gc_every_n_steps=50,
    )  # fmt: skip
    assert plugin.scaler_kwargs == dict(
        initial_scale=2.0**12, min_scale=4, growth_factor=2, backoff_factor=0.5,
        growth_interval=500, hysteresis=3, max_scale=2**32,
    )  # fmt: skip


def test_absent_keys_take_the_documented_defaults():
    kwargs = deepspeed_to_kwargs({"zero_optimization": {"stage": 1}, "fp16": {"enabled": True}})
    # DeepSpeed's initial scale (2**16), not the plugin's 2**32.
    assert kwargs == dict(stage=1, cpu_offload=False, precision="fp16", initial_scale=2.0**16)
    assert deepspeed_to_kwargs(
        {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    ) == dict(stage=2, cpu_offload=False, precision="bf16")
    plain = deepspeed_to_kwargs({"zero_optimization": {"stage": 1, "cpu_offload": True}})
    assert plain == dict(stage=1, cpu_offload=True, precision="fp32")


def test_allgather_bucket_size_bounds_the_buckets():
    """ZeroOptimizer all-gathers in the buckets it reduces in: the smaller
    size bounds both, and the buckets really are that small."""
    both = {"stage": 2, "reduce_bucket_size": 5e8, "allgather_bucket_size": 2000}
    plugin = _quiet({"zero_optimization": both})
    assert plugin.zero_kwargs["reduce_bucket_size"] == 2000
    only = _quiet({"zero_optimization": {"stage": 2, "allgather_bucket_size": 2e8}})
    assert only.zero_kwargs["reduce_bucket_size"] == 12 * 2**20  # the plugin's default is smaller
    model = TinyGPT(CONFIG)
    _, opt, *_ = Booster(plugin=plugin).boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert len(opt.optim.buckets) > 1
    for bucket in opt.optim.buckets:
        assert len(bucket.shards) == 1 or sum(s.param.numel() for s in bucket.shards) <= 2000


# DeepSpeed's tutorials' configs as printed, and what each becomes.
TUTORIAL_CONFIGS = [
    ("getting-started.md",  # the older "zero_optimization": true is stage 1, as DeepSpeed reads it
     {"train_batch_size": 8, "gradient_accumulation_steps": 1,
      "optimizer": {"type": "Adam", "params": {"lr": 0.00015}}, "fp16": {"enabled": True},
      "zero_optimization": True},
     dict(stage=1, precision="fp16", reduce_bucket_size=12 * 2**20, cpu_offload=False)),
    ("zero.md stage 1", {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}},
     dict(stage=1, precision="fp32", reduce_bucket_size=500_000_000, cpu_offload=False)),
    ("zero.md stage 2",
     {"zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True,
                            "reduce_scatter": True, "reduce_bucket_size": 5e8,
                            "allgather_bucket_size": 5e8}},
     dict(stage=2, precision="fp32", reduce_bucket_size=500_000_000, cpu_offload=False)),
    ("zero-offload.md",
     {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                            "contiguous_gradients": True, "overlap_comm": True}},
     dict(stage=2, precision="fp32", reduce_bucket_size=12 * 2**20, cpu_offload=True)),
    ("older format, allgather_size", {"zero_optimization": True, "allgather_size": 2000},
     dict(stage=1, precision="fp32", reduce_bucket_size=2000, cpu_offload=False)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("config", "expected"), [c[1:] for c in TUTORIAL_CONFIGS], ids=[c[0] for c in TUTORIAL_CONFIGS]
)
def test_deepspeed_tutorial_configs_are_read_as_deepspeed_reads_them(config, expected):
    plugin = _quiet(config)
    got = dict(stage=plugin.stage, precision=plugin.precision)
    got.update({k: plugin.zero_kwargs[k] for k in ("reduce_bucket_size", "cpu_offload")})
    assert got == expected
    if expected["reduce_bucket_size"] < 10_000:  # the buckets really are that small
        model = TinyGPT(CONFIG)
        opt = Booster(plugin=plugin).boost(model, torch.optim.SGD(model.parameters(), lr=0.1))[1]
        assert len(opt.optim.buckets) > 1
        for bucket in opt.optim.buckets:
            assert len(bucket.shards) == 1 or sum(s.param.numel() for s in bucket.shards) <= 2000


def test_allgather_size_without_the_older_format_has_no_effect():
    with pytest.warns(UserWarning, match=r'allgather_size \(got 2000\): DeepSpeed reads it only '
                      r'with "zero_optimization": true; put zero_optimization.allgather_bucket_size'):  # fmt: skip
        plugin = LowLevelZeroPlugin.from_deepspeed_config(
            {"zero_optimization": {"stage": 2}, "allgather_size": 2000}
        )
    assert plugin.zero_kwargs["reduce_bucket_size"] == 12 * 2**20


def test_switched_off_sections_and_bookkeeping_keys_are_accepted():
    config = {
        "zero_optimization": {"stage": 2, "elastic_checkpoint": True},
        "fp16": {"enabled": False, "loss_scale": 128, "initial_scale_power": 3},
        "bf16": {"enabled": False},
        "flops_profiler": {"enabled": False, "profile_step": 1},
        "tensorboard": {"output_path": "logs/"},  # enabled defaults to false
        "wandb": {"enabled": False, "project": "p"},
        "my_own_section": {"enabled": False, "anything": 1},
        "wall_clock_breakdown": False,
        "dump_state": False,
        "prescale_gradients": True,
        "zero_allow_untested_optimizer": True,
        "activation_checkpointing": {"partition_activations": False, "profile": False},
    }
    plugin = _quiet(config)
    assert plugin.precision == "fp32" and plugin.stage == 2


def test_every_problem_is_reported_in_one_error(tmp_path):
    config = {
        "zero_optimization": {"stage": 2, "contiguous_gradients": False, "offload_optimizer":
                              {"device": "nvme"}, "mics_shard_size": 4},
        "fp16": {"enabled": True, "loss_scale": 128},
        "gradient_clipping": "auto",
        "sparse_gradients": True,
        "flops_profiler": {"enabled": True},
        "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}},
        "scheduler": {"type": "OneCycle", "params": {}},
        "train_batch_size": 0,
        "unknown_key": 1,
    }  # fmt: skip
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(DeepSpeedConfigError) as caught:
        LowLevelZeroPlugin.from_deepspeed_config(path)
    error = caught.value
    assert isinstance(error, ValueError) and isinstance(error, NotImplementedError)
    assert str(error).startswith(
        "LowLevelZeroPlugin.from_deepspeed_config: 10 key(s) of the DeepSpeed config cannot be "
        f"honoured (got {str(path)!r}); fix all of them"
    )
    expected = [
        r"zero_optimization.offload_optimizer.device is not implemented \(got 'nvme'\); NVMe: use HybridAdam",
        r"fp16.loss_scale can only be 0 \(got 128\); a static loss scale",
        r"gradient_clipping must be a number >= 0 \(got 'auto'\); put the value itself",
        r"train_batch_size must be a positive int or 'auto' \(got 0\)",
        r"optimizer.type is not Adam, AdamW or a torch.optim class .*\(got 'Lamb'\); build the optimizer yourself",
        r"scheduler.type is not one of \['WarmupLR', 'WarmupDecayLR'\] \(got 'OneCycle'\)",
        r"flops_profiler is not implemented \(got \{'enabled': True\}\); set enabled to false",
        r"sparse_gradients can only be false \(got True\)",
        r"unknown_key has no equivalent in LowLevelZeroPlugin \(got 1\); remove it",
        r"zero_optimization.mics_shard_size can only be -1 \(got 4\)",
    ]  # fmt: skip
    assert len(error.problems) == len(expected), error.problems
    for pattern in expected:
        assert any(__import__("re").match(pattern, p) for p in error.problems), pattern
    # contiguous_gradients false has no effect: a warning's, not the error's.
    assert not any("contiguous_gradients" in p for p in error.problems)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"zero_optimization": {"stage": 3}}, r"stage 3 shards the parameters too.*\(got 3\); use GeminiPlugin"),
        ({}, r"stage 0 \(DeepSpeed's default when absent\) is plain data parallelism.*; use TorchDDPPlugin"),
        ({"zero_optimization": {"stage": 4}}, r"stage must be 0-3 \(got 4\)"),
        ({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
         r"fp16.enabled and bf16.enabled are both true"),
        ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}},
         r"bf16.enabled is 'auto'.*put true or false"),
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
         r"zero_optimization.offload_param \(parameter offload\) is ZeRO-3 .* GeminiPlugin"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
         r"zero_optimization.offload_optimizer.ratio can only be 1.0 \(got 0.5\)"),
        ({"zero_optimization": {"stage": 2}, "communication_data_type": "fp8"},
         r"communication_data_type must be .*got 'fp8'"),
        ({"zero_optimization": [2]}, r"zero_optimization must be a dict \(got \[2\]\)"),
        ({"zero_optimization": False}, r"stage 0 \(DeepSpeed's default when absent\) .*use TorchDDPPlugin"),
        ({"zero_optimization": True, "allgather_size": 0}, r"allgather_size must be a number >= 1 \(got 0\)"),
        ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
         r"optimizer.params.lr is 'auto'"),
        ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"momentum": 0.9}}},
         r"optimizer.params.momentum is not an argument of AdamW"),
        ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.9]}}},
         r"optimizer.params.betas is not an argument of torch.optim.SGD"),
        ({"zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupDecayLR", "params": {}}},
         r"scheduler.params.total_num_steps is required"),
        ({"zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}},
         r"scheduler.params.warmup_num_steps is 'auto'"),
        ({"zero_optimization": {"stage": 2}, "stage3_gather": 1}, r"stage3_gather has no equivalent"),
        ({"zero_optimization": {"stage": 2}, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
          "gradient_accumulation_steps": 4}, r"train_batch_size must equal .*got train_batch_size=8, "
         r"train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=4, world size 1"),
    ],
)  # fmt: skip
def test_each_refusal_names_the_key_and_the_fix(config, match):
    with pytest.raises(DeepSpeedConfigError, match=match) as caught:
        LowLevelZeroPlugin.from_deepspeed_config(config)
    assert len(caught.value.problems) == 1, caught.value.problems


def test_keys_without_effect_are_listed_in_one_warning():
    config = {
        "zero_optimization": {"stage": 2, "contiguous_gradients": False, "round_robin_gradients": True,
                              "stage3_max_live_parameters": 1e8,
                              "offload_optimizer": {"device": "cpu", "buffer_count": 8}},
        "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                     "contiguous_memory_optimization": True, "number_checkpoints": 4,
                                     "synchronize_checkpoint_boundary": True, "profile": True},
        "steps_per_print": 100,
        "wall_clock_breakdown": True,
    }  # fmt: skip
    with pytest.warns(UserWarning) as record:
        plugin = LowLevelZeroPlugin.from_deepspeed_config(config)
    assert len(record) == 1
    message = str(record[0].message)
    assert message.startswith(
        "LowLevelZeroPlugin.from_deepspeed_config: 11 key(s) of the DeepSpeed config have no "
        "effect here (got a dict)"
    )
    for key in ("contiguous_gradients (got False)", "round_robin_gradients", "stage3_max_live_parameters",
                "buffer_count (got 8): an NVMe setting", "partition_activations (got True): it splits",
                "contiguous_memory_optimization", "number_checkpoints (got 4)",
                "synchronize_checkpoint_boundary", "profile (got True)", "steps_per_print (got 100)",
                "wall_clock_breakdown (got True)"):  # fmt: skip
        assert key in message, key
    assert plugin.deepspeed.settings.cpu_checkpointing  # honoured, not listed
    assert "cpu_checkpointing" not in message


def test_the_plugin_refuses_what_it_does_not_build():
    with pytest.raises(NotImplementedError, match=r"stage 3 .* use GeminiPlugin"):
        LowLevelZeroPlugin(stage=3)
    with pytest.raises(ValueError, match=r"stage must be 1 or 2 \(got 0\)"):
        LowLevelZeroPlugin(stage=0)
    with pytest.raises(
        ValueError, match=r"precision must be 'fp16', 'bf16' or 'fp32' \(got 'fp8'\)"
    ):
        LowLevelZeroPlugin(precision="fp8")
    with pytest.raises(NotImplementedError, match=r"norm_type=2.0 .*got 1.0"):
        LowLevelZeroPlugin(norm_type=1.0)
    with pytest.raises(NotImplementedError, match=r"overlap_allgather=True"):
        LowLevelZeroPlugin(overlap_allgather=True)
    with pytest.raises(ValueError, match=r"reduce_bucket_size_in_m must be > 0 \(got 0\)"):
        LowLevelZeroPlugin(reduce_bucket_size_in_m=0)
    assert LowLevelZeroPlugin().zero_kwargs["reduce_bucket_size"] == 12 * 2**20


# -- batch keys ----------------------------------------------------------------------------


def _batch(t=None, m=None, g=None, world=1, loader=None):
    s = DeepSpeedSettings(train_batch_size=t, micro_batch_size=m, gradient_accumulation_steps=g)
    return resolve_batch(s, world, loader, "api")


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (dict(t=32, m=4, g=4, world=2), (32, 4, 4)),
        (dict(t=32, m=4, world=2), (32, 4, 4)),  # gas derived
        (dict(t=32, g=4, world=2), (32, 4, 4)),  # micro derived
        (dict(m=4, g=4, world=2), (32, 4, 4)),  # train derived
        (dict(t=32, world=2), (32, 16, 1)),  # DeepSpeed: gas 1
        (dict(m=4, world=2), (8, 4, 1)),
        (dict(g=4, world=2, loader=3), (24, 3, 4)),  # the dataloader fills the micro batch in
        (dict(t=24, world=2, loader=3), (24, 3, 4)),
        (dict(g=2), (None, None, 2)),
        (dict(), (None, None, 1)),
    ],
)
def test_any_two_batch_keys_give_the_third(given, expected):
    assert _batch(**given) == expected


def test_batch_key_mismatches_name_every_value():
    with pytest.raises(ValueError, match=r"api: train_batch_size must equal .*\(got train_batch_size=32, "
                       r"train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2, world size 2\); "
                       r"fix one of them"):  # fmt: skip
        _batch(t=32, m=4, g=2, world=2)
    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu=8, gradient_accumulation_"
                       r"steps=0 \(derived\), world size 3"):  # fmt: skip
        _batch(t=8, m=8, world=3)  # 8 // (8 * 3) = 0 steps
    with pytest.raises(ValueError, match=r"batch_size differs .*\(got batch_size=8, train_batch_size=16, "
                       r"train_micro_batch_size_per_gpu=4 \(derived\), gradient_accumulation_steps=2, "
                       r"world size 2\); pass batch_size=4"):  # fmt: skip
        _batch(t=16, g=2, world=2, loader=8)


def test_prepare_dataloader_takes_the_config_batch_size():
    dataset = list(range(40))
    plugin = _quiet({"zero_optimization": {"stage": 2}, "train_batch_size": 12,
                     "gradient_accumulation_steps": 3})  # fmt: skip
    assert plugin.prepare_dataloader(dataset).batch_size == 4
    assert plugin.prepare_dataloader(dataset, batch_size=4, shuffle=True).batch_size == 4
    with pytest.raises(ValueError, match=r"LowLevelZeroPlugin.prepare_dataloader: batch_size differs "
                       r".*\(got batch_size=8, train_batch_size=12, train_micro_batch_size_per_gpu=4 "
                       r"\(derived\)"):  # fmt: skip
        plugin.prepare_dataloader(dataset, batch_size=8)
    auto = _quiet({"zero_optimization": {"stage": 2}, "train_batch_size": "auto",
                   "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2})  # fmt: skip
    with pytest.raises(ValueError, match=r"batch_size is required: the DeepSpeed config gives no "
                       r"micro batch size \(got \{'train_batch_size': 'auto'"):  # fmt: skip
        auto.prepare_dataloader(dataset)
    assert auto.prepare_dataloader(dataset, 5).batch_size == 5
    assert auto.deepspeed.batch("api") == (10, 5, 2)
    plain = LowLevelZeroPlugin()
    assert plain.prepare_dataloader(dataset, 7).batch_size == 7


# -- "auto" bucket sizes -----------------------------------------------------------------


class _WithConfig(nn.Module):
    def __init__(self, **config):
        super().__init__()
        self.config = type("Config", (), config)()
        self.lin = nn.Linear(24, 40)


def test_hidden_size_as_the_hugging_face_trainer_finds_it():
    assert hidden_size(_WithConfig(hidden_size=64)) == 64
    assert hidden_size(_WithConfig(n_embd=48)) == 48
    assert hidden_size(_WithConfig(hidden_sizes=[8, 32, 16])) == 32
    assert hidden_size(_WithConfig()) == 24  # the smaller side of the largest Linear
    assert hidden_size(TinyGPT(CONFIG)) == CONFIG.dim
    with pytest.raises(
        ValueError, match=r"a bucket size is 'auto' but the model's hidden size is unknown"
    ):
        hidden_size(nn.Sequential(nn.ReLU()))


def test_auto_bucket_sizes_come_from_the_hidden_size():
    plugin = _quiet({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto",
                                           "allgather_bucket_size": "auto"}})  # fmt: skip
    model = TinyGPT(CONFIG)
    _, opt, *_ = Booster(plugin=plugin).boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    bound = CONFIG.dim * CONFIG.dim
    for bucket in opt.optim.buckets:
        assert len(bucket.shards) == 1 or sum(s.param.numel() for s in bucket.shards) <= bound
    assert len(opt.optim.buckets) > 5
    # An override of the bucket size wins over "auto".
    mapped = LowLevelZeroPlugin.from_deepspeed_config(
        {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, reduce_bucket_size_in_m=1
    )
    model = TinyGPT(CONFIG)
    _, opt, *_ = Booster(plugin=mapped).boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert len(opt.optim.buckets) == 1


# -- the config's optimizer and scheduler ------------------------------------------------


def _boost(config, **boost):
    model = TinyGPT(CONFIG)
    plugin = _quiet({"zero_optimization": {"stage": 1}, **config})
    return model, Booster(plugin=plugin).boost(model, **boost)


def test_the_config_optimizer_is_built_at_boost():
    params = {"lr": 3e-4, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1}
    _, (_, opt, *_) = _boost({"optimizer": {"type": "AdamW", "params": params}})
    inner = opt.optim.optimizer
    assert isinstance(inner, HybridAdam) and inner.defaults["adamw_mode"]
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        3e-4,
        (0.8, 0.99),
        1e-6,
        0.1,
    )
    _, (_, opt, *_) = _boost({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}})
    assert not opt.optim.optimizer.defaults[
        "adamw_mode"
    ]  # Adam with L2, as DeepSpeed's adam_w_mode false
    _, (_, opt, *_) = _boost({"optimizer": {"type": "Adam", "params": {"torch_adam": True}}})
    assert type(opt.optim.optimizer) is torch.optim.AdamW  # DeepSpeed's Adam is AdamW by default
    _, (_, opt, *_) = _boost({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}})
    assert type(opt.optim.optimizer) is torch.optim.SGD and opt.param_groups[0]["momentum"] == 0.9
    model = TinyGPT(CONFIG)
    plugin = _quiet(
        {"zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {}}}
    )
    with pytest.raises(ValueError, match=r"Booster.boost: the DeepSpeed config has an optimizer "
                       r"section and boost got an optimizer too \(got SGD\)"):  # fmt: skip
        Booster(plugin=plugin).boost(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _deepspeed_warmup(i, lo, hi, n, kind, total=None):
    """DeepSpeed's WarmupLR / WarmupDecayLR learning rate at its iteration i
    (lr_schedules.py: the min lr before the first step)."""
    n = max(2, n)
    if i < 0:
        return lo
    if i < n:
        gamma = math.log(i + 1) / math.log(n) if kind == "log" else i / n
    elif total is None:
        gamma = 1.0
    else:
        gamma = max(0.0, (total - i) / max(1.0, total - n))
    return lo + (hi - lo) * gamma


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_schedulers_match_deepspeed(kind):
    for cls, extra in ((WarmupLR, {}), (WarmupDecayLR, {"total_num_steps": 12})):
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
        sched = cls(opt, warmup_min_lr=1e-4, warmup_max_lr=1e-2, warmup_num_steps=5,
                    warmup_type=kind, **extra)  # fmt: skip
        for step in range(15):
            expected = _deepspeed_warmup(
                step - 1, 1e-4, 1e-2, 5, kind, extra.get("total_num_steps")
            )
            assert opt.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12), (cls, step)
            opt.step()
            sched.step()


def test_the_config_scheduler_is_stepped_by_the_optimizer():
    config = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.1, "warmup_num_steps": 4}},
              "gradient_accumulation_steps": 2}  # fmt: skip
    _, (boosted, opt, _, _, sched) = _boost(config)
    booster = Booster(plugin=LowLevelZeroPlugin())  # backward is the optimizer's
    idx = torch.randint(0, CONFIG.vocab_size, (2, 8))
    seen = []
    with one_torch_thread():
        for micro in range(8):
            booster.backward(boosted(idx, idx), opt)
            opt.step()
            seen.append(sched.get_last_lr()[0])
            if micro == 0:
                with pytest.warns(UserWarning, match=r"lr_scheduler.step\(\) has no effect under a "
                                  r"DeepSpeed config .*optimizer.step\(\) steps it"):  # fmt: skip
                    sched.step()
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    sched.step()  # no effect, and no second warning
    boundary = [_deepspeed_warmup(i, 0.0, 0.1, 4, "log") for i in range(4)]
    assert seen == pytest.approx([0.0, boundary[0], boundary[0], boundary[1],
                                  boundary[1], boundary[2], boundary[2], boundary[3]])  # fmt: skip
    assert sched.state_dict()["last_epoch"] == 4


# -- a full ds_config.json --------------------------------------------------------------

# Every section of DeepSpeed's ZeRO-2 guide (the Hugging Face Trainer's
# ds_config_zero2.json, with the values the Trainer fills in for "auto").
ZERO2_GUIDE = {
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 8, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": False},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                              "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                      "warmup_num_steps": 2, "total_num_steps": 20,
                                                      "warmup_type": "linear"}},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": "auto",
        "contiguous_gradients": True,
    },
    "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": True,
                                 "contiguous_memory_optimization": False, "number_checkpoints": None,
                                 "synchronize_checkpoint_boundary": False, "profile": False},
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 2000,
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 4,
    "wall_clock_breakdown": False,
}  # fmt: skip


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_zero2_guide_config_boosts_and_trains(tmp_path, precision):
    config = json.loads(json.dumps(ZERO2_GUIDE))
    config["fp16"]["enabled"], config["bf16"]["enabled"] = precision == "fp16", precision == "bf16"
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    with pytest.warns(
        UserWarning, match=r"1 key\(s\) .* no effect.*\n  - steps_per_print"
    ) as record:
        plugin = LowLevelZeroPlugin.from_deepspeed_config(path)
    assert len(record) == 1
    assert plugin.precision == precision and plugin.zero_kwargs["cpu_offload"]
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    for block in model.blocks:
        forward = block.forward
        block.forward = lambda x, f=forward: torch.utils.checkpoint.checkpoint(
            f, x, use_reentrant=False
        )
    idx = torch.randint(0, CONFIG.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    dataset = [(i, torch.roll(i, -1)) for i in idx.repeat(4, 1)]
    booster = Booster(plugin=plugin)
    loader = plugin.prepare_dataloader(dataset)
    model, opt, _, loader, sched = booster.boost(model, dataloader=loader)
    assert loader.batch_size == 4 and opt.gradient_accumulation_steps == 2
    assert isinstance(opt.optim.optimizer, HybridAdam)
    losses, steps = [], 0
    with one_torch_thread():  # a model this small gains nothing from threads
        for _ in range(5):
            for x, y in loader:
                loss = model(x, y)
                booster.backward(loss, opt)
                steps += opt.step() is True
                losses.append(loss.item())
    assert steps == 10 and sched.state_dict()["last_epoch"] == 10
    assert losses[-1] < losses[0] - 0.2, losses
    assert model.host_activations.saved_tensors > 0
