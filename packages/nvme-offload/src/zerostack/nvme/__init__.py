"""Optimizer state on disk: tensornvme (io_uring / libaio) or thread I/O,
with a prefetch pipeline that hides the disk behind the optimizer step."""

from zerostack.nvme.__about__ import __version__
from zerostack.nvme._backends import BACKEND_ENV, BACKENDS, tensornvme_backends
from zerostack.nvme._swapper import NVMeSpaceError, NVMeWriteError, PrefetchPipeline, StateSwapper

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "NVMeSpaceError",
    "NVMeWriteError",
    "PrefetchPipeline",
    "StateSwapper",
    "__version__",
    "tensornvme_backends",
]
