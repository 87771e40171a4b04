"""Page-locked host buffers of exactly the size asked for.

[Note: exact pinned buffers] torch's pinned allocator (``pin_memory=True``)
rounds every block up to the next power of two, so that a freed block can
serve a later request. A chunk shard of 2**26 + 20480 bf16 elements (what the
chunk search picks for an 8B GPT) then takes 256 MiB instead of 128: twice the
host memory, for the whole run. Buffers that live as long as the model or the
optimizer (chunk shards on the CPU, ZeRO's host bucket buffers, the device
lanes' masters and Adam states, the CPU step's cached buffers) come from
``pinned_empty`` instead: an anonymous mapping of the exact size (zero-filled
pages; shared, as Python's ``mmap`` makes it, so a forked DataLoader worker
does not copy it on write), page-locked with ``cudaHostRegister``. torch sees
it as pinned (``is_pinned()``), so copies to and from it are asynchronous, as
from torch's pinned blocks.

When the last tensor over such a buffer is freed, every device with a CUDA
context in this process is synchronized before the pages are unlocked and
unmapped: an asynchronous copy may still read or write them, and unlike
torch's allocator (which records an event on each copy's stream) this one
cannot know the streams. That wait is why a buffer freed every step must not
come from here. A chunk shard qualifies: it moves only when its placement is
decided (auto placement's warm-up and its plan at the first step, never in
steady state, whose evictions release gathered copies, not shards), so the
wait happens once per moved shard. Should that synchronize fail (a CUDA
error, the interpreter's exit), the pages stay mapped for the rest of the
process rather than be unmapped while still locked.

Requests under 1 MiB, and any machine without CUDA, use torch's allocator;
so does a request the driver refuses to lock (a warning, once). A refused
``cudaHostRegister`` leaves its error as the CUDA runtime's last error, which
torch's next kernel-launch check would raise as its own: it is read away
(``cudaGetLastError``) on the runtime torch loaded.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from typing import Any

import torch

logger = logging.getLogger(__name__)

EXACT_FROM_BYTES = 1 << 20  # smaller requests: torch's allocator (its rounding costs little)
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process
_warned = False
_locked: set[int] = set()  # the address of every buffer locked here and alive
_kept: list[mmap.mmap] = []  # pages whose unlock could not be done safely: never unmapped


def exact_pinned(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage is a buffer ``pinned_empty`` locked.

    Returns:
        True for such a buffer (or a view of it): page-locked, but not a block
        of torch's pinned allocator, whose statistics
        (``torch.cuda.host_memory_stats``) do not count it.
    """
    return tensor.untyped_storage().data_ptr() in _locked


class _LockedPages(mmap.mmap):
    """An anonymous mapping, page-locked for CUDA until it is collected."""

    locked_on: int | None = None  # the device current when it was locked (None: unlocked)
    address = 0

    def __del__(self) -> None:
        device = self.locked_on
        if device is None:
            return
        self.locked_on = None
        _locked.discard(self.address)
        try:  # See [Note: exact pinned buffers]
            _synchronize_devices(device)
        except Exception:  # a CUDA error, or CUDA gone at exit: unlocking is unsafe
            _kept.append(self)  # resurrected: the locked pages are never unmapped
            logger.debug("zerostack.chunk: %d locked host bytes kept mapped", len(self))
            return
        try:
            status = int(_cudart().cudaHostUnregister(self.address))
        except Exception:  # CUDA gone at exit: the process ends with its pages
            status = -1
        if status != 0:
            _clear_cuda_error()
            logger.debug("zerostack.chunk: unlocking %d host bytes failed", len(self))


def _synchronize_devices(locked_on: int) -> None:
    """Synchronize every device this process has a CUDA context on, never
    creating one (a copy through the buffer may run on any of them); with a
    torch that cannot tell, the device current when the buffer was locked."""
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has_context is None:
        torch.cuda.synchronize(locked_on)
        return
    for device in range(torch.cuda.device_count()):
        if has_context(device):
            torch.cuda.synchronize(device)


def _clear_cuda_error() -> None:
    """Read away the CUDA runtime's last error (``cudaGetLastError``) on each
    libcudart this process loaded; best effort."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except Exception:  # no /proc, or a runtime without the symbol: nothing to clear here
        logger.debug("zerostack.chunk: could not clear the CUDA runtime's last error")


def _cudart() -> Any:
    return torch.cuda.cudart()


def _torch_pinned(numel: int, dtype: torch.dtype, zero: bool) -> torch.Tensor:
    make = torch.zeros if zero else torch.empty
    return make(numel, dtype=dtype, pin_memory=True)


def pinned_empty(numel: int, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    """A page-locked host tensor of ``numel`` elements of ``dtype`` taking
    exactly its bytes, for buffers that live long; see [Note: exact pinned
    buffers].

    Args:
        numel: elements.
        dtype: their dtype.
        zero: filled with zeros. Default False (as ``torch.empty``; a buffer
            of 1 MiB or more is zeros anyway).

    Returns:
        A 1-D CPU tensor for which ``is_pinned()`` is True.

    Raises:
        RuntimeError: CUDA is not available (nothing can pin host memory).
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "zerostack.chunk.pinned_empty: page-locked memory needs CUDA (got "
            "torch.cuda.is_available() False); use torch.empty on a machine without a GPU"
        )
    nbytes = numel * dtype.itemsize
    if nbytes < EXACT_FROM_BYTES:
        return _torch_pinned(numel, dtype, zero)
    pages = _LockedPages(-1, nbytes)
    tensor = torch.frombuffer(pages, dtype=dtype, count=numel)  # zeros; holds ``pages``
    status = _cudart().cudaHostRegister(tensor.data_ptr(), nbytes, _PORTABLE)
    if int(status) != 0:
        _clear_cuda_error()
        global _warned
        if not _warned:
            _warned = True
            logger.warning(
                "zerostack.chunk: cudaHostRegister of %d bytes failed (%s); pinned buffers come "
                "from torch's allocator, which rounds each up to a power of two",
                nbytes, status,
            )  # fmt: skip
        return _torch_pinned(numel, dtype, zero)
    pages.address, pages.locked_on = tensor.data_ptr(), torch.cuda.current_device()
    _locked.add(pages.address)
    return tensor
