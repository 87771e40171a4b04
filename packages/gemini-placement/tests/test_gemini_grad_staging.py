"""Where CPU-held chunks' reduced gradients leave for the host: inside
backward as each is reduced, the rest at its end, each once (see
zerostack.gemini's [Note: gradients leave during backward]; the copies
themselves on CUDA: test_gemini_gpu.py)."""

from __future__ import annotations

import torch

from zerostack.gemini import GeminiDDP, GeminiOptimizer


class _Staged:
    """A staged gradient copy that is always done."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def test_every_cpu_held_gradient_is_staged_once_a_backward(monkeypatch):
    # See [Note: gradients leave during backward]: of six CPU-held chunks, the
    # four whose reduction finishes inside backward are staged there, the
    # last two at its end; each once, also after an fp16 step skipped for
    # overflow (its staged copies were never read by an update) and after a
    # batch dropped in backward. On a CPU device nothing is copied: the
    # gradients are taken for a GPU's here.
    from test_gemini_placement import _Blocks

    import zerostack.gemini._optimizer as gemini_optimizer
    from zerostack.gemini import TrainingState
    from zerostack.gemini._cpu_step import CpuStepPipeline

    calls: list = []

    def stage(self, chunk, grad):
        calls.append((chunk.index, ddp.training_state))
        self._staged[chunk] = _Staged()

    monkeypatch.setattr(gemini_optimizer, "_reduced_on_host", lambda chunk: False)
    monkeypatch.setattr(CpuStepPipeline, "stage_grad", stage)
    torch.manual_seed(0)
    model = _Blocks()
    ddp = GeminiDDP(
        model, mixed_precision=torch.float16, compute_device="cpu",
        chunk_config_dict={1: {"chunk_size": 64 * 64, "keep_gathered": False}},
        offload_param_frac=1.0, offload_optim_frac=1.0,
    )  # fmt: skip
    opt = GeminiOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), ddp)
    every = sorted(c.index for c, _ in opt.pairs)
    assert len(every) == 6
    stepped = {}
    for step in range(5):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
        model.fail_backward = 2 if step == 3 else None
        calls.clear()
        try:
            loss = ddp(x)
            opt.backward(loss * float("inf") if step == 1 else loss)
        except RuntimeError:  # three chunks reduced, the first finished: dropped
            assert len(calls) == 1
            opt.zero_grad()
            continue
        assert sorted(i for i, _ in calls) == every, step
        assert [s for _, s in calls].count(TrainingState.BACKWARD) == 4, step
        stepped[step] = opt.step()
        opt.zero_grad()
    assert stepped[1] is False and stepped[4] is True, stepped  # step 1 overflowed
    opt.close()
