"""LazyInitContext: meta construction, materialization bitwise equal to an
eager build (modules without reset_parameters, values computed in __init__,
RNG state changes, tied weights, a transformers GPT-2 in a plain module), and
distribution into chunks at 1 and 2 ranks (gloo) against eagerly registered
references, with its peak memory."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from zerostack.chunk import ChunkManager, LazyInitContext
from zerostack.testing import GPTConfig, TinyGPT, spawn

_PAGE = 4096


class TiedLM(nn.Module):
    """Tied after construction, as GPT-2 does; ``after`` draws once the tie is made."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.LayerNorm(8))
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight
        self.after = nn.Linear(8, 3)


class NoReset(nn.Module):
    """No reset_parameters anywhere in the module itself."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.lin = nn.Linear(4, 4)


class Computed(nn.Module):
    """Values computed in ``__init__``: a scaled draw, ``normal_``, ``fill_``,
    a ``copy_`` from another parameter, an in-place op on a view, an arange
    buffer, a causal mask, a plain tensor attribute and a size read with
    ``.item()`` while building."""

    def __init__(self, dim: int = 8, seq: int = 6) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, dim) * 0.02)
        self.v = nn.Parameter(torch.empty(dim, 2 * dim))
        nn.init.normal_(self.v, std=0.5)
        self.f = nn.Parameter(torch.empty(dim))
        self.f.data.fill_(0.25)
        self.c = nn.Parameter(torch.empty(dim, dim))
        with torch.no_grad():
            self.c.copy_(self.w.t() * 3)
            self.c[0].add_(1.0)
        self.register_buffer("pos", torch.arange(seq).unsqueeze(0))
        mask = torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq)
        self.register_buffer("mask", mask, persistent=False)
        self.n = int(torch.rand(()).mul(5).item()) + 1
        self.extra = nn.Parameter(torch.randn(self.n))
        self.ramp = torch.linspace(0, 1, dim)


class Reseeding(nn.Module):
    """Changes RNG states while it is built: a fork undoes draws, a state is
    saved and restored, the RNG is reseeded, a private generator (on the
    default device) draws before and after the reseeding."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        private = torch.Generator(device=torch.get_default_device()).manual_seed(7)
        self.g = nn.Parameter(torch.randn(5, generator=private))
        state = torch.get_rng_state()
        self.c = nn.Parameter(torch.rand(3))
        torch.set_rng_state(state)
        self.d = nn.Parameter(torch.rand(3))
        torch.manual_seed(123)  # leaves the private generator alone
        self.e = nn.Linear(3, 3)
        self.h = nn.Parameter(torch.randn(5, generator=private))


class TorchInits(nn.Module):
    """torch's initialisers, four of which skip meta tensors, and values read
    back while building (a list of drop rates, a condition)."""

    def __init__(self) -> None:
        super().__init__()
        self.rates = torch.linspace(0, 0.1, 3).tolist()
        self.t = nn.Parameter(nn.init.trunc_normal_(torch.empty(5, 5), std=0.02))
        self.o = nn.Parameter(nn.init.orthogonal_(torch.empty(4, 6)))
        self.s = nn.Parameter(nn.init.sparse_(torch.empty(6, 3), sparsity=0.5))
        self.conv = nn.Conv1d(3, 3, 3)
        nn.init.dirac_(self.conv.weight)
        nn.init.xavier_uniform_(self.conv.weight[:, :1])
        self.k = nn.Parameter(nn.init.kaiming_normal_(torch.empty(3, 4)))
        self.register_buffer("perm", torch.randperm(7))
        self.b = nn.Parameter(torch.bernoulli(torch.full((4,), 0.5)))
        if (self.k > 0).any():
            self.k.data.mul_(2.0)


def _stack() -> nn.Module:
    return nn.Sequential(
        nn.Embedding(10, 16, padding_idx=0), nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 5)
    )


def _gpt() -> nn.Module:
    return TinyGPT(GPTConfig(tie_embeddings=True, add_unused_param=True))


class WrappedGPT2(nn.Module):
    """A transformers GPT2LMHeadModel (its lm_head tied to wte) inside a plain module."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        self.gpt2 = transformers.GPT2LMHeadModel(config)
        self.score = nn.Linear(64, 2)


CASES = {
    "stack": _stack,
    "tied_after_construction": TiedLM,
    "tinygpt": _gpt,
    "no_reset_parameters": lambda: nn.Sequential(NoReset(), nn.GELU(), NoReset()),
    "computed_in_init": Computed,
    "rng_changes_in_init": Reseeding,
    "torch_initialisers": TorchInits,
    "transformers_gpt2": WrappedGPT2,
}


def _need(name: str) -> None:
    if name == "transformers_gpt2":
        pytest.importorskip("transformers")


def _build(name: str, lazy: bool, seed: int = 0, **context) -> nn.Module:
    torch.manual_seed(seed)
    if not lazy:
        return CASES[name]()
    with LazyInitContext(**context):
        return CASES[name]()


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    plain = [
        (f"{n}.{a}", t) for n, m in model.named_modules() for a, t in vars(m).items()
        if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter)
    ]  # fmt: skip
    return list(model.named_parameters()) + list(model.named_buffers()) + plain


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * _PAGE


def _peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def _can_reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def test_construction_allocates_nothing():
    with LazyInitContext():
        small = _gpt()
    assert all(t.is_meta for _, t in _tensors(small))
    assert not nn.Linear(2, 2).weight.is_meta  # the context is gone after the block
    if not sys.platform.startswith("linux"):
        pytest.skip("RSS is read from /proc")
    rss = _rss_bytes()
    # CPU time, not wall-clock: beside three busy loops on 2 cores the build
    # took 8 s of wall-clock and, as on an idle machine, 0.4 s of CPU time.
    start = time.process_time()
    with LazyInitContext():
        xl = TinyGPT(GPTConfig.gpt2_xl())
    elapsed = time.process_time() - start
    grown = _rss_bytes() - rss
    assert sum(p.numel() for p in xl.parameters()) > 1.5e9
    assert all(t.is_meta for _, t in _tensors(xl))
    assert elapsed < 2.0, f"building GPT-2 XL lazily took {elapsed:.2f}s of CPU time"
    assert grown < 64 * 2**20, f"building GPT-2 XL lazily grew RSS by {grown / 2**20:.0f} MB"


@pytest.mark.parametrize("name", list(CASES))
def test_materialize_equals_eager(name):
    _need(name)
    model = _build(name, lazy=True)
    assert all(p.is_meta for p in model.parameters())  # torch.tensor(...) literals are real
    params = list(model.parameters())
    if name == "stack":
        model[0].weight.requires_grad_(False)
    torch.randn(100)  # draws between the block and materialization change nothing
    rng = torch.random.get_rng_state()
    LazyInitContext.materialize(model)
    assert torch.equal(torch.random.get_rng_state(), rng)  # the global RNG is left alone
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    ref = _build(name, lazy=False)
    got, want = _tensors(model), _tensors(ref)
    assert [n for n, _ in got] == [n for n, _ in want]
    for (n, a), (_, b) in zip(got, want, strict=True):
        assert a.device.type == "cpu" and a.dtype == b.dtype, n
        assert torch.equal(a, b), f"{name}: {n} differs from eager construction"
    if name == "stack":
        assert not model[0].weight.requires_grad and model[1].weight.requires_grad
    if name == "torch_initialisers":
        assert model.rates == ref.rates and len(model.rates) == 3  # read with .tolist()
    tied = {
        "tinygpt": lambda m: (m.lm_head, m.tok_emb),
        "tied_after_construction": lambda m: (m.head, m.emb),
        "transformers_gpt2": lambda m: (m.gpt2.lm_head, m.gpt2.transformer.wte),
    }
    if name in tied:
        head, emb = tied[name](model)
        assert head.weight is emb.weight


def test_values_that_are_overwritten_are_not_computed():
    """GPT-2's layers draw their own init, which post_init draws again: the
    first values are never computed, their draws are still consumed (the
    equality above), and materializing runs fewer ops than were recorded."""
    pytest.importorskip("transformers")
    from zerostack.chunk._lazy import _BUILT
    from zerostack.chunk._lazy_replay import Replay

    model = _build("transformers_gpt2", lazy=True)
    rec = _BUILT[model]
    replay = Replay(rec, {rec.sid(p) for p in model.parameters()})
    scratch = sum(m == 2 for m in replay.mode)
    skipped = sum(not m for m, op in zip(replay.mode, rec.ops, strict=True) if op.rng is None)
    assert scratch >= 2 * 4  # each block's Conv1D init draws, redrawn by post_init
    assert skipped >= 2 * 4


def test_draws_whose_rng_state_is_restored_are_skipped():
    """TinyGPT builds its layers inside torch.random.fork_rng, then draws
    every weight: the layers' own draws change neither a value nor a later
    draw, so the replay runs none of them (only the tied embedding's first
    draw, which the LM head's redraw overwrites, runs on scratch)."""
    from zerostack.chunk._lazy import _BUILT
    from zerostack.chunk._lazy_replay import Replay

    model = _build("tinygpt", lazy=True)
    rec = _BUILT[model]
    replay = Replay(rec, {rec.sid(p) for p in model.parameters()})
    draws = [k for k, op in enumerate(rec.ops) if op.random and op.rng is None]
    in_fork = [
        k for k in draws if k < next(i for i, op in enumerate(rec.ops) if op.rng == ("slot", 0))
    ]
    assert len(in_fork) >= 10 and all(replay.mode[k] == 0 for k in in_fork)
    assert sum(replay.mode[k] == 2 for k in draws) == 1


def test_init_fn_runs_after_the_replay():
    """init_fn(model) sees the RNG where eager construction left it: the
    values equal an eager build followed by the same call."""
    model = _build("tinygpt", lazy=True)
    LazyInitContext.materialize(model, init_fn=TinyGPT.reset_parameters)
    ref = _build("tinygpt", lazy=False)
    ref.reset_parameters()
    for (n, a), (_, b) in zip(_tensors(model), _tensors(ref), strict=True):
        assert torch.equal(a, b), n
    assert not torch.equal(model.tok_emb.weight, _build("tinygpt", lazy=False).tok_emb.weight)


def test_default_device_is_where_init_runs():
    ctx = LazyInitContext(default_device="cpu")
    assert ctx.default_device == torch.device("cpu")
    torch.manual_seed(0)
    with ctx:
        model = Computed()
    LazyInitContext.materialize(model)
    ref = _build("computed_in_init", lazy=False)
    for (n, a), (_, b) in zip(_tensors(model), _tensors(ref), strict=True):
        assert a.device == torch.device("cpu") and torch.equal(a, b), n
    assert LazyInitContext(default_device=None).default_device is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["computed_in_init", "rng_changes_in_init", "transformers_gpt2"])
def test_default_device_cuda_equals_an_eager_build_on_the_gpu(name):
    """Drawn by the GPU's generator, as an eager build under torch.device("cuda")."""
    _need(name)
    model = _build(name, lazy=True, default_device=torch.device("cuda"))
    cuda_rng = torch.cuda.get_rng_state()
    LazyInitContext.materialize(model)
    assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)
    torch.manual_seed(0)
    with torch.device("cuda"):
        ref = CASES[name]()
    for (n, a), (_, b) in zip(_tensors(model), _tensors(ref), strict=True):
        assert a.device == b.device and torch.equal(a, b), n


def test_a_generator_of_another_device_type_is_refused_where_an_eager_build_raises():
    """torch's kernels take only a generator of their own device type: an
    eager torch.randn(5, generator=torch.Generator()) under
    torch.device("cuda") raises at that line, and so does the record (not the
    replay at materialize). The op's device comes from its device argument."""
    from zerostack.chunk._lazy_record import Recording

    randn = torch.ops.aten.randn.generator
    flat = [5, torch.Generator(), None, None, torch.device("cuda"), None]
    rec = Recording(None)
    with pytest.raises(
        RuntimeError, match=r"aten.randn.generator draws on cuda from a generator on cpu"
    ):
        rec._generator(randn, flat, {}, None)
    with pytest.raises(
        RuntimeError, match=r"draws on cuda from a generator on cpu \(got generator="
    ):
        rec._generator(randn, flat, {}, torch.device("cuda"))
    assert rec._generator(randn, flat[:4] + [torch.device("cpu"), None], {}, None) is flat[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cpu_generator_on_the_gpu_raises_as_in_an_eager_build():
    with torch.device("cuda"), pytest.raises(RuntimeError, match=r"Expected a 'cuda' device type"):
        torch.randn(5, generator=torch.Generator())
    with (
        pytest.raises(RuntimeError, match=r"LazyInitContext: aten.randn.generator draws on cuda"),
        LazyInitContext(default_device=torch.device("cuda")),
    ):
        torch.randn(5, generator=torch.Generator())


def test_errors():
    eager = _build("stack", lazy=False)
    with pytest.raises(ValueError, match=r"materialize: the model was not built under LazyInit"):
        LazyInitContext.materialize(eager)
    manager = ChunkManager({"k": {"chunk_size": 64}}, compute_device="cpu")
    with pytest.raises(ValueError, match=r"distribute: the model was not built under LazyInit"):
        LazyInitContext.distribute(eager, manager, config_key="k")

    model = _build("stack", lazy=True)
    LazyInitContext.materialize(model)
    with pytest.raises(RuntimeError, match=r"materialize: the model was already materialized"):
        LazyInitContext.materialize(model)
    with pytest.raises(RuntimeError, match=r"distribute: the model was already materialized"):
        LazyInitContext.distribute(model, manager, config_key="k")

    outside = torch.zeros(3, device="meta")
    with LazyInitContext():
        uses = nn.Linear(3, 3)
        uses.weight.data[0].copy_(outside)  # a meta tensor with no values to replay
        moved = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"a value depends on a meta tensor made outside the"):
        LazyInitContext.materialize(uses)
    assert all(p.is_meta for p in uses.parameters())  # refused before touching anything
    moved.weight.data = torch.empty(2, 2, device="meta")  # after the block: not recorded
    with pytest.raises(ValueError, match=r"materialize: weight is on the meta device but was not"):
        LazyInitContext.materialize(moved)
    assert manager.chunks() == []


def _register_eager(model, dtype, chunk_size, cpu_offload=False):
    manager = ChunkManager({"k": {"chunk_size": chunk_size}}, compute_device="cpu")
    for p in model.parameters():
        if dtype is not None:
            p.data = p.data.to(dtype)
        manager.register_tensor(p, "fp16_param", "k", cpu_offload=cpu_offload)
    manager.close_all_groups()
    return manager


def _check_distribute(rank, world, name, dtype, chunk_size):
    model = _build(name, lazy=True)
    manager = ChunkManager({"k": {"chunk_size": chunk_size}}, compute_device="cpu")
    LazyInitContext.distribute(model, manager, config_key="k", dtype=dtype)
    ref = _build(name, lazy=False)
    ref_manager = _register_eager(ref, dtype, chunk_size)
    chunks, ref_chunks = manager.chunks(), ref_manager.chunks()
    assert len(chunks) == len(ref_chunks) > 1, name  # several chunks: some closed mid-walk
    for c, r in zip(chunks, ref_chunks, strict=True):
        assert c.closed and not c.is_gathered and c.dtype == (dtype or torch.float32)
        assert torch.equal(c.shard, r.shard), f"{name}: rank {rank} shard of chunk {c.index}"
        c.access()
        r.access()
    for (n, a), (_, b) in zip(_tensors(model), _tensors(ref), strict=True):
        assert torch.equal(a, b), f"{name}: {n} after access"


def _check_rng_mismatch(rank, world):
    model = _build("stack", lazy=True, seed=rank)
    manager = ChunkManager({"k": {"chunk_size": 64}}, compute_device="cpu")
    with pytest.raises(RuntimeError, match=r"ranks entered LazyInitContext with different CPU RNG"):
        LazyInitContext.distribute(model, manager, config_key="k")
    assert manager.chunks() == [] and all(p.is_meta for p in model.parameters())


class _Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, dim) * 0.02)  # two temporaries in eager


class _RedrawnAtTheEnd(nn.Module):
    """Layers that compute their values in __init__; then the model draws
    every weight again, as transformers' post_init does."""

    def __init__(self, num_layers: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(dim) for _ in range(num_layers))
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0.0, 0.02)


_PEAK_MODELS = {
    "linear_layers": lambda: nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range(32))),
    "redrawn_at_the_end": lambda: _RedrawnAtTheEnd(32, 1024),
}


def _check_peak_memory(rank, world, name):
    """Peak RSS while distributing 128 MB of layers stays near this rank's
    share: one layer's temporaries at a time, never the model."""
    torch.manual_seed(0)
    with LazyInitContext():
        model = _PEAK_MODELS[name]()
    model_bytes = 32 * 1024 * 1024 * 4
    manager = ChunkManager({"k": {"chunk_size": 2 * 2**20}}, compute_device="cpu")
    rss = _rss_bytes()
    Path("/proc/self/clear_refs").write_text("5")
    LazyInitContext.distribute(model, manager, config_key="k")
    grown = _peak_rss_bytes() - rss
    budget = model_bytes / world + 24 * 2**20  # this rank's shards + open chunk + one layer
    assert grown < budget, (
        f"{name}: rank {rank}: peak grew {grown / 2**20:.0f} MB > {budget / 2**20:.0f}"
    )


def _run_all(rank, world, check_memory, with_transformers):
    _check_distribute(rank, world, "stack", None, 200)
    _check_distribute(rank, world, "tied_after_construction", torch.bfloat16, 40)
    _check_distribute(rank, world, "tinygpt", torch.float16, 20000)
    _check_distribute(rank, world, "no_reset_parameters", None, 24)
    _check_distribute(rank, world, "computed_in_init", torch.bfloat16, 130)
    _check_distribute(rank, world, "rng_changes_in_init", None, 30)
    _check_distribute(rank, world, "torch_initialisers", None, 40)
    if with_transformers:
        _check_distribute(rank, world, "transformers_gpt2", torch.float16, 20000)
    if world > 1:
        _check_rng_mismatch(rank, world)
    if check_memory:
        for name in _PEAK_MODELS:
            _check_peak_memory(rank, world, name)


@pytest.mark.parametrize("world", [1, 2])
def test_distribute_equals_eager_registration(world, monkeypatch):
    # glibc keeps freed blocks above its adaptive mmap threshold resident, so RSS
    # would count freed temporaries; a fixed threshold unmaps them on free.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    with_transformers = importlib.util.find_spec("transformers") is not None
    spawn(
        _run_all, world, args=(_can_reset_peak(), with_transformers), backend="gloo",
        timeout_s=120,
    )  # fmt: skip
