"""LowLevelZeroPlugin.from_deepspeed_config: what maps, what is accepted at
DeepSpeed's default, and what is refused (with the key named)."""

from __future__ import annotations

import json

import pytest
import torch

from zerostack.booster import LowLevelZeroPlugin
from zerostack.booster._plugins._deepspeed import deepspeed_to_kwargs

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
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
    "zero_allow_untested_optimizer": True,
}


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


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({"zero_optimization": {"stage": 3}}, NotImplementedError, r"stage 3 .* use GeminiPlugin"),
        ({}, NotImplementedError, r"stage 0 .* use TorchDDPPlugin"),
        ({"zero_optimization": {"stage": 4}}, ValueError, r"stage must be 0-3 \(got 4\)"),
        ({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
         ValueError, r"fp16.enabled and bf16.enabled are both true"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
         NotImplementedError, r"zero_optimization.offload_optimizer.device .*got 'nvme'"),
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
         NotImplementedError, r"zero_optimization.offload_param .* GeminiPlugin"),
        ({"zero_optimization": {"stage": 2, "allgather_bucket_size": 2e8}},
         NotImplementedError, r"zero_optimization.allgather_bucket_size has no equivalent .*got 200000000.0"),
        ({"zero_optimization": {"stage": 2, "contiguous_gradients": False}},
         NotImplementedError, r"zero_optimization.contiguous_gradients"),
        ({"zero_optimization": {"stage": 2, "stage3_max_live_parameters": 1e8}},
         NotImplementedError, r"stage3_max_live_parameters"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
         NotImplementedError, r"zero_optimization.offload_optimizer.ratio"),
        ({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "loss_scale": 128}},
         NotImplementedError, r"fp16.loss_scale .*got 128"),
        ({"zero_optimization": {"stage": 2}, "train_batch_size": 32},
         NotImplementedError, r"train_batch_size .*prepare_dataloader"),
        ({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4},
         NotImplementedError, r"gradient_accumulation_steps .* booster.no_sync"),
        ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}},
         NotImplementedError, r"optimizer has no equivalent .* pass it to booster.boost"),
        ({"zero_optimization": {"stage": 2}, "flops_profiler": {"enabled": False}},
         NotImplementedError, r"flops_profiler"),
        ({"zero_optimization": {"stage": 2}, "communication_data_type": "fp8"},
         ValueError, r"communication_data_type must be .*got 'fp8'"),
        ({"zero_optimization": {"stage": 2}, "gradient_clipping": "auto"},
         ValueError, r"gradient_clipping is 'auto'"),
        ({"zero_optimization": [2]}, TypeError, r"zero_optimization must be a dict \(got list\)"),
    ],
)  # fmt: skip
def test_refusals_name_the_key(config, error, match):
    with pytest.raises(error, match=match):
        LowLevelZeroPlugin.from_deepspeed_config(config)


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
