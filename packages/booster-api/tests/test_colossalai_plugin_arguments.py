"""The plugins take ColossalAI's constructor arguments in its positional
order, with its defaults (colossalai/booster/plugin/torch_ddp_plugin.py,
low_level_zero_plugin.py, gemini_plugin.py at hpcaitech/ColossalAI
4f9953be); those that are not built here raise unless off. fp8 and
extra_dp_size were a ``TypeError``, and LowLevelZeroPlugin's zerostack-only
``gpu_update_fraction`` sat between ``cpu_offload`` and ``master_weights``."""

from __future__ import annotations

import inspect

import pytest

from zerostack.booster import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin

# ColossalAI's arguments, in order, with their defaults.
COLOSSALAI = {
    TorchDDPPlugin: [
        ("broadcast_buffers", True), ("bucket_cap_mb", 25), ("find_unused_parameters", False),
        ("check_reduction", False), ("gradient_as_bucket_view", False), ("static_graph", False),
        ("fp8_communication", False),
    ],
    LowLevelZeroPlugin: [
        ("stage", 1), ("precision", "fp16"), ("initial_scale", 2**32), ("min_scale", 1),
        ("growth_factor", 2), ("backoff_factor", 0.5), ("growth_interval", 1000),
        ("hysteresis", 2), ("max_scale", 2**32), ("max_norm", 0.0), ("norm_type", 2.0),
        ("reduce_bucket_size_in_m", 12), ("communication_dtype", None),
        ("overlap_communication", True), ("overlap_allgather", False), ("cpu_offload", False),
        ("master_weights", True), ("verbose", False), ("cast_inputs", True),
        ("fp8_communication", False), ("use_fp8", False), ("extra_dp_size", 1),
    ],
}  # fmt: skip
# (plugin, argument, a value that is not built here)
NOT_BUILT = [
    (TorchDDPPlugin, "fp8_communication", True),
    (LowLevelZeroPlugin, "fp8_communication", True),
    (LowLevelZeroPlugin, "use_fp8", True),
    (LowLevelZeroPlugin, "extra_dp_size", 2),
    (GeminiPlugin, "fp8_communication", True),
    (GeminiPlugin, "use_fp8", True),
    (GeminiPlugin, "extra_dp_size", 2),
]


@pytest.mark.parametrize("plugin", list(COLOSSALAI), ids=lambda c: c.__name__)
def test_colossalai_arguments_in_its_order_with_its_defaults(plugin):
    positional = [
        (name, p.default)
        for name, p in inspect.signature(plugin).parameters.items()
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
    assert positional == COLOSSALAI[plugin]
    defaults = [value for _, value in COLOSSALAI[plugin]]
    plugin(*defaults)  # every argument positionally, as ColossalAI's signature allows


@pytest.mark.parametrize(("plugin", "name", "value"), NOT_BUILT)
def test_options_not_built_here_raise_unless_off(plugin, name, value):
    with pytest.raises(NotImplementedError, match=rf"{name} is not implemented \(got {value}\)"):
        plugin(**{name: value})
