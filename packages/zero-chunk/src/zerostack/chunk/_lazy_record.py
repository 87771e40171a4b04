"""What LazyInitContext records while a model is built: every tensor operation
that creates or changes a lazily built tensor, and every change of an RNG
state, in the order they ran.

[Note: lazy init record] Inside the ``with`` block a dispatch mode sees every
aten operation. A factory (``torch.empty``, ``randn``, ``arange``, ...), an
operation on a lazily built tensor, and a random operation run on the meta
device instead (they allocate nothing) and are appended to the record with
their arguments; the meta results stand for the real tensors. Tensors are
named by their (meta) storage, so views, ``.data``, ``.detach()`` and
``nn.Parameter(t)`` all name the tensor they alias, and an in-place op on a
view writes its base. Meta kernels draw no random numbers, so the RNG state
changes (``torch.manual_seed``, ``get_rng_state``/``set_rng_state``, hence
``torch.random.fork_rng``) are recorded too. Replaying the record in order
(``_lazy_replay``) therefore consumes the RNG exactly as building the model
eagerly would, and gives every tensor its eager value, bitwise.

Operations on real tensors alone run as usual. A value Python needs at once
(``.item()``, ``.tolist()``, an op without a meta kernel) is computed by
replaying the record so far.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

# In-place ops whose result does not depend on the values they overwrite.
_OVERWRITE = frozenset(
    {"normal_", "uniform_", "fill_", "zero_", "copy_", "random_", "bernoulli_",
     "exponential_", "geometric_", "log_normal_", "cauchy_"}
)  # fmt: skip
_READ_WRITE, _WHOLE_WRITE = 1, 2  # how an op writes an argument


@dataclass(frozen=True, slots=True)
class Ref:
    """A lazily built tensor: its storage and its view of it."""

    sid: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def ref_of(sid: int, t: torch.Tensor) -> Ref:
    return Ref(sid, t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())  # type: ignore[arg-type]


@dataclass(slots=True)
class Storage:
    device: torch.device | None  # where replay allocates it; None: made outside the context
    nbytes: int
    base: Ref  # the tensor that created it
    meta: torch.UntypedStorage  # held, so that no new storage reuses its address


@dataclass(slots=True, eq=False)
class Op:
    """One recorded operation. ``flat`` holds its arguments (pytree leaves of
    ``(args, kwargs)``) with a Ref for each lazily built tensor."""

    func: Callable[..., Any] | None
    flat: list[Any]
    spec: Any
    creates: tuple[tuple[int, int], ...] = ()  # (output leaf, sid) of new storages
    writes: tuple[tuple[int, bool], ...] = ()  # (sid, every byte overwritten)
    reads: frozenset[int] = frozenset()  # sids whose values the op needs
    whole: frozenset[int] = frozenset()  # leaves the op overwrites entirely
    scratch: frozenset[int] = frozenset()  # leaves: real tensors it writes, replayed on a copy
    random: bool = False  # draws random numbers (or, with ``rng``, sets a state)
    gen: torch.Generator | None = None  # the generator it draws from or sets
    rng: tuple[str, Any] | None = None  # a state change: ("get"|"slot"|"state", slot or state)


@dataclass(frozen=True, slots=True)
class _Schema:
    arg_writes: tuple[int, ...]  # per positional argument: 0, _READ_WRITE or _WHOLE_WRITE
    kwarg_writes: dict[str, int]
    random: bool
    has_device: bool


_SCHEMAS: dict[Any, _Schema] = {}


def _schema(func: Any) -> _Schema:
    found = _SCHEMAS.get(func)
    if found is None:
        overwrite = func.overloadpacket.__name__ in _OVERWRITE
        writes = []
        for arg in func._schema.arguments:
            if arg.alias_info is None or not arg.alias_info.is_write:
                writes.append(0)
            elif arg.kwarg_only or (overwrite and arg.name == "self"):  # out= or self
                writes.append(_WHOLE_WRITE)
            else:
                writes.append(_READ_WRITE)
        names = [a.name for a in func._schema.arguments]
        found = _Schema(
            tuple(writes),
            dict(zip(names, writes, strict=True)),
            torch.Tag.nondeterministic_seeded in func.tags,
            "device" in names,
        )
        _SCHEMAS[func] = found
    return found


def _write_kinds(func: Any, args: tuple, kwargs: dict, num_leaves: int) -> list[int]:
    """Per pytree leaf of ``(args, kwargs)``: how ``func`` writes it."""
    schema = _schema(func)
    if not any(schema.arg_writes):
        return [0] * num_leaves
    kinds: list[int] = []
    for i, a in enumerate(args):
        kind = schema.arg_writes[i] if i < len(schema.arg_writes) else 0
        kinds += [kind] * len(tree_flatten(a)[0])
    for name, a in kwargs.items():
        kinds += [schema.kwarg_writes.get(name, 0)] * len(tree_flatten(a)[0])
    return kinds


def _dense(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Each element of the extent is addressed exactly once."""
    expected = 1
    for st, sz in sorted((st, sz) for sz, st in zip(size, stride, strict=True) if sz != 1):
        if st != expected:
            return False
        expected *= sz
    return True


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


class Recording:
    """The record of one ``with LazyInitContext()`` block."""

    def __init__(self, default_device: torch.device | None) -> None:
        self.default_device = default_device
        self.ops: list[Op] = []
        self.storages: list[Storage] = []
        self._by_address: dict[int, int] = {}
        # Generators used in the block, with their state when first seen:
        # replay starts each from there.
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        self._slots: dict[int, int] = {}  # id(state tensor from get_rng_state) -> slot
        self._slot_tensors: list[torch.Tensor] = []  # held, so that ids stay unique
        self.thread = threading.get_ident()
        self.active = False
        self.paused = 0  # >0 while a replay runs inside the block: its ops are real
        self.track(torch.default_generator)
        self.cpu_state = self.generators[id(torch.default_generator)][1]

    # -- storages -------------------------------------------------------------

    def sid(self, t: torch.Tensor) -> int | None:
        """The storage id of a lazily built (meta) tensor, None for another tensor."""
        if not t.is_meta:
            return None
        return self._by_address.get(t.untyped_storage()._cdata)

    def _register(self, t: torch.Tensor, device: torch.device | None) -> int:
        storage = t.untyped_storage()
        sid = len(self.storages)
        self.storages.append(Storage(device, storage.nbytes(), ref_of(sid, t), storage))
        self._by_address[storage._cdata] = sid
        return sid

    def _device(self, device: Any) -> torch.device:
        """Where a factory's tensor goes on replay: as asked, meta meaning
        the default device."""
        if device is None:
            return torch.device("cpu")  # a torch.device context fills it in before dispatch
        device = torch.device(device)
        if device.type == "meta":
            return self.default_device or torch.device("cpu")
        return device

    # -- RNG --------------------------------------------------------------------

    def track(self, gen: torch.Generator) -> None:
        if id(gen) not in self.generators:
            self.generators[id(gen)] = (gen, gen.get_state())

    def track_device(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.init()
            self.track(torch.cuda.default_generators[_cuda_index(device)])

    def rng_get(self, gen: torch.Generator, state: torch.Tensor) -> None:
        self._slots[id(state)] = slot = len(self._slot_tensors)
        self._slot_tensors.append(state)
        self.ops.append(Op(None, [], None, random=True, gen=gen, rng=("get", slot)))

    def rng_set(self, gen: torch.Generator, state: torch.Tensor) -> None:
        slot = self._slots.get(id(state))
        if slot is not None and self._slot_tensors[slot] is state:
            self.ops.append(Op(None, [], None, random=True, gen=gen, rng=("slot", slot)))
        else:
            self.rng_reseeded([gen])

    def rng_reseeded(self, gens: list[torch.Generator]) -> None:
        for gen in gens:
            state = gen.get_state()
            self.ops.append(Op(None, [], None, random=True, gen=gen, rng=("state", state)))

    def cuda_generators(self, current: bool = False) -> list[torch.Generator]:
        """The tracked default CUDA generators, those torch's seed functions
        reseed (a ``torch.Generator(device="cuda")`` of the model's own keeps
        its state); with ``current``, the current device's alone, as
        ``torch.cuda.manual_seed`` reseeds."""
        gens = torch.cuda.default_generators
        if current and gens:
            gens = (gens[torch.cuda.current_device()],)
        return [g for g in gens if id(g) in self.generators]

    def here(self) -> bool:
        return self.active and not self.paused and threading.get_ident() == self.thread

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    # -- dispatch -------------------------------------------------------------

    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.paused:
            return func(*args, **kwargs)
        with self.pause():  # our own tensor queries see the truth
            return self._dispatch(func, args, kwargs)

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        schema = _schema(func)
        flat, spec = tree_flatten((args, kwargs))
        lazy: dict[int, int] = {}
        real: list[int] = []
        for i, x in enumerate(flat):
            if isinstance(x, torch.Tensor):
                if x.is_meta:
                    sid = self.sid(x)
                    lazy[i] = self._register(x, None) if sid is None else sid
                else:
                    real.append(i)
        factory = not lazy and not real and schema.has_device
        device = kwargs.get("device")
        to_meta = device is not None and torch.device(device).type == "meta"
        if not (lazy or factory or to_meta or schema.random):
            return func(*args, **kwargs)
        if factory or to_meta:
            kwargs = {**kwargs, "device": self._device(device)}
            flat, spec = tree_flatten((args, kwargs))
        kinds = _write_kinds(func, args, kwargs, len(flat))
        if len(kinds) != len(flat):
            raise AssertionError(
                f"LazyInitContext: {func} has {len(flat)} leaves, {len(kinds)} kinds"
            )
        real_written = [i for i in real if kinds[i]]
        if real_written:
            return self._run_now(func, flat, spec, lazy, real_written, schema.random)
        meta_flat = list(flat)
        for i in real:
            meta_flat[i] = _meta_like(flat[i])
        meta_args, meta_kwargs = tree_unflatten(meta_flat, spec)
        if schema.has_device:
            meta_kwargs = {**meta_kwargs, "device": torch.device("meta")}
            if meta_kwargs.get("pin_memory"):
                meta_kwargs["pin_memory"] = False
        try:
            out = func(*meta_args, **meta_kwargs)
        except (RuntimeError, NotImplementedError) as err:
            if any(kinds[i] for i in lazy):
                raise NotImplementedError(
                    f"LazyInitContext: {func} has no meta kernel, and it writes a lazily built "
                    f"tensor (got {type(err).__name__}: {str(err).splitlines()[0]}); build "
                    "this module outside LazyInitContext"
                ) from err
            return self._run_now(func, flat, spec, lazy, [], schema.random)

        out_flat = tree_flatten(out)[0]
        if factory or (schema.has_device and kwargs.get("device") is not None):
            out_device = self._device(kwargs.get("device"))
        elif lazy:
            out_device = self.storages[next(iter(lazy.values()))].device
        else:
            out_device = flat[real[0]].device
        creates = tuple(
            (j, self._register(y, out_device))
            for j, y in enumerate(out_flat)
            if isinstance(y, torch.Tensor) and y.is_meta and self.sid(y) is None
        )
        whole = frozenset(
            i for i in lazy if kinds[i] == _WHOLE_WRITE and self._covers(flat[i], lazy[i])
        )
        writes = tuple((lazy[i], i in whole) for i in lazy if kinds[i])
        if not creates and not writes and not schema.random:
            return out  # a view or a query: nothing to replay
        self._append(func, flat, spec, lazy, whole, creates, writes, (), schema.random, out_device)
        return out

    def _covers(self, t: torch.Tensor, sid: int) -> bool:
        storage = self.storages[sid]
        return (
            t.storage_offset() == 0
            and t.numel() * t.element_size() == storage.nbytes
            and _dense(tuple(t.shape), tuple(t.stride()))
        )

    def _append(
        self, func: Any, flat: list, spec: Any, lazy: dict[int, int], whole: frozenset[int],
        creates: tuple, writes: tuple, scratch: tuple[int, ...], random: bool,
        device: torch.device | None,
    ) -> None:  # fmt: skip
        rec_flat = list(flat)
        for i, sid in lazy.items():
            rec_flat[i] = ref_of(sid, flat[i])
        reads = {sid for i, sid in lazy.items() if i not in whole}
        gen = self._generator(func, flat, lazy, device) if random else None
        self.ops.append(
            Op(func, rec_flat, spec, creates, writes, frozenset(reads), whole,
               frozenset(scratch), random, gen)
        )  # fmt: skip

    def _generator(
        self, func: Any, flat: list, lazy: dict[int, int], device: torch.device | None
    ) -> torch.Generator:
        """The generator a random op draws from (tracked from here on): the
        one passed, else its device's default one. A generator passed for
        another device type is refused here, where an eager build raises
        (torch's kernels take only a generator of their own device type)."""
        if device is None:
            asked = (x for x in flat if isinstance(x, torch.device))
            real = (x.device for x in flat if isinstance(x, torch.Tensor) and not x.is_meta)
            lazy_devices = (self.storages[sid].device for sid in lazy.values())
            device = (
                next(asked, None) or next(real, None) or next(lazy_devices, None)
                or torch.device("cpu")
            )  # fmt: skip
        gen = next((x for x in flat if isinstance(x, torch.Generator)), None)
        if gen is not None and gen.device.type != device.type:
            raise RuntimeError(
                f"LazyInitContext: {func} draws on {device.type} from a generator on "
                f"{gen.device.type} (got generator=torch.Generator(device='{gen.device}')); "
                f"create the generator on the device the tensor is made on, e.g. "
                "torch.Generator(device=torch.get_default_device()), as an eager build "
                f"under torch.device('{device.type}') needs too"
            )
        if gen is None:
            if device.type == "cuda":
                torch.cuda.init()
                gen = torch.cuda.default_generators[_cuda_index(device)]
            else:
                gen = torch.default_generator
        self.track(gen)
        return gen

    def _run_now(
        self, func: Any, flat: list, spec: Any, lazy: dict[int, int], real_written: list[int],
        random: bool,
    ) -> Any:  # fmt: skip
        """Run ``func`` on real values now: the lazily built inputs are
        computed by replaying the record so far (and, for a random op, the
        RNG is where eager construction would have it). A random op is also
        recorded, so that replay consumes the RNG as it did."""
        from zerostack.chunk._lazy_replay import Replay  # the replay imports this module

        if random:
            self._generator(func, flat, lazy, None)  # tracked before the replay swaps states
        replay = Replay(self, set(lazy.values()), all_random=random)
        replay.run()
        real_flat = list(flat)
        for i, sid in lazy.items():
            real_flat[i] = replay.view(ref_of(sid, flat[i]))
        args, kwargs = tree_unflatten(real_flat, spec)
        if "device" in kwargs and kwargs["device"] is not None:
            kwargs = {**kwargs, "device": self._device(kwargs["device"])}
        if not random:
            return func(*args, **kwargs)
        with replay.generators_at_end():
            out = func(*args, **kwargs)
        self._append(func, flat, spec, lazy, frozenset(), (), (), tuple(real_written), True, None)
        return out

    def evaluate(self, t: torch.Tensor) -> torch.Tensor:
        """The value ``t`` (lazily built) has at this point of the block."""
        from zerostack.chunk._lazy_replay import Replay

        sid = self.sid(t)
        replay = Replay(self, {sid})
        replay.run()
        return replay.view(ref_of(sid, t))


class Recorder(TorchDispatchMode):
    """Sends every aten op inside the block to ``Recording.dispatch``."""

    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Else torch wraps __torch_dispatch__ to keep dynamo out, importing
        # torch._dynamo on the first op (seconds); nothing compiles in a model's
        # construction.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.recording.dispatch(func, args, kwargs or {})


_GETTERS = {
    torch.Tensor.is_meta.__get__: lambda d: False,  # type: ignore[attr-defined]
    torch.Tensor.device.__get__: lambda d: d,
    torch.Tensor.is_cuda.__get__: lambda d: d.type == "cuda",  # type: ignore[attr-defined]
    torch.Tensor.is_cpu.__get__: lambda d: d.type == "cpu",  # type: ignore[attr-defined]
}


class Disguise(TorchFunctionMode):
    """The model's code sees a lazily built tensor on the device it will have,
    not on meta, as in an eager build: torch's ``nn.init.trunc_normal_``,
    ``orthogonal_``, ``sparse_`` and ``dirac_`` do nothing to meta tensors,
    and ``torch.zeros(n, device=w.device)`` must not make one."""

    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_function__(self, func, types, args=(), kwargs=None):
        answer = _GETTERS.get(func)
        if answer is not None and self.recording.here():
            sid = self.recording.sid(args[0])  # this mode is off inside its handler
            device = None if sid is None else self.recording.storages[sid].device
            if device is not None:
                return answer(device)
        return func(*args, **(kwargs or {}))


def _cuda_index(device: Any = "cuda") -> int:
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return torch.cuda.current_device() if device.index is None else device.index


def _cuda_generator(device: Any = "cuda") -> torch.Generator:
    torch.cuda.init()
    return torch.cuda.default_generators[_cuda_index(device)]


# The wrappers recording_rng installs: each `(rec, ...)` returns a
# `make(orig)` that wraps torch's original function `orig`.
_Wrap = Callable[[Any], Any]


def _rng_getter(rec: Recording, gen_of: Callable[..., torch.Generator]) -> _Wrap:
    def make(orig: Any) -> Any:
        def get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
            if not rec.here():
                return orig(*args, **kwargs)
            gen = gen_of(*args, **kwargs)
            rec.track(gen)
            state = orig(*args, **kwargs)
            rec.rng_get(gen, state)
            return state

        return get_rng_state

    return make


def _rng_setter(rec: Recording, gen_of: Callable[..., torch.Generator]) -> _Wrap:
    def make(orig: Any) -> Any:
        def set_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            if not rec.here():
                return orig(new_state, *args, **kwargs)
            gen = gen_of(*args, **kwargs)
            rec.track(gen)
            orig(new_state, *args, **kwargs)
            rec.rng_set(gen, new_state)
            return None

        return set_rng_state

    return make


def _rng_seeder(rec: Recording, gens: Callable[[], list[torch.Generator]]) -> _Wrap:
    def make(orig: Any) -> Any:
        def seed(*args: Any, **kwargs: Any) -> Any:
            if not rec.here():
                return orig(*args, **kwargs)
            for gen in gens():
                rec.track(gen)
            out = orig(*args, **kwargs)
            rec.rng_reseeded(gens())
            return out

        return seed

    return make


def _value_reader(rec: Recording) -> _Wrap:
    def make(orig: Any) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if rec.here():
                with rec.pause():
                    lazy = rec.sid(self) is not None
                    if lazy:
                        return orig(rec.evaluate(self), *args, **kwargs)
            return orig(self, *args, **kwargs)

        return read

    return make


def _cpu_generator(*_: Any, **__: Any) -> torch.Generator:
    return torch.default_generator


@contextlib.contextmanager
def recording_rng(rec: Recording) -> Iterator[None]:
    """Within the block, route torch's RNG state functions through ``rec``
    (they still act on the real generators too). ``Tensor.tolist`` on a
    lazily built tensor (and ``numpy``) computes its value."""
    patched: list[tuple[Any, str, Any, bool]] = []

    def patch(module: Any, name: str, make: _Wrap) -> None:
        orig = getattr(module, name, None)
        if orig is not None:
            patched.append((module, name, orig, name in vars(module)))
            setattr(module, name, make(orig))

    def cpu_and_cuda() -> list[torch.Generator]:
        return [torch.default_generator, *rec.cuda_generators()]

    for module in (torch, torch.random):
        patch(module, "get_rng_state", _rng_getter(rec, _cpu_generator))
        patch(module, "set_rng_state", _rng_setter(rec, _cpu_generator))
        patch(module, "manual_seed", _rng_seeder(rec, cpu_and_cuda))
        patch(module, "seed", _rng_seeder(rec, cpu_and_cuda))
    if torch.cuda.is_available():
        for module in (torch.cuda, torch.cuda.random):
            patch(module, "get_rng_state", _rng_getter(rec, _cuda_generator))
            patch(module, "set_rng_state", _rng_setter(rec, _cuda_generator))
            for name in ("manual_seed", "seed"):
                patch(module, name, _rng_seeder(rec, lambda: rec.cuda_generators(current=True)))
            for name in ("manual_seed_all", "seed_all"):
                patch(module, name, _rng_seeder(rec, rec.cuda_generators))
    patch(torch.Tensor, "tolist", _value_reader(rec))
    patch(torch.Tensor, "numpy", _value_reader(rec))
    try:
        yield
    finally:
        for module, name, orig, own in reversed(patched):
            if own:
                setattr(module, name, orig)
            else:  # inherited (Tensor.tolist is TensorBase's): uncover it
                delattr(module, name)
