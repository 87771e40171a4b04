"""ZeRO-3 over chunks with static and automatic GPU/CPU placement."""

from zerostack.gemini.__about__ import __version__
from zerostack.gemini._config import (
    AutoPlacementConfig,
    ChunkConfig,
    GeminiConfig,
    MixedPrecision,
    StaticPlacementConfig,
)
from zerostack.gemini._cpu_step import CpuStepError, CpuStepPipeline
from zerostack.gemini._ddp import ChunkGroup, GeminiDDP, TrainingState
from zerostack.gemini._local_state import (
    load_local_model_state,
    local_model_state,
    local_ranges,
)
from zerostack.gemini._memory import (
    HOST_OWNERS,
    TIERS,
    ChunkRow,
    HostBytes,
    MemoryTimeline,
    format_placement,
    host_bytes,
    rss_bytes,
    tier_bytes,
)
from zerostack.gemini._optimizer import GeminiAdamOptimizer, GeminiOptimizer
from zerostack.gemini._placement import AutoPlacement, MemStats, Placement, StaticPlacement

__all__ = [
    "HOST_OWNERS",
    "TIERS",
    "AutoPlacement",
    "AutoPlacementConfig",
    "ChunkConfig",
    "ChunkGroup",
    "ChunkRow",
    "CpuStepError",
    "CpuStepPipeline",
    "GeminiAdamOptimizer",
    "GeminiConfig",
    "GeminiDDP",
    "GeminiOptimizer",
    "HostBytes",
    "MemStats",
    "MemoryTimeline",
    "MixedPrecision",
    "Placement",
    "StaticPlacement",
    "StaticPlacementConfig",
    "TrainingState",
    "__version__",
    "format_placement",
    "host_bytes",
    "load_local_model_state",
    "local_model_state",
    "local_ranges",
    "rss_bytes",
    "tier_bytes",
]
