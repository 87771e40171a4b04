"""The bad-input matrix of zero-chunk (issue 17): Chunk, ChunkManager,
search_chunk_configuration, LazyInitContext, ColoInitContext and the collective
debug switches.

One row per bad call: the error type, a regex that names the argument (or
the misused call) and the value got, and whether this table's work added the
check (``fixed``: before it the call gave an unclear error or was accepted).
Every row also checks that the failed call changed nothing (chunks, their
bytes and tensor states, the manager's accounting, a lazy model still on
meta, the debug switches) and that everything still works afterwards.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from zerostack.chunk import (
    Chunk,
    ChunkManager,
    ColoInitContext,
    LazyInitContext,
    TensorState,
    _comm,
    debug_collectives,
    search_chunk_configuration,
    set_collective_label,
)
from zerostack.testing import BadInput, check_bad_input, check_unique_ids, one_torch_thread

S = TensorState
CFG = {"k": {"chunk_size": 16}, "g": {"chunk_size": 16, "keep_gathered": True}}


def _env() -> dict[str, Any]:
    torch.manual_seed(0)
    manager = ChunkManager(CFG, compute_device="cpu")
    ts = [torch.randn(4), torch.randn(6), torch.randn(3)]
    values = [t.clone() for t in ts]
    for t in ts[:2]:
        manager.register_tensor(t, "fp32_param", "k")
    manager.register_tensor(ts[2], "fp32_param", "g")
    manager.close_all_groups()
    open_chunk = Chunk(16, None, torch.float32, index=7, compute_device="cpu")
    open_chunk.append_tensor(torch.ones(4))
    with LazyInitContext():
        lazy = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    return {
        "m": manager,
        "ts": ts,
        "values": values,
        "chunk": manager.get_chunk(ts[0]),
        "kept": manager.get_chunk(ts[2]),
        "open": open_chunk,
        "lazy": lazy,
        "model": nn.Linear(8, 8),
    }


def _chunk_facts(c: Chunk) -> tuple:
    return (
        c.index, c.utilized_size, c.closed, c.is_gathered, c.shard_device,
        None if c.shard is None else c.shard.clone(),
        None if c.buffer is None else c.buffer.clone(),
        [info.state for info in c.tensors_info.values()],
        {s: n for s, n in c.state_count.items() if n}, c.paired_chunk,
    )  # fmt: skip


def _snapshot(env: dict[str, Any]) -> dict[str, Any]:
    m = env["m"]
    return {
        "chunks": [_chunk_facts(c) for c in [*m.chunks(), env["open"]]],
        "groups": {name: len(g) for name, g in m.chunk_groups.items()},
        "mem": dict(m.total_mem),
        "registered": len(m.tensor_chunk_map),
        "accessed": len(m.accessed_chunks),
        "next_index": m._next_index,
        "lazy_meta": [p.is_meta for p in env["lazy"].parameters()],
        "debug": debug_collectives(),
        "label": _comm._label,
    }


def _still_works(env: dict[str, Any]) -> None:
    m, ts, chunk = env["m"], env["ts"], env["chunk"]
    m.access_chunk(chunk)
    assert torch.equal(ts[0], env["values"][0]) and torch.equal(ts[1], env["values"][1])
    chunk.trans_tensor_state(ts[0], S.COMPUTE)
    chunk.trans_tensor_state(ts[0], S.HOLD)
    m.release_chunk(chunk)
    new = torch.randn(5)
    assert m.register_tensor(new, "fp32_param", "k").tensors_info[new].numel == 5
    env["open"].append_tensor(torch.zeros(2))
    LazyInitContext.materialize(env["lazy"])
    assert not any(p.is_meta for p in env["lazy"].parameters())
    assert search_chunk_configuration(env["model"], 1, 8, min_chunk_size_m=0).total_size == 72


def _gathered(env):
    env["m"].access_chunk(env["chunk"])
    return env["chunk"]


def _materialized_twice(env):
    with LazyInitContext():
        model = nn.Linear(2, 2)
    LazyInitContext.materialize(model)
    LazyInitContext.materialize(model)


def _nested(env):
    ctx = LazyInitContext()
    with ctx, ctx:
        pass


def _other_nested(env):
    with LazyInitContext(), LazyInitContext():
        pass


def _search(*args, **kwargs):
    return lambda env: search_chunk_configuration(*args, **kwargs)


def _on_model(**kwargs):
    return lambda env: search_chunk_configuration(env["model"], **kwargs)


def _distribute(**kwargs):
    def call(env):
        args = {"chunk_manager": env["m"], "config_key": "k", **kwargs}
        LazyInitContext.distribute(env["lazy"], **args)

    return call


CASES = [
    # -- Chunk(...) -------------------------------------------------------------------------
    BadInput("chunk-size-0", lambda env: Chunk(0, None, torch.float32), ValueError, r"Chunk: chunk_size must be an int >= 1 \(got 0\)"),
    BadInput("chunk-size-float", lambda env: Chunk(4.0, None, torch.float32), ValueError, r"chunk_size must be an int >= 1 \(got 4\.0\)"),
    BadInput("chunk-size-bool", lambda env: Chunk(True, None, torch.float32), ValueError, r"chunk_size must be an int >= 1 \(got True\)"),
    BadInput("chunk-dtype-int", lambda env: Chunk(4, None, torch.int64), ValueError, r"Chunk: dtype must be floating point \(got torch\.int64\)"),
    BadInput("chunk-dtype-str", lambda env: Chunk(4, None, "float32"), TypeError, r"Chunk: dtype must be a torch\.dtype \(got 'float32'\)", True),
    BadInput("chunk-device-bogus", lambda env: Chunk(4, None, torch.float32, compute_device="gpu0"), ValueError, r"Chunk: compute_device is not a device \(got 'gpu0'\)", True),
    BadInput("chunk-device-meta", lambda env: Chunk(4, None, torch.float32, compute_device="meta"), ValueError, r"Chunk: compute_device cannot be meta \(got 'meta'\)", True),
    BadInput("chunk-device-int", lambda env: Chunk(4, None, torch.float32, compute_device=3), TypeError, r"Chunk: compute_device must be a torch\.device or str \(got 3\)", True),
    BadInput("chunk-shard-device-bogus", lambda env: Chunk(4, None, torch.float32, compute_device="cpu", shard_device="disk"), ValueError, r"Chunk: shard_device is not a device \(got 'disk'\)", True),
    # -- Chunk methods ---------------------------------------------------------------------------
    BadInput("append-not-tensor", lambda env: env["open"].append_tensor([1.0, 2.0]), TypeError, r"Chunk 7\.append_tensor: expected a tensor \(got list\)", True),
    BadInput("append-wrong-dtype", lambda env: env["open"].append_tensor(torch.zeros(2, dtype=torch.float16)), TypeError, r"Chunk 7\.append_tensor: dtype torch\.float16 does not match the chunk's torch\.float32"),
    BadInput("append-int-tensor", lambda env: env["open"].append_tensor(torch.zeros(2, dtype=torch.int32)), TypeError, r"append_tensor: dtype torch\.int32 does not match"),
    BadInput("append-meta", lambda env: env["open"].append_tensor(torch.zeros(2, device="meta")), ValueError, r"append_tensor: the tensor \(shape \(2,\)\) is on the meta device"),
    BadInput("append-noncontiguous", lambda env: env["open"].append_tensor(torch.zeros(2, 2).t()), ValueError, r"append_tensor: the tensor must be dense and contiguous \(shape \(2, 2\)\)"),
    BadInput("append-too-big", lambda env: env["open"].append_tensor(torch.zeros(13)), RuntimeError, r"append_tensor: a tensor of 13 elements does not fit \(12 of 16 left\)"),
    BadInput("append-to-closed", lambda env: env["chunk"].append_tensor(torch.zeros(1)), RuntimeError, r"append_tensor: the chunk is closed"),
    BadInput("close-twice", lambda env: env["chunk"].close_chunk(), RuntimeError, r"close_chunk: already closed"),
    BadInput("access-before-close", lambda env: env["open"].access(), RuntimeError, r"Chunk 7\.access: call close_chunk first"),
    BadInput("release-in-use", lambda env: (_gathered(env).trans_tensor_state(env["ts"][0], S.COMPUTE), env["chunk"].release()), RuntimeError, r"release: cannot release \(keep_gathered=False, tensor states \{.*'COMPUTE': 1"),
    BadInput("release-kept-gathered", lambda env: env["kept"].release(), RuntimeError, r"release: cannot release \(keep_gathered=True"),
    BadInput("reduce-not-ready", lambda env: _gathered(env).reduce(), RuntimeError, r"reduce: every tensor must be READY_FOR_REDUCE"),
    BadInput("zero-buffer-gathered", lambda env: env["kept"].zero_buffer(), RuntimeError, r"zero_buffer: the chunk is gathered"),
    BadInput("illegal-transition", lambda env: env["chunk"].trans_tensor_state(env["ts"][0], S.READY_FOR_REDUCE), RuntimeError, r"illegal transition HOLD -> READY_FOR_REDUCE"),
    BadInput("transition-str", lambda env: env["chunk"].trans_tensor_state(env["ts"][0], "COMPUTE"), TypeError, r"trans_tensor_state: new must be a TensorState \(got 'COMPUTE'\)", True),
    BadInput("transition-foreign-tensor", lambda env: env["chunk"].trans_tensor_state(torch.zeros(3), S.COMPUTE), ValueError, r"tensor of shape \(3,\) is not in this chunk"),
    BadInput("tensor-state-foreign", lambda env: env["chunk"].tensor_state(torch.zeros(3)), ValueError, r"tensor_state: the tensor \(shape \(3,\)\) is not in this chunk", True),
    BadInput("grad-view-foreign", lambda env: env["chunk"].grad_view(torch.zeros(3)), ValueError, r"grad_view: the tensor \(shape \(3,\)\) is not in this chunk", True),
    BadInput("grad-view-before-init", lambda env: env["chunk"].grad_view(env["ts"][0]), RuntimeError, r"grad_view: call init_grad_chunk first"),
    BadInput("copy-into-slot-foreign", lambda env: _gathered(env).copy_into_slot(torch.zeros(3), None), ValueError, r"copy_into_slot: the tensor \(shape \(3,\)\) is not in this chunk", True),
    BadInput("copy-into-slot-numel", lambda env: _gathered(env).copy_into_slot(env["ts"][0], torch.zeros(5)), ValueError, r"copy_into_slot: values must have the tensor's 4 elements \(got 5\)", True),
    BadInput("copy-into-slot-released", lambda env: env["chunk"].copy_into_slot(env["ts"][0], None), RuntimeError, r"copy_into_slot: the chunk is not gathered"),
    BadInput("write-share-numel", lambda env: env["chunk"].write_share(torch.zeros(3)), ValueError, r"write_share: values must have the share's 16 elements \(got 3\)", True),
    BadInput("shard-move-bogus", lambda env: env["chunk"].shard_move("nvme"), ValueError, r"shard_move: device is not a device \(got 'nvme'\)", True),
    BadInput("shard-move-meta", lambda env: env["chunk"].shard_move("meta"), ValueError, r"shard_move: device cannot be meta \(got 'meta'\)", True),
    BadInput("pair-not-chunk", lambda env: env["chunk"].pair(torch.zeros(16)), TypeError, r"pair: master must be a Chunk \(got Tensor\)", True),
    BadInput("pair-other-size", lambda env: env["chunk"].pair(Chunk(32, None, torch.float32, compute_device="cpu")), ValueError, r"pair: the master chunk has another size or group"),
    BadInput("sync-gathered-sharded", lambda env: env["chunk"].sync_gathered(), RuntimeError, r"sync_gathered: the chunk is sharded"),
    # -- ChunkManager ---------------------------------------------------------------------------
    BadInput("manager-config-list", lambda env: ChunkManager([16]), TypeError, r"ChunkManager: chunk_configuration must be a dict .* \(got \[16\]\)", True),
    BadInput("manager-config-entry-int", lambda env: ChunkManager({"k": 16}), TypeError, r"chunk_configuration\['k'\] must be a dict with chunk_size \(got 16\)", True),
    BadInput("manager-chunk-size-0", lambda env: ChunkManager({"k": {"chunk_size": 0}}), ValueError, r"chunk_size of config 'k' must be an int >= 1 \(got 0\)"),
    BadInput("manager-chunk-size-missing", lambda env: ChunkManager({"k": {}}), ValueError, r"chunk_size of config 'k' must be an int >= 1 \(got None\)"),
    BadInput("manager-device-cuda-less", lambda env: ChunkManager(CFG, compute_device="cuda"), ValueError, r"ChunkManager: compute_device is 'cuda' but CUDA is not available", True),
    BadInput("register-not-tensor", lambda env: env["m"].register_tensor([1.0], "fp32_param", "k"), TypeError, r"register_tensor: tensor must be a tensor \(got list\)", True),
    BadInput("register-int-tensor", lambda env: env["m"].register_tensor(torch.zeros(3, dtype=torch.int64), "fp32_param", "k"), TypeError, r"register_tensor: tensor must be floating point \(got torch\.int64, shape \(3,\)\)", True),
    BadInput("register-meta", lambda env: env["m"].register_tensor(torch.zeros(3, device="meta"), "fp32_param", "k"), ValueError, r"register_tensor: tensor \(shape \(3,\)\) is on the meta device", True),
    BadInput("register-sparse", lambda env: env["m"].register_tensor(torch.zeros(3).to_sparse(), "fp32_param", "k"), ValueError, r"register_tensor: tensor must be dense and contiguous \(got shape \(3,\), torch\.sparse_coo", True),
    BadInput("register-twice", lambda env: env["m"].register_tensor(env["ts"][0], "fp32_param", "k"), ValueError, r"register_tensor: tensor of shape \(4,\) is already registered \(in chunk 0\)", True),
    BadInput("register-unknown-key", lambda env: env["m"].register_tensor(torch.zeros(3), "fp32_param", "nope"), KeyError, r"no chunk configuration for 'nope'"),
    BadInput("get-chunk-unregistered", lambda env: env["m"].get_chunk(torch.zeros(3)), KeyError, r"ChunkManager: tensor of shape \(3,\) is not registered"),
    BadInput("init-grad-chunk-reused", lambda env: env["m"].init_grad_chunk(env["chunk"]), RuntimeError, r"init_grad_chunk: gradients reuse the fp16 chunk \(reuse_fp16_chunk=True\)"),
    BadInput("move-chunk-meta", lambda env: env["m"].move_chunk(env["chunk"], "meta"), ValueError, r"shard_move: device cannot be meta", True),
    # -- search_chunk_configuration -------------------------------------------------------------
    BadInput("search-model-dict", _search({"w": torch.zeros(3)}, 1), TypeError, r"search_chunk_configuration: model must be an nn\.Module \(got dict\)"),
    BadInput("search-range-0", _on_model(search_range_m=0), ValueError, r"search_range_m must be > 0 \(got 0\)"),
    BadInput("search-range-str", _on_model(search_range_m="32"), TypeError, r"search_range_m must be a number \(got '32'\)"),
    BadInput("search-range-inf", _on_model(search_range_m=float("inf")), ValueError, r"search_range_m must be finite \(got inf\)"),
    BadInput("search-interval-0", _on_model(search_range_m=1, search_interval=0), ValueError, r"search_interval must be >= 1 \(got 0\)"),
    BadInput("search-interval-float", _on_model(search_range_m=1, search_interval=1.5), TypeError, r"search_interval must be an int \(got 1\.5\)"),
    BadInput("search-interval-bool", _on_model(search_range_m=1, search_interval=True), TypeError, r"search_interval must be an int \(got True\)"),
    BadInput("search-min-negative", _on_model(search_range_m=1, min_chunk_size_m=-1), ValueError, r"min_chunk_size_m must be >= 0 \(got -1\)"),
    BadInput("search-min-nan", _on_model(search_range_m=1, min_chunk_size_m=float("nan")), ValueError, r"min_chunk_size_m must be finite \(got nan\)"),
    BadInput("search-no-params", _search(nn.ReLU(), 1), ValueError, r"the model has no parameters \(got ReLU\)"),
    # -- LazyInitContext ---------------------------------------------------------------------------
    BadInput("lazy-nested", _nested, RuntimeError, r"LazyInitContext: this context is already entered \(got a nested `with` on it\)"),
    BadInput("lazy-other-nested", _other_nested, RuntimeError, r"LazyInitContext: another LazyInitContext is already entered in this thread \(got nested blocks\)", True),
    BadInput("lazy-default-device-bogus", lambda env: LazyInitContext(default_device="gpu"), ValueError, r"LazyInitContext: default_device is not a device \(got 'gpu'\)", True),
    BadInput("lazy-default-device-meta", lambda env: LazyInitContext(default_device="meta"), ValueError, r"LazyInitContext: default_device cannot be meta \(got 'meta'\); it is the device the initialisation runs on", True),
    BadInput("lazy-default-device-float", lambda env: LazyInitContext(default_device=1.5), TypeError, r"LazyInitContext: default_device must be a torch\.device, str, int or None \(got 1\.5\)", True),
    BadInput("lazy-default-device-cuda-less", lambda env: LazyInitContext(default_device=torch.device("cuda")), ValueError, r"LazyInitContext: default_device is device\(type='cuda'\) but CUDA is not available", True),
    BadInput("colo-device-meta", lambda env: ColoInitContext(device="meta"), ValueError, r"ColoInitContext: device cannot be meta \(got 'meta'\)", True),
    BadInput("colo-device-bogus", lambda env: ColoInitContext(device="gpu"), ValueError, r"ColoInitContext: device is not a device \(got 'gpu'\)", True),
    BadInput("colo-dtype-int", lambda env: ColoInitContext(dtype=torch.int64), TypeError, r"ColoInitContext: dtype must be a floating-point torch\.dtype \(got torch\.int64\)", True),
    BadInput("colo-default-pg", lambda env: ColoInitContext(default_pg=object()), NotImplementedError, r"ColoInitContext: default_pg is not implemented \(got object\): it configured ColossalAI's tensor parallelism", True),
    BadInput("materialize-eager-model", lambda env: LazyInitContext.materialize(env["model"]), ValueError, r"materialize: the model was not built under LazyInitContext \(got Linear\)"),
    BadInput("materialize-twice", _materialized_twice, RuntimeError, r"materialize: the model was already materialized \(got Linear\)"),
    BadInput("materialize-not-module", lambda env: LazyInitContext.materialize([env["lazy"]]), TypeError, r"materialize: model must be an nn\.Module .* \(got list\)", True),
    BadInput("materialize-init-fn-int", lambda env: LazyInitContext.materialize(env["lazy"], init_fn=3), TypeError, r"materialize: init_fn must be callable \(got int\)"),
    BadInput("materialize-device-bogus", lambda env: LazyInitContext.materialize(env["lazy"], device="gpu"), ValueError, r"materialize: device is not a device \(got 'gpu'\)", True),
    BadInput("materialize-device-meta", lambda env: LazyInitContext.materialize(env["lazy"], device="meta"), ValueError, r"materialize: device cannot be meta \(got 'meta'\)", True),
    BadInput("distribute-no-manager", lambda env: LazyInitContext.distribute(env["lazy"], CFG, config_key="k"), TypeError, r"distribute: chunk_manager must be a ChunkManager \(got dict\)", True),
    BadInput("distribute-unknown-key", _distribute(config_key="nope"), KeyError, r"distribute: no chunk configuration for config_key .nope. \(got keys \[.k., .g.\]\)", True),
    BadInput("distribute-dtype-int", _distribute(dtype=torch.int8), TypeError, r"distribute: dtype must be a floating-point torch\.dtype or None \(got torch\.int8\)", True),
    BadInput("distribute-dtype-str", _distribute(dtype="bf16"), TypeError, r"distribute: dtype must be .* \(got 'bf16'\)", True),
    BadInput("distribute-register-fn-int", _distribute(register_fn=3), TypeError, r"distribute: register_fn must be callable or None \(got int\)", True),
    # -- collective debug switches -----------------------------------------------------------------
    BadInput("debug-collectives-str", lambda env: debug_collectives("yes"), TypeError, r"debug_collectives: enabled must be a bool or None \(got 'yes'\)"),
    BadInput("collective-label-int", lambda env: set_collective_label(3), TypeError, r"set_collective_label: label must be a str \(got 3\)", True),
]  # fmt: skip
if torch.cuda.is_available():  # the CUDA-less cases are the ones this machine can run
    CASES = [c for c in CASES if not c.id.endswith("-cuda-less")]


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case: BadInput) -> None:
    check_bad_input(case, _env(), _snapshot, _still_works, cleanup=_undo_gather)


def _undo_gather(env: dict[str, Any]) -> None:
    chunk = env["chunk"]
    for info in chunk.tensors_info.values():  # undo what a case did before its bad call
        if info.state is S.COMPUTE:
            chunk.trans_info_state(info, S.HOLD)
    env["m"].release_chunk(chunk)


def test_the_table_names_every_case_once() -> None:
    check_unique_ids(CASES)
