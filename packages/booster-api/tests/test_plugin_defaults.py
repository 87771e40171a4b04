"""The plugins' defaults are the configs' defaults: each argument that a
config dataclass (GeminiConfig and its parts, ZeroConfig, LossScalerConfig)
or a wrapper (GeminiOptimizer, ZeroOptimizer, AMPOptimizer, GeminiDDP's
keywords) also takes has the same default everywhere, and a plugin built
with no argument builds exactly the default configs. Where ColossalAI's
plugin has a default of its own, the table below says so."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from zerostack.auto_offload import AMPOptimizer
from zerostack.booster import AutoOffloadPlugin, GeminiPlugin, LowLevelZeroPlugin
from zerostack.booster._plugins._base import PRECISION_DTYPES
from zerostack.booster._plugins._gemini import _NOT_BUILT
from zerostack.gemini import (
    AutoPlacementConfig,
    ChunkConfig,
    GeminiConfig,
    GeminiOptimizer,
    MixedPrecision,
)
from zerostack.shard import DynamicLossScaler, LossScalerConfig, ZeroConfig, ZeroOptimizer

# ColossalAI's LowLevelZeroPlugin defaults that differ from ZeroOptimizer's
# and DynamicLossScaler's (its docs: stage 1, 12M-element buckets, 2**32).
LOW_LEVEL_ZERO_OWN = {"stage": 1, "reduce_bucket_size": 12 * 2**20, "initial_scale": 2.0**32}
# Arguments that no config holds: what they mean is the plugin's own.
NO_CONFIG = {
    "GeminiConfig.from_kwargs": {"placement_policy", "master_weights"},
    "AMPOptimizer": {"norm_type"},
    "GeminiPlugin": {"chunk_init_device", "device", "placement_policy", "master_weights",
                     "strict_ddp_mode", "verbose", "norm_type"},
    "LowLevelZeroPlugin": {"precision", "norm_type", "overlap_allgather", "verbose",
                           "cast_inputs", "reduce_bucket_size_in_m", "fp8_communication",
                           "use_fp8", "extra_dp_size"},
    "AutoOffloadPlugin": {"memory_budget", "solver_name", "precision", "example_inputs",
                          "max_norm", "profile", "device"},
}  # fmt: skip


def defaults(fn: Any) -> dict[str, Any]:
    """A callable's keyword defaults (classes: their ``__init__``'s)."""
    return {
        n: p.default
        for n, p in inspect.signature(fn).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def field_defaults(*configs: Any) -> dict[str, Any]:
    """Every field of the default-built ``configs`` and of the configs they
    hold, by name; a name in two of them (``max_prefetch``, in both
    placement configs) has one default."""
    out: dict[str, Any] = {}
    for config in configs:
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            inner = field_defaults(value) if dataclasses.is_dataclass(value) else {f.name: value}
            clash = sorted(n for n in set(inner) & set(out) if not same(inner[n], out[n]))
            assert not clash, f"{clash} in two configs with two defaults"
            out.update(inner)
    return out


def same(a: Any, b: Any) -> bool:
    """Equal, and of one type (an int default where the config has a float is fine)."""
    numbers = all(isinstance(x, int | float) and not isinstance(x, bool) for x in (a, b))
    return a == b and (type(a) is type(b) or numbers)


def check(api: str, given: dict[str, Any], expected: dict[str, Any]) -> None:
    """``given`` defaults agree with ``expected`` wherever both have the name,
    and every argument of ``api`` has a source (or is one of its own)."""
    wrong = {
        n: (v, expected[n]) for n, v in given.items() if n in expected and not same(v, expected[n])
    }
    assert not wrong, f"{api}: defaults that differ from their config's (got, config): {wrong}"
    orphans = set(given) - set(expected) - NO_CONFIG.get(api, set())
    assert not orphans, f"{api}: arguments whose default no config holds: {sorted(orphans)}"


def gemini_expected() -> dict[str, Any]:
    gemini = GeminiConfig()
    own = field_defaults(gemini, AutoPlacementConfig())  # gemini holds StaticPlacementConfig()
    own["mixed_precision"] = own.pop("param_dtype")
    return own


def test_gemini_keywords_are_the_config_fields():
    """GeminiConfig.from_kwargs (GeminiDDP's keywords) defaults to the fields."""
    assert GeminiConfig.from_kwargs() == GeminiConfig()
    kw = defaults(GeminiConfig.from_kwargs)
    check("GeminiConfig.from_kwargs", kw, gemini_expected())
    assert kw["placement_policy"] == ("auto" if GeminiConfig().auto else "static")
    assert {f.name for f in dataclasses.fields(ChunkConfig)} <= set(kw)
    assert {f.name for f in dataclasses.fields(MixedPrecision)} - {"cast_buffers"} <= set(kw) | {
        "param_dtype"
    }


def test_gemini_plugin_defaults_are_the_configs():
    plugin_defaults = defaults(GeminiPlugin)
    expected = {
        **gemini_expected(),
        **field_defaults(LossScalerConfig()),
        **{n: v for n, v in defaults(GeminiOptimizer).items() if n != "loss_scaler"},
        **_NOT_BUILT,
    }
    expected["precision"] = next(
        k for k, v in PRECISION_DTYPES.items() if v == expected.pop("mixed_precision")
    )
    check("GeminiPlugin", plugin_defaults, expected)
    # the keywords GeminiDDP and GeminiPlugin share, by name
    shared = set(defaults(GeminiConfig.from_kwargs)) & set(plugin_defaults)
    assert {n: plugin_defaults[n] for n in shared} == {
        n: defaults(GeminiConfig.from_kwargs)[n] for n in shared
    }
    plugin = GeminiPlugin()
    assert plugin.gemini_config == GeminiConfig()
    assert plugin.scaler_config == LossScalerConfig()


def test_low_level_zero_plugin_defaults_are_the_configs():
    zero, scaler = field_defaults(ZeroConfig()), field_defaults(LossScalerConfig())
    for name, value in LOW_LEVEL_ZERO_OWN.items():
        config = zero if name in zero else scaler
        assert config[name] != value, f"{name}: the plugin's own default is the config's now"
        config[name] = value
    given = defaults(LowLevelZeroPlugin)
    check("LowLevelZeroPlugin", given, {**zero, **scaler})
    assert given["reduce_bucket_size_in_m"] * 2**20 == LOW_LEVEL_ZERO_OWN["reduce_bucket_size"]
    plugin = LowLevelZeroPlugin()
    own = {n: v for n, v in LOW_LEVEL_ZERO_OWN.items() if n != "initial_scale"}
    assert plugin.zero_config == ZeroConfig(**own)
    assert plugin.scaler_config == LossScalerConfig(initial_scale=2.0**32)


def test_zero_optimizer_keywords_are_zero_config_fields():
    given = defaults(ZeroOptimizer)
    fields = field_defaults(ZeroConfig())
    assert set(fields) <= set(given), sorted(set(fields) - set(given))
    check("ZeroOptimizer", {n: given[n] for n in fields}, fields)


@pytest.mark.parametrize("api", [AutoOffloadPlugin, AMPOptimizer], ids=lambda c: c.__name__)
def test_loss_scaler_keywords_are_loss_scaler_config_fields(api):
    check(api.__name__, defaults(api), {**field_defaults(LossScalerConfig()), "clipping_norm": 0.0})
    assert DynamicLossScaler().config == LossScalerConfig()


def test_a_disagreeing_default_is_reported():
    """The check itself fails on a default that is not the config's."""
    with pytest.raises(AssertionError, match=r"search_range_m"):
        check("GeminiPlugin", {"search_range_m": 64}, gemini_expected())
    with pytest.raises(AssertionError, match=r"no config holds: \['new_option'\]"):
        check("GeminiPlugin", {"new_option": 1}, gemini_expected())

    @dataclasses.dataclass
    class One:
        x: int = 1

    @dataclasses.dataclass
    class Two:
        x: int = 2

    with pytest.raises(AssertionError, match=r"\['x'\] in two configs with two defaults"):
        field_defaults(One(), Two())
