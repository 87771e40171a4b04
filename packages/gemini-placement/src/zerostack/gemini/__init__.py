"""ZeRO-3 over chunks with static GPU/CPU placement."""

from zerostack.gemini.__about__ import __version__
from zerostack.gemini._ddp import GeminiDDP
from zerostack.gemini._optimizer import GeminiOptimizer

__all__ = ["GeminiDDP", "GeminiOptimizer", "__version__"]
