"""Host bytes by owner (GeminiDDP.host_bytes, [Note: host bytes]): exact
against hand arithmetic, and the CPU step's and the NVMe path's staging
bounded whatever the model's size ([Note: CPU-step buffers])."""

from __future__ import annotations

import pytest
import torch

from zerostack.fused_adam import HybridAdam
from zerostack.gemini import HOST_OWNERS, GeminiDDP, GeminiOptimizer, rss_bytes
from zerostack.testing import GPTConfig, TinyGPT, make_batch

CHUNK = 20_000


def _wrap(num_layers=2, keep_gathered=False, overlap=True, **adam):
    config = GPTConfig(bias=False, num_layers=num_layers)
    torch.manual_seed(0)
    model = TinyGPT(config)
    ddp = GeminiDDP(
        model, mixed_precision=torch.bfloat16, compute_device="cpu",
        chunk_config_dict={1: {"chunk_size": CHUNK, "keep_gathered": keep_gathered}},
        offload_optim_frac=1.0, offload_param_frac=1.0,
    )  # fmt: skip
    adam = HybridAdam(list(model.parameters()), lr=1e-3, **adam)
    return config, ddp, GeminiOptimizer(adam, ddp, overlap_cpu_step=overlap)


def _steps(config, ddp, opt, n=2):
    idx, tgt = make_batch(config, 2, 16, seed=0)
    for _ in range(n):
        opt.backward(ddp(idx, tgt))
        opt.step()
    ddp.wait_updates()


def _elements(ddp) -> int:
    """Elements of every chunk (this rank's shards: the whole chunk at world size 1)."""
    return sum(c.chunk_size for c in ddp.grad_chunks)


def test_host_bytes_are_exact_for_a_small_model():
    config, ddp, opt = _wrap()
    _steps(config, ddp, opt)
    hb = opt.host_bytes()
    n = _elements(ddp)
    assert len(ddp.offloaded_masters) == len(ddp.grad_chunks) > 1
    assert hb.owners == {
        **dict.fromkeys(HOST_OWNERS, 0),
        "param_chunks": 2 * n,  # bf16 shards (the reduced gradient was written over them)
        "masters": 4 * n,
        "optim_states": 8 * n,  # Adam m, v
    }
    assert hb.total == 14 * n  # no staging copy of the model: the update writes in place
    assert hb.pinned == dict.fromkeys(HOST_OWNERS, 0)
    assert hb.num_params == sum(p.numel() for p in TinyGPT(config).parameters())
    assert hb.rss > hb.total and hb.unaccounted == hb.rss - hb.total
    assert abs(hb.rss - rss_bytes()) < 64 * 2**20
    table = hb.table()
    assert all(owner in table for owner in (*HOST_OWNERS, "rss", "unaccounted"))


def test_model_memory_report_before_the_first_step():
    _, ddp, _ = _wrap()
    n = _elements(ddp)
    hb = ddp.host_bytes()  # without the optimizer: its states are not counted
    assert hb.owners["param_chunks"] == 2 * n and hb.owners["masters"] == 4 * n
    assert hb.owners["optim_states"] == 0 and hb.total == 6 * n


def test_states_on_disk_leave_masters_shards_and_bounded_staging(tmp_path, monkeypatch):
    pytest.importorskip("zerostack.nvme")
    from zerostack.fused_adam import _nvme

    piece = 4096
    monkeypatch.setattr(_nvme, "PIECE_NUMEL", piece)
    rows = []
    for layers in (2, 6):
        config, ddp, opt = _wrap(
            layers, nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path), nvme_prefetch_depth=2
        )
        _steps(config, ddp, opt)
        hb = opt.host_bytes()
        n = _elements(ddp)
        assert opt.optimizer.nvme_bytes_on_disk() == 8 * n
        assert hb.owners["optim_states"] == 0 and hb.owners["cpu_step_values"] == 0
        # (depth + 2) slots of one piece's two moments, fp32.
        assert hb.owners["nvme_staging"] == (2 + 2) * 2 * piece * 4
        assert hb.total == 6 * n + hb.owners["nvme_staging"]
        rows.append((n, hb.owners["nvme_staging"]))
        opt.close()
    assert rows[1][0] > 2 * rows[0][0] and rows[1][1] == rows[0][1]


def test_staging_of_gathered_chunks_is_reused_not_grown():
    # Kept-gathered chunks have no host shard to write into: their values are
    # staged, and the buffers come back to a free list after the write-back.
    config, ddp, opt = _wrap(keep_gathered=True)
    _steps(config, ddp, opt, 1)
    first = opt.host_bytes().owners["cpu_step_values"]
    _steps(config, ddp, opt, 3)
    hb = opt.host_bytes()
    shards = sum(c.shard_size * 2 for c in ddp.grad_chunks)
    # At most one buffer per pending chunk (how many overlap depends on
    # timing), never a new set per step.
    assert 0 < first <= shards and 0 < hb.owners["cpu_step_values"] <= shards
    assert opt.pipeline.pending() == [] and not opt.pipeline._host_values  # all handed back


def test_grad_norm_is_taken_before_an_update_writes_over_the_gradient():
    # CPU updates write the new shard over the gradient in place: the step's
    # norm must be the gradient's, with the worker as without it.
    norms = {}
    for overlap in (True, False):
        config, ddp, opt = _wrap(overlap=overlap)
        idx, tgt = make_batch(config, 2, 16, seed=0)
        norms[overlap] = []
        for _ in range(3):
            opt.backward(ddp(idx, tgt))
            opt.step()
            norms[overlap].append(opt.last_grad_norm)
        ddp.wait_updates()
        opt.close()
    assert norms[True] == pytest.approx(norms[False], rel=1e-5)
    assert len(set(norms[True])) == 3 and all(n > 0 for n in norms[True])


class _Copy:
    """A staging buffer's copy to the device, done or still queued."""

    def __init__(self, done: bool) -> None:
        self.done, self.waited = done, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True


def test_a_free_staging_buffer_whose_copy_is_done_is_taken_first():
    # The last buffer given back has the copy queued last: taking it made the
    # CPU update wait for the GPU to run every kernel queued before that copy.
    from zerostack.gemini._cpu_step import CpuStepPipeline

    pipe = CpuStepPipeline(None, torch.device("cpu"), overlap=False)  # type: ignore[arg-type]
    bufs = [torch.empty(4) for _ in range(3)]
    copies = [_Copy(False), _Copy(True), _Copy(False)]
    for buf, copy in zip(bufs, copies, strict=True):
        pipe._give(buf, copy)
    taken = [pipe._take(4, torch.float32, False) for _ in range(4)]
    assert taken[0] is bufs[1] and not copies[1].waited  # done: no wait
    assert taken[1] is bufs[0] and copies[0].waited  # none done: the first given back
    assert taken[2] is bufs[2] and copies[2].waited
    assert all(taken[3] is not b for b in bufs)  # none free: a new one
    pipe.close()


def test_a_dropped_gradient_copy_comes_back_with_its_event():
    # A batch dropped while a gradient's copy to the host is in flight (see
    # [Note: gradients leave during backward]): its buffer's next taker, a
    # CPU update writing new values there, waits for that copy first.
    from zerostack.gemini._cpu_step import CpuStepPipeline

    pipe = CpuStepPipeline(None, torch.device("cpu"), overlap=False)  # type: ignore[arg-type]
    chunk, buf, copy = object(), torch.empty(4), _Copy(False)
    pipe._host_grads[chunk], pipe._staged[chunk] = buf, copy  # type: ignore[index]
    pipe.drop_staged(chunk)  # type: ignore[arg-type]
    assert chunk not in pipe._staged
    assert pipe._take(4, torch.float32, False) is buf and copy.waited
    pipe.close()
