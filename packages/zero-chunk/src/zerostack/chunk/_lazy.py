"""LazyInitContext: build a model on the meta device, then materialize it module
by module, straight into chunks, so that it never exists whole anywhere."""

from __future__ import annotations

import functools
import hashlib
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as _module_hooks

from zerostack.chunk import _comm
from zerostack.chunk._chunk import _default_device, check_device
from zerostack.chunk._manager import ChunkManager

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class _Record:
    rng_state: torch.Tensor  # the CPU generator's state when the `with` block began


# Weak, so that a dropped model leaves nothing behind.
_BUILT: weakref.WeakKeyDictionary[nn.Module, _Record] = weakref.WeakKeyDictionary()
_MATERIALIZED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class LazyInitContext:
    """Build models on the meta device; materialize them later with real values.

    ``with LazyInitContext(): model = MyModel(...)`` allocates no parameter or
    buffer (construction runs under ``torch.device("meta")``). The context
    records which modules were built in it and the CPU RNG state at entry
    (meta tensors draw no random numbers).

    Materialization replays initialisation, not construction: walking
    ``model.modules()`` in order, each module that owns meta tensors gets them
    as uninitialised CPU tensors and runs ``reset_parameters()``, under a fork
    of the recorded RNG state. Values are thus drawn on the CPU whatever the
    target device, the global RNG is left alone, and they equal eager
    construction (same seed, then moved) whenever eager init is exactly the
    modules' ``reset_parameters`` in module order (stacks of torch's Linear,
    Embedding, LayerNorm, conv and norm layers). A tied parameter keeps its
    first owner's value; later owners initialise a scratch copy, consuming the
    RNG as eager construction did before the tie. Parameter objects keep their
    identity (``swap_tensors``), so ties and earlier references stay valid.

    Limits: values computed in ``__init__`` (a buffer from ``torch.arange``, a
    re-init of child layers as ``TinyGPT`` does) are lost on meta; a module with
    meta tensors and no ``reset_parameters`` makes materialization raise. Pass
    ``init_fn`` then: a model-level initialiser, called once as
    ``init_fn(model)`` (e.g. ``TinyGPT.reset_parameters``). It needs the whole
    model on the CPU at once, so only the per-module path keeps ``distribute``'s
    peak at one module. Tensors created with an explicit ``device=`` are real
    and kept unless their module is re-initialised.
    """

    def __init__(self) -> None:
        self._handles: list = []
        self._device_ctx: torch.device | None = None

    def __enter__(self) -> LazyInitContext:
        if self._handles:
            raise RuntimeError(
                "LazyInitContext: this context is already entered (got a nested `with` on it); "
                "use a new LazyInitContext() for each `with`"
            )
        record = _Record(torch.random.get_rng_state())

        def remember(module: nn.Module, name: str, value: object) -> None:
            _BUILT[module] = record

        self._handles = [
            _module_hooks.register_module_parameter_registration_hook(remember),
            _module_hooks.register_module_buffer_registration_hook(remember),
            _module_hooks.register_module_module_registration_hook(remember),
        ]
        self._device_ctx = torch.device("meta")
        self._device_ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._device_ctx.__exit__(*exc)
        self._device_ctx = None

    @staticmethod
    def materialize(
        model: nn.Module,
        device: torch.device | str = "cpu",
        init_fn: Callable[[nn.Module], None] | None = None,
    ) -> nn.Module:
        """Give a lazily built model real, initialised tensors on ``device``.

        Args:
            model: a model built under ``LazyInitContext``.
            device: where the tensors go; values are drawn on the CPU. Default "cpu".
            init_fn: called once as ``init_fn(model)`` instead of the per-module
                ``reset_parameters``. Default None.

        Returns:
            ``model``, whole, with the same parameter objects.

        Raises:
            ValueError: the model was not built under LazyInitContext.
            RuntimeError: the model was already materialized or distributed.
            NotImplementedError: a module has meta tensors, no
                ``reset_parameters`` and no ``init_fn`` was given.
        """
        api = "LazyInitContext.materialize"
        _check_model(api, model)
        device = check_device(api, "device", device)

        def place(tensors: list[tuple[torch.Tensor, bool]]) -> None:
            for t, _ in tensors:
                if t.device != device:
                    t.data = t.data.to(device)

        _materialize(model, "LazyInitContext.materialize", init_fn, place)
        return model

    @staticmethod
    def distribute(
        model: nn.Module,
        chunk_manager: ChunkManager,
        *,
        config_key: object,
        group_type: str = "fp16_param",
        process_group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        init_fn: Callable[[nn.Module], None] | None = None,
        cpu_offload: bool = False,
        pin_memory: bool = False,
        register_fn: Callable[[torch.Tensor], None] | None = None,
    ) -> nn.Module:
        """Materialize a lazily built model one module at a time into chunks.

        Each parameter is initialised on the CPU, cast to ``dtype``, registered
        with ``chunk_manager`` (which copies it into its chunk) and its
        temporary dropped before the next module, in ``model.parameters()``
        order, tied parameters once; then every chunk is closed (sharded).
        Peak extra memory is one module's own tensors plus the open chunk.
        Buffers go whole to the chunk manager's compute device. Every rank must
        have entered the context with the same RNG state (checked).

        Args:
            model: a model built under ``LazyInitContext``.
            chunk_manager: receives the parameters.
            config_key: the chunk configuration key for ``register_tensor``.
            group_type: the chunk group. Default "fp16_param".
            process_group: the group sharing the chunks. Default None (the default group).
            dtype: floating-point parameters are cast to it first. Default None (keep).
            init_fn: as in ``materialize``. Default None.
            cpu_offload: keep the shards on the CPU. Default False.
            pin_memory: pin CPU shards. Default False.
            register_fn: called with each materialized (and cast) parameter
                instead of ``chunk_manager.register_tensor``, for callers that
                register more than the parameter (GeminiDDP adds its fp32
                master). Default None.

        Returns:
            ``model``, its parameters now views into the chunks.

        Raises:
            ValueError: the model was not built under LazyInitContext.
            RuntimeError: already materialized, or ranks' RNG states differ.
            NotImplementedError: as in ``materialize``.
        """
        api = "LazyInitContext.distribute"
        # Checked before any module is materialized: a bad argument leaves
        # the model on meta, ready for a corrected call.
        _check_distribute_args(api, model, chunk_manager, config_key, dtype, register_fn)
        buffer_device = chunk_manager.compute_device or _default_device()
        chunks_before = len(chunk_manager.chunks())
        num_params = num_bytes = 0

        def place(tensors: list[tuple[torch.Tensor, bool]]) -> None:
            nonlocal num_params, num_bytes
            for t, is_param in tensors:
                if not is_param:
                    t.data = t.data.to(buffer_device)
                    continue
                if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                    t.data = t.data.to(dtype)
                num_params += 1
                num_bytes += t.numel() * t.element_size()
                if register_fn is not None:
                    register_fn(t)
                    continue
                chunk_manager.register_tensor(
                    t, group_type, config_key, process_group, cpu_offload, pin_memory
                )

        check_ranks = functools.partial(_check_same_rng, api, process_group)
        _materialize(model, api, init_fn, place, check_ranks)
        chunk_manager.close_all_groups()
        _trim_host_heap()
        logger.info(
            "%s: %d parameters, %.1f MB, %d chunks created",
            api,
            num_params,
            num_bytes / 2**20,
            len(chunk_manager.chunks()) - chunks_before,
        )
        return model


def _trim_host_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim):
    the per-module temporaries of a materialization are freed, but small
    ones stay in the heap's arenas as resident memory until trimmed."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        pass


def _check_distribute_args(
    api: str, model: object, chunk_manager: object, config_key: object, dtype: object,
    register_fn: object,
) -> None:  # fmt: skip
    """distribute's arguments, checked before any module is materialized."""
    _check_model(api, model)
    if not isinstance(chunk_manager, ChunkManager):
        raise TypeError(
            f"{api}: chunk_manager must be a ChunkManager (got {type(chunk_manager).__name__})"
        )
    if register_fn is None and config_key not in chunk_manager.config:
        raise KeyError(
            f"{api}: no chunk configuration for config_key {config_key!r} (got keys "
            f"{list(chunk_manager.config)}); pass one of the chunk manager's keys"
        )
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(
            f"{api}: dtype must be a floating-point torch.dtype or None (got {dtype!r})"
        )
    if register_fn is not None and not callable(register_fn):
        raise TypeError(
            f"{api}: register_fn must be callable or None (got {type(register_fn).__name__})"
        )


def _check_same_rng(api: str, process_group: dist.ProcessGroup | None, record: _Record) -> None:
    """Every rank entered LazyInitContext with the same CPU RNG state."""
    _, world = _comm.rank_and_world(process_group)
    if world == 1:
        return
    # A tensor collective, not all_gather_object, which needs numpy.
    mine = torch.tensor(
        list(hashlib.sha1(bytes(record.rng_state.tolist())).digest()), dtype=torch.int64
    )
    device = _comm_device(process_group)
    gathered = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    _comm.all_gather_into(gathered, mine.to(device), process_group, async_op=False)
    digests = [tuple(row) for row in gathered.view(world, -1).tolist()]
    if len(set(digests)) > 1:
        raise RuntimeError(
            f"{api}: ranks entered LazyInitContext with different CPU RNG states "
            f"(got {len(set(digests))} distinct states over {world} ranks); call "
            "torch.manual_seed(<same seed>) on every rank before the `with` block"
        )


def _check_model(api: str, model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{api}: model must be an nn.Module built under LazyInitContext (got "
            f"{type(model).__name__})"
        )


def _own(module: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is_param) for the module's direct parameters and buffers."""
    params = [(n, t, True) for n, t in module._parameters.items() if t is not None]
    return params + [(n, t, False) for n, t in module._buffers.items() if t is not None]


def _empty(like: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    new = torch.empty(shape, dtype=dtype)
    if isinstance(like, nn.Parameter):
        new = nn.Parameter(new, requires_grad=like.requires_grad)
    return new


def _make_real(t: torch.Tensor) -> None:
    """Turn meta ``t`` into an uninitialised CPU tensor, keeping the Python object."""
    new = _empty(t, t.shape, t.dtype)
    new.__dict__.update(t.__dict__)
    torch.utils.swap_tensors(t, new)


def _materialize(
    model: nn.Module,
    api: str,
    init_fn: Callable[[nn.Module], None] | None,
    place: Callable[[list[tuple[torch.Tensor, bool]]], None],
    check: Callable[[_Record], None] | None = None,
) -> None:
    """Initialise ``model``'s meta tensors module by module, handing each
    module's new tensors to ``place`` once their values are final."""
    modules = list(model.modules())
    if any(m in _MATERIALIZED for m in modules):
        raise RuntimeError(
            f"{api}: the model was already materialized (got {type(model).__name__}); "
            "build a new model under LazyInitContext to materialize again"
        )
    record = next((_BUILT[m] for m in modules if m in _BUILT), None)
    if record is None:
        raise ValueError(
            f"{api}: the model was not built under LazyInitContext (got "
            f"{type(model).__name__}); construct it inside `with LazyInitContext():`"
        )
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"{api}: init_fn must be callable (got {type(init_fn).__name__})")
    # Shapes and dtypes now: a tensor placed into a closed chunk has shape (0,).
    spec = {id(t): (t.shape, t.dtype) for m in modules for _, t, _ in _own(m) if t.is_meta}
    if init_fn is None:
        missing = [
            f"{name or '<root>'} ({type(m).__name__})"
            for name, m in model.named_modules()
            if any(t.is_meta for _, t, _ in _own(m)) and not hasattr(m, "reset_parameters")
        ]
        if missing:
            raise NotImplementedError(
                f"{api}: modules with meta tensors have no reset_parameters() (got "
                f"{', '.join(missing[:5])}); pass init_fn=, or give them reset_parameters()"
            )
    if check is not None:
        check(record)
    placed: dict[int, torch.Tensor] = {}

    def place_new(m: nn.Module) -> None:
        new = [(t, is_param) for _, t, is_param in _own(m) if id(t) not in placed]
        placed.update((id(t), t) for t, _ in new)
        place(new)

    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.random.set_rng_state(record.rng_state)
        if init_fn is not None:
            for m in modules:
                for _, t, _ in _own(m):
                    if t.is_meta:
                        _make_real(t)
            init_fn(model)
            for m in modules:
                place_new(m)
        else:
            for m in modules:
                own = _own(m)
                if any(id(t) in spec for _, t, _ in own):
                    scratch = []
                    for name, t, is_param in own:
                        if t.is_meta:
                            _make_real(t)
                        elif id(t) in placed and id(t) in spec:  # tied: the first owner set it
                            slots: dict[str, Any] = m._parameters if is_param else m._buffers
                            slots[name] = _empty(t, *spec[id(t)])
                            scratch.append((slots, name, t))
                    m.reset_parameters()  # type: ignore[operator]
                    for slots, name, t in scratch:
                        slots[name] = t
                place_new(m)
    _MATERIALIZED.update(modules)


def _comm_device(process_group) -> torch.device:
    """Where the group's collectives take tensors (NCCL: the current GPU)."""
    backend = dist.get_backend(process_group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
