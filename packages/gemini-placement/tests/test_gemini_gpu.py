"""Gemini on a CUDA device (one rank, NCCL): the parity cases whose paths
exist only there (pinned gradient staging, the CPU step on a worker thread
with asynchronous copies back, auto placement with measured memory)."""

from __future__ import annotations

import pytest
import torch

from zerostack.testing import spawn

pytestmark = pytest.mark.gpu

# Every CPU case: among them the write-back of kept-gathered chunks
# (half-sharded, zero2), the zero fill of a chunk whose parameter got no
# gradient (the unused parameter in every non-auto case), frozen and tied
# parameters, and gradient accumulation.
GPU_CASES = [
    "fp32-adamw",
    "fp32-adam-l2-clip",
    "fp32-sgd-clip-offload",
    "fp32-zero2",
    "fp32-half-sharded",
    "fp32-frozen-embedding",
    "bf16-adamw",
    "bf16-clip-offload",
    "fp16-clip-offload",
    "fp32-l2-accum4",
    "fp32-zero2-accum4",
    "fp32-tied-embeddings",
    "fp32-auto-evicting",
    "bf16-auto-evicting",
    "fp32-offload-prefetch",
    "fp32-accum4-prefetch",
    "fp32-sgd-each-reduced",
    "fp32-each-reduced-prefetch",
]


def _all_cuda(rank, world, names):
    from test_gemini_parity import CASES, _run_case

    torch.cuda.set_device(rank)
    for case in CASES:
        if case[0] in names:
            _run_case(rank, world, case, device=f"cuda:{rank}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_parity_with_ddp_on_cuda():
    spawn(_all_cuda, 1, args=(GPU_CASES,), backend="nccl", timeout_s=300)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pin", [False, True])
def test_static_gathers_ahead_train_the_same_on_one_gpu(pin, monkeypatch):
    # One process, no process group. Pinned host shards gathered ahead are
    # copied on the copy stream and waited for by an event (see
    # zerostack.chunk's [Note: a prefetch copies beside compute]); the copy
    # stream is held back 10 ms before each copy, so a kernel that did not
    # wait would read the buffer before the copy lands. Pageable shards are
    # gathered on the compute stream. Bitwise the run without.
    from test_gemini_placement import _blocks, _train

    import zerostack.chunk._chunk as chunk_module

    real, delayed = chunk_module.copy_stream, []

    def late(device):
        stream = real(device)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(20_000_000)
        delayed.append(device)
        return stream

    monkeypatch.setattr(chunk_module, "copy_stream", late)
    kwargs = dict(pin_memory=pin, offload_optim_frac=0.5)
    want = _train(*_blocks(0, "cuda", **kwargs), 6, skip_at=2, fail_at=3, fail_backward_at=4)
    model, ddp, opt = _blocks(2, "cuda", **kwargs)
    got = _train(model, ddp, opt, 6, skip_at=2, fail_at=3, fail_backward_at=4)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert ddp.placement.prefetches > 0
    assert bool(delayed) == pin, "pinned shards go through the copy stream, pageable ones do not"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_updates_read_reduced_shares_after_they_land_in_pinned_host_memory(monkeypatch):
    # See zerostack.chunk's [Note: a reduced share lands on the host]: every
    # gradient share's copy to pinned host memory is held back 10 ms on the
    # compute stream, so a CPU update that read its share before the copy
    # landed would step on the parameters instead of the gradient. Bitwise
    # the run with pageable shards, whose copies make the host wait.
    from test_gemini_placement import _blocks, _train

    from zerostack.chunk import Chunk

    real, held = Chunk._land, []

    def late(self, share, out):
        if share.is_pinned():
            torch.cuda._sleep(20_000_000)
            held.append(self.index)
        real(self, share, out)

    monkeypatch.setattr(Chunk, "_land", late)
    kwargs = dict(offload_optim_frac=1.0, offload_param_frac=1.0)
    want = _train(*_blocks(0, "cuda", pin_memory=False, **kwargs), 6, skip_at=2, fail_at=3,
                  fail_backward_at=4)  # fmt: skip
    assert not held
    got = _train(*_blocks(0, "cuda", pin_memory=True, **kwargs), 6, skip_at=2, fail_at=3,
                 fail_backward_at=4)  # fmt: skip
    assert held, "no reduced share was copied to pinned host memory"
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_step_amounts_count_the_parameters_streamed_from_the_host():
    # zerostack.shard.step_floor's keywords from the placement: shards on the
    # host cross for forward and backward, and their updates stay there.
    from test_gemini_placement import _blocks

    for param_frac in (1.0, 0.0):
        _, ddp, _ = _blocks(0, "cuda", offload_optim_frac=1.0, offload_param_frac=param_frac)
        amounts = ddp.step_amounts()
        shards = sum(c.shard_size * 4 for c in ddp.param_chunks)
        assert amounts["host_numel"] == sum(c.shard_size for c in ddp.param_chunks)
        assert amounts["streamed_bytes"] == (shards if param_frac else 0)
        assert amounts["h2d_bytes_per_param"] == (0 if param_frac else 4)
        assert amounts["d2h_bytes_per_param"] == 4


def _norm_on_device(rank, world, device="cuda"):
    from test_gemini_clip import CHUNKS, CONFIG, _norm_reads

    from zerostack.gemini import GeminiDDP, GeminiOptimizer
    from zerostack.gemini._optimizer import _grad_share, _grad_target
    from zerostack.testing import TinyGPT, make_batch

    if device == "cuda":
        torch.cuda.set_device(rank)
    torch.manual_seed(0)
    ddp = GeminiDDP(
        TinyGPT(CONFIG), mixed_precision=torch.bfloat16, chunk_config_dict={world: CHUNKS},
        compute_device=device, offload_param_frac=1.0, offload_optim_frac=1.0,
    )  # fmt: skip
    opt = GeminiOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), ddp, max_norm=1.0)
    with _norm_reads() as read:
        for step in range(3):
            idx, tgt = (t.to(device) for t in make_batch(CONFIG, 4, 16, seed=100 * step + rank))
            opt.backward(ddp(idx, tgt).float())
            shares = [_grad_share(c) for c, _ in opt.pairs]
            assert all(s.device.type == "cpu" for s in shares), step
            norms = [_grad_target(c).reduced_norm() for c, _ in opt.pairs]
            assert all(n.device.type == device for n in norms), step
            expected = torch.nn.utils.get_total_norm([s.float() for s in shares], 2.0).item()
            read.clear()
            assert opt.step()
            assert read == [0], (step, read)  # no host share read at the step
            assert opt.last_grad_norm == pytest.approx(expected, rel=1e-5), step
    opt.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_step_takes_host_shares_norms_from_their_reductions_on_the_device():
    # Every gradient share lives in host memory; the step's norm (clipping,
    # max_norm=1) comes from norms the reductions took on the GPU. See
    # zerostack.chunk's [Note: the reduced share's norm].
    spawn(_norm_on_device, 1, backend="nccl", timeout_s=300)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_held_gradients_leave_for_the_host_during_backward(monkeypatch):
    # See [Note: gradients leave during backward]: a CPU-held chunk's reduced
    # gradient is copied to the host as soon as backward reduced it (six
    # chunks: the four whose reduction finishes inside backward, the last two
    # at its end). Every copy is held back 20 ms on its stream, so a CPU
    # update that read its buffer before the copy landed would step on the
    # last step's gradient; a batch that leaves a layer out, one that fails
    # in forward and one that fails in backward (dropped with a copy in
    # flight) come between. Bitwise the run without the delay.
    from test_gemini_placement import _blocks, _train

    from zerostack.gemini import TrainingState
    from zerostack.gemini._cpu_step import CpuStepPipeline

    real, states = CpuStepPipeline.stage_grad, []
    kwargs = dict(offload_optim_frac=1.0, offload_param_frac=0.0)
    want = _train(*_blocks(0, "cuda", **kwargs), 6, skip_at=2, fail_at=3, fail_backward_at=4)

    def late(self, chunk, grad):
        with torch.cuda.stream(self._d2h):
            torch.cuda._sleep(20_000_000)
        states.append(ddp.training_state)
        real(self, chunk, grad)

    monkeypatch.setattr(CpuStepPipeline, "stage_grad", late)
    model, ddp, opt = _blocks(0, "cuda", **kwargs)
    got = _train(model, ddp, opt, 6, skip_at=2, fail_at=3, fail_backward_at=4)
    assert all(torch.equal(got[k], want[k]) for k in want)
    # Four backwards reduce all six chunks: four staged inside backward, two
    # at its end. The failing one (step 4) reduces three chunks before it
    # raises, of which at most one finishes first.
    during = states.count(TrainingState.BACKWARD)
    assert 4 * 4 <= during <= 4 * 4 + 1 and states.count(TrainingState.REDUCED) == 4 * 2, states
