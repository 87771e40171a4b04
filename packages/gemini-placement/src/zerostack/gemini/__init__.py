"""ZeRO-3 over chunks with static and automatic GPU/CPU placement."""

from zerostack.gemini.__about__ import __version__
from zerostack.gemini._ddp import GeminiDDP
from zerostack.gemini._optimizer import GeminiAdamOptimizer, GeminiOptimizer
from zerostack.gemini._placement import AutoPlacement, MemStats

__all__ = [
    "AutoPlacement",
    "GeminiAdamOptimizer",
    "GeminiDDP",
    "GeminiOptimizer",
    "MemStats",
    "__version__",
]
