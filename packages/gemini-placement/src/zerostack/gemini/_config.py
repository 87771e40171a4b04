"""GeminiDDP's settings: frozen configs, validated where they are built, and
the thin keyword layer (ColossalAI's argument names) that builds them."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from zerostack.shard import changed_fields

_API = "GeminiDDP"


def _number(api: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{api}: {name} must be a number (got {value!r})")


def _int(api: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{api}: {name} must be an int (got {value!r})")


def _flags(api: str, obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, bool):
            raise TypeError(f"{api}: {name} must be a bool (got {value!r})")


def _share(api: str, name: str, value: float) -> None:
    _number(api, name, value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{api}: {name} must be in [0, 1] (got {value}); pass a share")


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkConfig:
    """How parameters are packed into chunks."""

    chunk_config_dict: Mapping[int, Mapping[str, Any]] | None = None
    """Skip the search: ``{data-parallel size: {"chunk_size": int,
    "keep_gathered": bool}}`` (what ``search_chunk_configuration`` returns);
    the entry for the process group's size is used. Default None (search)."""
    search_range_m: int = 32
    """Search range of the chunk size, in millions of elements. Default 32."""
    hidden_dim: int | None = None
    """Step of the search (the model's hidden size). Default None (1024)."""
    min_chunk_size_m: float = 32
    """Smallest chunk the search considers, in millions of elements. Default 32."""
    pin_memory: bool = False
    """Pin CPU shards (needs CUDA; auto placement on CUDA always pins). Default False."""
    enable_gradient_accumulation: bool = False
    """Keep gradients in chunks of their own so that ``no_sync()`` can
    accumulate several backward passes before one reduction. Default False."""

    def __post_init__(self) -> None:
        _number(_API, "search_range_m", self.search_range_m)
        _number(_API, "min_chunk_size_m", self.min_chunk_size_m)
        _flags(_API, self, "pin_memory", "enable_gradient_accumulation")
        if self.hidden_dim is not None:
            _int(_API, "hidden_dim", self.hidden_dim)
            if self.hidden_dim < 1:
                raise ValueError(
                    f"{_API}: hidden_dim must be >= 1 or None (got {self.hidden_dim}); it is the "
                    "step of the chunk size search"
                )
        if self.chunk_config_dict is not None and not isinstance(self.chunk_config_dict, Mapping):
            raise TypeError(
                f"{_API}: chunk_config_dict must be a dict {{dp size: {{'chunk_size': int}}}} "
                f"or None (got {self.chunk_config_dict!r})"
            )
        if self.search_range_m < 0 or self.min_chunk_size_m < 0:
            raise ValueError(
                f"{_API}: search_range_m and min_chunk_size_m must be >= 0 "
                f"(got {self.search_range_m}, {self.min_chunk_size_m})"
            )
        for key, entry in (self.chunk_config_dict or {}).items():
            if not isinstance(entry, Mapping):
                raise TypeError(
                    f"{_API}: chunk_config_dict[{key!r}] must be a dict with chunk_size (got "
                    f"{entry!r}); see search_chunk_configuration"
                )
            unknown = sorted(set(entry) - {"chunk_size", "keep_gathered"})
            if unknown or "chunk_size" not in entry:
                raise ValueError(
                    f"{_API}: chunk_config_dict[{key!r}] must hold chunk_size (and optionally "
                    f"keep_gathered) (got keys {sorted(entry)}); see search_chunk_configuration"
                )
            size = entry["chunk_size"]
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(
                    f"{_API}: chunk_config_dict[{key!r}]['chunk_size'] must be an int >= 1 "
                    f"(got {size!r})"
                )
            if not isinstance(entry.get("keep_gathered", False), bool):
                raise TypeError(
                    f"{_API}: chunk_config_dict[{key!r}]['keep_gathered'] must be a bool "
                    f"(got {entry['keep_gathered']!r})"
                )


@dataclass(frozen=True, kw_only=True, slots=True)
class StaticPlacementConfig:
    """Fixed shares of the model on the CPU (``placement_policy="static"``)."""

    shard_param_frac: float = 1.0
    """Share of parameter bytes, in registration order, in sharded chunks
    (ZeRO-3); the rest stay whole on every rank (ZeRO-2). Below 1 it
    overrides the chunk configuration's keep_gathered. Default 1.0."""
    offload_optim_frac: float = 0.0
    """Share of fp32 master chunks (with their optimizer states) stepped on
    the CPU: the fewest last ones in registration order that hold at least
    this share of the elements (whole chunks: any share above 0 offloads
    one). Default 0.0."""
    offload_param_frac: float = 0.0
    """Share of parameter shards kept on the CPU between uses. Default 0.0."""
    max_prefetch: int = 0
    """Gather up to this many chunks ahead of use, asynchronously, in the
    order the first training iteration recorded (a shard on the host is
    copied beside compute). Default 0."""

    def __post_init__(self) -> None:
        for name in ("shard_param_frac", "offload_optim_frac", "offload_param_frac"):
            _share(_API, name, getattr(self, name))
        _prefetch_depth(self.max_prefetch)


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoPlacementConfig:
    """Placement measured and decided at run time (``placement_policy="auto"``)."""

    warmup_non_model_data_ratio: float = 0.8
    """Share of the capacity left to activations during the warm-up iteration. Default 0.8."""
    steady_cuda_cap_ratio: float = 0.9
    """Share of the capacity the placement may use after warm-up (less the
    measured non-model peak). Default 0.9."""
    gpu_capacity_bytes: int | None = None
    """Device memory to plan for. Default: the CUDA device's total memory;
    required on a CPU compute device (placement is bookkeeping there)."""
    max_prefetch: int = 0
    """Gather up to this many chunks ahead of use, asynchronously, while
    they fit under the steady limit (a shard on the host is copied beside
    compute). Default 0."""

    def __post_init__(self) -> None:
        _share(_API, "warmup_non_model_data_ratio", self.warmup_non_model_data_ratio)
        _share(_API, "steady_cuda_cap_ratio", self.steady_cuda_cap_ratio)
        _prefetch_depth(self.max_prefetch)
        if self.gpu_capacity_bytes is not None:
            _int(_API, "gpu_capacity_bytes", self.gpu_capacity_bytes)
        if self.gpu_capacity_bytes is not None and self.gpu_capacity_bytes <= 0:
            raise ValueError(
                f"{_API}: gpu_capacity_bytes must be > 0 (got {self.gpu_capacity_bytes})"
            )


def _prefetch_depth(value: Any) -> None:
    _int(_API, "max_prefetch", value)
    if value < 0:
        raise ValueError(f"{_API}: max_prefetch must be >= 0 (got {value})")


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True, kw_only=True, slots=True)
class MixedPrecision:
    """The compute dtype and what is cast to it."""

    param_dtype: torch.dtype = torch.float16
    """Dtype of the parameter chunks, of forward and of backward (fp32
    masters are kept apart). Default torch.float16."""
    cast_forward_inputs: bool = True
    """Cast floating-point tensors passed to forward to ``param_dtype``. Default True."""
    cast_buffers: bool = True
    """Cast floating-point buffers to ``param_dtype`` at wrap time. Default True."""

    def __post_init__(self) -> None:
        if not isinstance(self.param_dtype, torch.dtype):
            raise TypeError(
                f"{_API}: mixed_precision must be float16, bfloat16 or float32, a torch.dtype "
                f"(got {self.param_dtype!r})"
            )
        _flags(_API, self, "cast_forward_inputs", "cast_buffers")
        if self.param_dtype not in _DTYPES:
            raise ValueError(
                f"{_API}: mixed_precision must be float16, bfloat16 or float32 (got {self.param_dtype})"
            )


# Every field's default, read by GeminiConfig.from_kwargs (and by booster-api's
# GeminiPlugin through the public classes): the dataclasses are their one source.
_CHUNK = ChunkConfig()
_STATIC = StaticPlacementConfig()
_AUTO = AutoPlacementConfig()
_MIXED = MixedPrecision()


@dataclass(frozen=True, kw_only=True, slots=True)
class GeminiConfig:
    """Every setting of GeminiDDP (what booster-api's GeminiPlugin passes down)."""

    placement: StaticPlacementConfig | AutoPlacementConfig = field(
        default_factory=StaticPlacementConfig
    )
    """Where chunks live. Default StaticPlacementConfig() (all on the compute device)."""
    chunk: ChunkConfig = field(default_factory=ChunkConfig)
    """Chunk sizes and gradient chunks. Default ChunkConfig()."""
    precision: MixedPrecision = field(default_factory=MixedPrecision)
    """Compute dtype and casts. Default MixedPrecision() (fp16)."""
    enable_async_reduce: bool = True
    """Reduce chunks asynchronously during backward. Default True."""
    scatter_after_inference: bool = True
    """Release gathered chunks after a forward without grad. Default True."""

    def __post_init__(self) -> None:
        if not isinstance(self.placement, (StaticPlacementConfig, AutoPlacementConfig)):
            raise TypeError(
                f"{_API}: placement must be a StaticPlacementConfig or AutoPlacementConfig "
                f"(got {type(self.placement).__name__})"
            )
        for name, kind in (("chunk", ChunkConfig), ("precision", MixedPrecision)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(
                    f"{_API}: {name} must be a {kind.__name__} (got "
                    f"{type(getattr(self, name)).__name__})"
                )
        _flags(_API, self, "enable_async_reduce", "scatter_after_inference")

    @property
    def auto(self) -> bool:
        return isinstance(self.placement, AutoPlacementConfig)

    @classmethod
    def from_kwargs(
        cls,
        *,
        placement_policy: str = "static",
        shard_param_frac: float = _STATIC.shard_param_frac,
        offload_optim_frac: float = _STATIC.offload_optim_frac,
        offload_param_frac: float = _STATIC.offload_param_frac,
        warmup_non_model_data_ratio: float = _AUTO.warmup_non_model_data_ratio,
        steady_cuda_cap_ratio: float = _AUTO.steady_cuda_cap_ratio,
        gpu_capacity_bytes: int | None = _AUTO.gpu_capacity_bytes,
        max_prefetch: int = _AUTO.max_prefetch,
        search_range_m: int = _CHUNK.search_range_m,
        hidden_dim: int | None = _CHUNK.hidden_dim,
        min_chunk_size_m: float = _CHUNK.min_chunk_size_m,
        pin_memory: bool = _CHUNK.pin_memory,
        chunk_config_dict: Mapping | None = _CHUNK.chunk_config_dict,
        enable_gradient_accumulation: bool = _CHUNK.enable_gradient_accumulation,
        mixed_precision: torch.dtype = _MIXED.param_dtype,
        cast_forward_inputs: bool = _MIXED.cast_forward_inputs,
        # The class body's names: this class's own fields' defaults above.
        enable_async_reduce: bool = enable_async_reduce,
        scatter_after_inference: bool = scatter_after_inference,
        master_weights: bool = True,
    ) -> GeminiConfig:
        """The config ColossalAI's keyword arguments describe (see GeminiDDP).

        Raises:
            ValueError: a bad policy name, share or dtype; static fractions under "auto".
            NotImplementedError: master_weights=False.
        """
        if placement_policy in _LEGACY_POLICIES:
            placement_policy, shard_param_frac, offload_optim_frac, offload_param_frac = (
                _legacy_policy(placement_policy, shard_param_frac, offload_optim_frac,
                               offload_param_frac)
            )  # fmt: skip
        if placement_policy not in ("static", "auto"):
            raise ValueError(
                f"{_API}: placement_policy must be 'static' or 'auto', or ColossalAI's older "
                f"'cpu' or 'cuda' (got {placement_policy!r}); 'cpu' is static with "
                "shard_param_frac=1.0, offload_optim_frac=1.0, offload_param_frac=1.0"
            )
        if not master_weights:
            raise NotImplementedError(
                f"{_API}: master_weights=False (stepping the fp16/bf16 chunks directly) is not "
                "implemented; use master_weights=True"
            )
        static = StaticPlacementConfig(
            shard_param_frac=shard_param_frac,
            offload_optim_frac=offload_optim_frac,
            offload_param_frac=offload_param_frac,
            max_prefetch=max_prefetch,
        )
        auto = AutoPlacementConfig(
            warmup_non_model_data_ratio=warmup_non_model_data_ratio,
            steady_cuda_cap_ratio=steady_cuda_cap_ratio,
            gpu_capacity_bytes=gpu_capacity_bytes,
            max_prefetch=max_prefetch,
        )
        placement = _choose_placement(placement_policy, static, auto, pin_memory)
        if chunk_config_dict is not None:
            _warn_search_unused(search_range_m, hidden_dim, min_chunk_size_m)
        return cls(
            placement=placement,
            chunk=ChunkConfig(
                chunk_config_dict=chunk_config_dict,
                search_range_m=search_range_m,
                hidden_dim=hidden_dim,
                min_chunk_size_m=min_chunk_size_m,
                pin_memory=pin_memory,
                enable_gradient_accumulation=enable_gradient_accumulation,
            ),
            precision=MixedPrecision(
                param_dtype=mixed_precision, cast_forward_inputs=cast_forward_inputs
            ),
            enable_async_reduce=enable_async_reduce,
            scatter_after_inference=scatter_after_inference,
        )


def _choose_placement(
    policy: str, static: StaticPlacementConfig, auto: AutoPlacementConfig, pin_memory: bool
) -> StaticPlacementConfig | AutoPlacementConfig:
    """The placement ``policy`` names; options of the other policy are refused
    ("auto" with static shares) or warned about (static with auto's ratios)."""
    if policy == "auto":
        if replace(static, max_prefetch=0) != _STATIC:
            raise ValueError(
                f"{_API}: shard_param_frac, offload_optim_frac and offload_param_frac are for "
                "placement_policy='static'; 'auto' decides placement itself"
            )
    else:
        _warn_unused(
            replace(auto, max_prefetch=0), _AUTO, "under placement_policy='static'; it is an option "
            "of placement_policy='auto'",
        )  # fmt: skip
        if pin_memory and static.offload_optim_frac == 0 and static.offload_param_frac == 0:
            _warn(
                "pin_memory=True has no effect: placement_policy='static' without "
                "offload_optim_frac or offload_param_frac keeps no chunk on the CPU; set one "
                "of them, or leave pin_memory=False"
            )
    return auto if policy == "auto" else static


def _warn_search_unused(
    search_range_m: int, hidden_dim: int | None, min_chunk_size_m: float
) -> None:
    """Warn about chunk-search options given beside chunk_config_dict."""
    search = ChunkConfig(
        search_range_m=search_range_m, hidden_dim=hidden_dim, min_chunk_size_m=min_chunk_size_m
    )
    _warn_unused(
        search, _CHUNK, "with chunk_config_dict (the chunk size is given, there "
        "is no search); remove it, or chunk_config_dict to search",
    )  # fmt: skip


# ColossalAI's placement policies before "static"/"auto" (its Gemini docs give
# these equivalences): (shard_param_frac, offload_optim_frac, offload_param_frac).
_LEGACY_POLICIES = {"cpu": (1.0, 1.0, 1.0), "cuda": (1.0, 0.0, 0.0)}


def _legacy_policy(
    name: str, shard: float, optim: float, param: float
) -> tuple[str, float, float, float]:
    """The older "cpu" / "cuda" as the static shares they stand for; a share set beside
    them that says otherwise is refused rather than silently overridden."""
    wanted = _LEGACY_POLICIES[name]
    given = (shard, optim, param)
    if given != (1.0, 0.0, 0.0) and given != wanted:
        raise ValueError(
            f"{_API}: placement_policy={name!r} fixes shard_param_frac, offload_optim_frac and "
            f"offload_param_frac to {wanted} (got {given}); use placement_policy='static' "
            "with your shares"
        )
    return ("static", *wanted)


def _warn_unused(given: Any, default: Any, why: str) -> None:
    """Warn (once per option and place) about options that have no effect."""
    for name in changed_fields(given, default):
        _warn(f"{name}={getattr(given, name)!r} has no effect {why}", stacklevel=5)


def _warn(message: str, stacklevel: int = 4) -> None:
    # stacklevel: the caller of GeminiDDP(...) or of GeminiPlugin(...).
    warnings.warn(f"{_API}: {message}", UserWarning, stacklevel=stacklevel)
