"""LazyInitContext: build a model without allocating it, then materialize it
module by module, straight into chunks, so that it never exists whole
anywhere; ColoInitContext, ColossalAI's eager counterpart."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import threading
import weakref
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as _module_hooks

from zerostack.chunk import _comm
from zerostack.chunk._chunk import check_device, default_compute_device
from zerostack.chunk._lazy_record import Disguise, Recorder, Recording, Ref, recording_rng, ref_of
from zerostack.chunk._lazy_replay import Replay
from zerostack.chunk._manager import ChunkManager

logger = logging.getLogger(__name__)

# Weak, so that a dropped model leaves nothing behind.
_BUILT: weakref.WeakKeyDictionary[nn.Module, Recording] = weakref.WeakKeyDictionary()
_MATERIALIZED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_ENTERED = threading.local()  # .depth: LazyInitContext blocks open in this thread


class LazyInitContext:
    """Build models without allocating them; materialize them later with the
    values an eager build would have given them, as ColossalAI's
    ``LazyInitContext``.

    ``with LazyInitContext(): model = MyModel(...)`` allocates no parameter or
    buffer: every tensor made in the block lives on the meta device, and
    every operation that makes or changes one (``torch.randn(4, 4) * 0.02``,
    ``nn.init.normal_``, ``.fill_``, ``.copy_``, a ``torch.arange`` or
    ``torch.tril`` buffer, a transformers model's own ``post_init``) is
    recorded in order, together with every change of an RNG state
    (``torch.manual_seed``, ``torch.random.fork_rng``). Nothing is asked of
    the model: no ``reset_parameters``, no initialiser.

    ``materialize`` (or ``distribute``, which GeminiDDP and the Booster's
    plugins call) replays the record. The values equal, bitwise, those of
    the same model built eagerly on ``default_device`` after the same
    ``torch.manual_seed`` (replay draws random numbers in the recorded
    order, from the generators' states at the ``with``), tied parameters stay
    tied and parameter objects keep their identity. Only what the model's
    tensors need is computed (a layer's own init that the model's init
    redraws is skipped, its random draws still consumed), and each tensor is
    handed over once final, so that materializing holds about one module's
    tensors at a time. Materializing leaves the global RNG alone; so does the
    block, unless the model's code sets a state (that still takes effect).

    During construction the model's code sees its tensors on the device they
    will have (torch's ``trunc_normal_`` and ``orthogonal_`` skip meta
    tensors), and a value Python reads (``.item()``, ``.tolist()``) is
    computed then, by replaying the record so far; after the block they are
    on meta. Limits: an op that writes a lazily built tensor and has no meta
    kernel raises ``NotImplementedError``; ``torch.tensor(...)`` literals are
    made for real (they are small). See [Note: lazy init record].

    Args:
        default_device: the device the initialisation runs on (tensors
            made without a device go there, as under ``torch.device(...)``;
            "cuda" draws on the GPU: faster, and allocates GPU memory while
            materializing). Default None: the CPU.

    Raises:
        TypeError: ``default_device`` is not a device, str, int or None.
        ValueError: ``default_device`` is not a device name, is meta, or is
            CUDA where CUDA is not available.
    """

    def __init__(self, default_device: torch.device | str | int | None = None) -> None:
        self.default_device = _check_default_device(default_device)
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> LazyInitContext:
        if self._stack is not None:
            raise RuntimeError(
                "LazyInitContext: this context is already entered (got a nested `with` on it); "
                "use a new LazyInitContext() for each `with`"
            )
        if getattr(_ENTERED, "depth", 0):
            raise RuntimeError(
                "LazyInitContext: another LazyInitContext is already entered in this thread "
                "(got nested blocks); build each model in its own block, one after the other"
            )
        rec = Recording(self.default_device)

        def remember(module: nn.Module, name: str, value: object) -> None:
            _BUILT[module] = rec

        stack = contextlib.ExitStack()
        try:
            for register in (
                _module_hooks.register_module_parameter_registration_hook,
                _module_hooks.register_module_buffer_registration_hook,
                _module_hooks.register_module_module_registration_hook,
            ):
                stack.callback(register(remember).remove)
            if self.default_device is not None:
                rec.track_device(self.default_device)
                stack.enter_context(torch.device(self.default_device))
            stack.enter_context(recording_rng(rec))
            stack.enter_context(Disguise(rec))
            stack.enter_context(Recorder(rec))
        except BaseException:
            stack.close()
            raise
        rec.active = True
        stack.callback(setattr, rec, "active", False)
        _ENTERED.depth = 1
        stack.callback(setattr, _ENTERED, "depth", 0)
        self._stack = stack
        return self

    def __exit__(self, *exc: Any) -> None:
        stack, self._stack = self._stack, None
        stack.__exit__(*exc)

    @staticmethod
    def materialize(
        model: nn.Module,
        device: torch.device | str | None = None,
        init_fn: Callable[[nn.Module], None] | None = None,
    ) -> nn.Module:
        """Give a lazily built model its real tensors, as ColossalAI's
        ``LazyInitContext.materialize``.

        Args:
            model: a model built under ``LazyInitContext``.
            device: where the tensors go once computed. Default None: where
                they were computed (the context's ``default_device``).
            init_fn: called once as ``init_fn(model)`` after the replay, the
                RNG where eager construction left it (so the values equal an
                eager build followed by ``init_fn(model)``). It needs the
                whole model at once. Default None.

        Returns:
            ``model``, whole, with the same parameter objects.

        Raises:
            ValueError: the model was not built under LazyInitContext, or
                depends on a meta tensor made outside its block.
            RuntimeError: the model was already materialized or distributed.
        """
        api = "LazyInitContext.materialize"
        _check_model(api, model)
        if device is not None:
            device = check_device(api, "device", device, optional=True)

        def place(tensors: list[tuple[torch.Tensor, bool]]) -> None:
            for t, _ in tensors:
                if device is not None and t.device != device:
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

        The record is replayed on the context's ``default_device``; each
        parameter, once final, is cast to ``dtype``, registered with
        ``chunk_manager`` (which copies it into its chunk) and its temporary
        dropped, in ``model.parameters()`` order, tied parameters once; then
        every chunk is closed (sharded). Peak extra memory is about one
        module's tensors plus the open chunk (more where the model's
        initialisation finishes its tensors far out of that order). Buffers
        go whole to the chunk manager's compute device. Every rank must have
        entered the context with the same RNG state (checked).

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
            ValueError: as in ``materialize``.
            RuntimeError: already materialized, or ranks' RNG states differ.
        """
        api = "LazyInitContext.distribute"
        # Checked before any module is materialized: a bad argument leaves
        # the model on meta, ready for a corrected call.
        _check_distribute_args(api, model, chunk_manager, config_key, dtype, register_fn)
        chunks_before = len(chunk_manager.chunks())
        register: Callable[[torch.Tensor], object] = register_fn or functools.partial(
            chunk_manager.register_tensor,
            group_type=group_type,
            config_key=config_key,
            process_group=process_group,
            cpu_offload=cpu_offload,
            pin_memory=pin_memory,
        )
        place = _IntoChunks(
            register, chunk_manager.compute_device or default_compute_device(), dtype
        )
        check_ranks = functools.partial(_check_same_rng, api, process_group)
        _materialize(model, api, init_fn, place, check_ranks)
        chunk_manager.close_all_groups()
        _trim_host_heap()
        logger.info(
            "%s: %d parameters, %.1f MB, %d chunks created",
            api,
            place.num_params,
            place.num_bytes / 2**20,
            len(chunk_manager.chunks()) - chunks_before,
        )
        return model


class _IntoChunks:
    """distribute's placement of each materialized tensor: a buffer goes
    whole to the compute device, a parameter is cast to ``dtype`` and
    registered into its chunk; counts the parameters and their bytes."""

    def __init__(
        self,
        register: Callable[[torch.Tensor], object],
        buffer_device: torch.device,
        dtype: torch.dtype | None,
    ) -> None:
        self.register = register
        self.buffer_device = buffer_device
        self.dtype = dtype
        self.num_params = 0
        self.num_bytes = 0

    def __call__(self, tensors: list[tuple[torch.Tensor, bool]]) -> None:
        for t, is_param in tensors:
            if not is_param:
                t.data = t.data.to(self.buffer_device)
                continue
            if self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype:
                t.data = t.data.to(self.dtype)
            self.num_params += 1
            self.num_bytes += t.numel() * t.element_size()
            self.register(t)


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


def _check_same_rng(api: str, process_group: dist.ProcessGroup | None, record: Recording) -> None:
    """Every rank entered LazyInitContext with the same CPU RNG state."""
    _, world = _comm.rank_and_world(process_group)
    if world == 1:
        return
    # A tensor collective, not all_gather_object, which needs numpy.
    mine = torch.tensor(
        list(hashlib.sha1(bytes(record.cpu_state.tolist())).digest()), dtype=torch.int64
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


def _check_default_device(value: object) -> torch.device | None:
    api = "LazyInitContext"
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = torch.device(value)  # an accelerator index, as torch.device(0)
    if not isinstance(value, torch.device | str):
        raise TypeError(
            f"{api}: default_device must be a torch.device, str, int or None (got {value!r})"
        )
    try:
        meta = torch.device(value).type == "meta"
    except RuntimeError:
        meta = False  # not a device name: check_device says so
    if meta:
        raise ValueError(
            f"{api}: default_device cannot be meta (got {value!r}); it is the device the "
            "initialisation runs on when the model is materialized: pass 'cpu' or 'cuda'"
        )
    return check_device(api, "default_device", value, optional=True)


def _check_model(api: str, model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{api}: model must be an nn.Module built under LazyInitContext (got "
            f"{type(model).__name__})"
        )


def _own(module: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is_param) for the module's direct parameters and buffers,
    and its plain tensor attributes that are lazily built."""
    params = [(n, t, True) for n, t in module._parameters.items() if t is not None]
    buffers = [(n, t, False) for n, t in module._buffers.items() if t is not None]
    plain = [
        (n, t, False) for n, t in vars(module).items() if isinstance(t, torch.Tensor) and t.is_meta
    ]
    return params + buffers + plain


def _make_real(t: torch.Tensor, value: torch.Tensor) -> None:
    """Turn meta ``t`` into a tensor holding ``value``, keeping the Python object."""
    new = value.detach()
    if isinstance(t, nn.Parameter):
        new = nn.Parameter(new, requires_grad=t.requires_grad)
    elif t.requires_grad:
        new.requires_grad_(True)
    new.__dict__.update(t.__dict__)
    torch.utils.swap_tensors(t, new)


def _materialize(
    model: nn.Module,
    api: str,
    init_fn: Callable[[nn.Module], None] | None,
    place: Callable[[list[tuple[torch.Tensor, bool]]], None],
    check: Callable[[Recording], None] | None = None,
) -> None:
    """Replay ``model``'s record, handing each parameter and buffer to
    ``place`` once its value is final, in module order (tied ones once)."""
    modules = list(model.modules())
    if any(m in _MATERIALIZED for m in modules):
        raise RuntimeError(
            f"{api}: the model was already materialized (got {type(model).__name__}); "
            "build a new model under LazyInitContext to materialize again"
        )
    rec = next((_BUILT[m] for m in modules if m in _BUILT), None)
    if rec is None:
        raise ValueError(
            f"{api}: the model was not built under LazyInitContext (got "
            f"{type(model).__name__}); construct it inside `with LazyInitContext():`"
        )
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"{api}: init_fn must be callable (got {type(init_fn).__name__})")
    order: list[tuple[torch.Tensor, bool]] = []
    refs: dict[int, Ref] = {}
    seen: set[int] = set()  # ids: every tensor stays alive meanwhile
    for prefix, m in model.named_modules():
        for name, t, is_param in _own(m):
            if id(t) in seen:
                continue
            seen.add(id(t))
            if t.is_meta:
                sid = rec.sid(t)
                if sid is None:
                    raise ValueError(
                        f"{api}: {prefix + '.' if prefix else ''}{name} is on the meta device but "
                        f"was not made in the model's LazyInitContext block (got shape "
                        f"{list(t.shape)}); make it inside the block (a model moved with .to() "
                        "after the block: move it after materializing)"
                    )
                refs[id(t)] = ref_of(sid, t)
            order.append((t, is_param))
    if check is not None:
        check(rec)
    replay = Replay(rec, {r.sid for r in refs.values()}, all_random=init_fn is not None)
    with torch.no_grad():
        if init_fn is not None:
            replay.run()
            for t, _ in order:
                if id(t) in refs:
                    _make_real(t, replay.view(refs[id(t)]))
            replay.live.clear()
            with replay.generators_at_end():
                init_fn(model)
            place(order)
        else:
            _place_in_order(replay, order, refs, place)
    _MATERIALIZED.update(modules)


def _place_in_order(
    replay: Replay,
    order: list[tuple[torch.Tensor, bool]],
    refs: dict[int, Ref],
    place: Callable[[list[tuple[torch.Tensor, bool]]], None],
) -> None:
    """Replay, placing tensors in ``order`` as their values become final (a
    final value waits for the tensors before it)."""
    pending = deque(order)
    ready: set[int] = set()
    users = Counter(r.sid for r in refs.values())

    def flush() -> None:
        while pending:
            t, is_param = pending[0]
            ref = refs.get(id(t))
            if ref is not None:
                if ref.sid not in ready:
                    return
                _make_real(t, replay.view(ref))
                users[ref.sid] -= 1
                if not users[ref.sid]:
                    replay.drop(ref.sid)
            pending.popleft()
            place([(t, is_param)])

    def on_final(sid: int) -> None:
        ready.add(sid)
        flush()

    flush()
    replay.run(on_final)
    flush()
    if pending:
        raise AssertionError(f"LazyInitContext: {len(pending)} tensors were never final")


def _comm_device(process_group) -> torch.device:
    """Where the group's collectives take tensors (NCCL: the current GPU)."""
    backend = dist.get_backend(process_group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
