"""The picture of memory: GeminiDDP.chunk_placement (where every chunk lives)
and memory_timeline (bytes per tier over one step, a table and a PNG)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from zerostack.fused_adam import HybridAdam
from zerostack.gemini import TIERS, GeminiDDP, GeminiOptimizer, tier_bytes
from zerostack.testing import GPTConfig, TinyGPT, make_batch

CONFIG = GPTConfig(bias=False)
CHUNK = 20_000


def _wrap(dtype=torch.float32, offload_optim_frac=0.0, **adam):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(
        model, mixed_precision=dtype, compute_device="cpu", offload_optim_frac=offload_optim_frac,
        chunk_config_dict={1: {"chunk_size": CHUNK, "keep_gathered": False}},
    )  # fmt: skip
    return ddp, GeminiOptimizer(HybridAdam(list(model.parameters()), lr=1e-3, **adam), ddp)


def _step(ddp, opt, timeline=None):
    idx, tgt = make_batch(CONFIG, 2, 16, seed=0)
    opt.backward(ddp(idx, tgt))
    if timeline is not None:
        timeline.sample("before step")
    opt.step()
    ddp.wait_updates()


def test_chunk_placement_counts_every_chunk_and_its_bytes():
    ddp, _ = _wrap(torch.float16)
    rows = ddp.chunk_placement()
    assert len(rows) == len(ddp.chunk_manager.chunks())
    params = [r for r in rows if r.kind == "param"]
    masters = [r for r in rows if r.kind == "master"]
    assert len(params) == len(masters) == len(ddp.grad_chunks)
    for r in params + masters:  # one rank: the shard is the whole chunk, on the host
        assert r.home == "pageable" and not r.gathered and r.chunk_size == CHUNK
        assert r.usage == {"gpu": 0, "pinned": 0, "pageable": CHUNK * r.dtype.itemsize, "disk": 0}
    assert {r.dtype for r in params} == {torch.float16}
    table = ddp.chunk_placement(table=True)
    assert f"chunk size: {CHUNK} elements" in table
    assert f"param  pageable {len(params):>6}" in table


def test_timeline_records_the_gathers_of_a_step():
    ddp, opt = _wrap()
    _step(ddp, opt)
    with ddp.memory_timeline(opt) as timeline:
        _step(ddp, opt, timeline)
    labels = [label for label, _ in timeline.samples]
    assert labels[0] == "start" and labels[-1] == "end" and "before step" in labels
    assert any(label.startswith("fwd blocks.0") for label in labels)
    assert any(label.startswith("bwd ") for label in labels)
    start = timeline.samples[0][1]["pageable"]
    # The effect: gathered buffers exist during forward on top of the shards,
    # and the optimizer's states (2 x fp32 per master element) are counted:
    # fp32 parameter chunks, fp32 masters, two states.
    assert max(s["pageable"] for label, s in timeline.samples if label.startswith("fwd")) > start
    masters = sum(c.chunk_size for c in ddp.chunk_manager.chunks("fp32_param"))
    assert start >= masters * (4 + 4 + 8)
    assert timeline.peak()["gpu"] == 0
    table = timeline.table()
    assert all(f"{t} MB" in table.splitlines()[0] for t in TIERS)
    assert len(table.splitlines()) == len(timeline.samples) + 2
    count = len(timeline.samples)
    _step(ddp, opt)  # the hooks are gone with the recording
    assert len(timeline.samples) == count


def test_timeline_png_or_the_pip_command(tmp_path):
    ddp, opt = _wrap()
    with ddp.memory_timeline(opt) as timeline:
        _step(ddp, opt, timeline)
    if importlib.util.find_spec("matplotlib") is None:
        with pytest.raises(ImportError, match=r"pip install 'zerostack-gemini\[plot\]'"):
            timeline.save_png(tmp_path / "m.png")
        return
    path = timeline.save_png(tmp_path / "m.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_states_on_disk_are_the_disk_tier(tmp_path):
    pytest.importorskip("zerostack.nvme")
    # Only optimizer chunks on the host go to disk: see [Note: NVMe on the host tier].
    ddp, opt = _wrap(
        offload_optim_frac=1.0, nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path)
    )
    assert tier_bytes(ddp, opt)["disk"] == 0
    _step(ddp, opt)
    on_disk = opt.optimizer.nvme_bytes_on_disk()
    assert on_disk > 0 and tier_bytes(ddp, opt)["disk"] == on_disk
