"""A failed CPU update under ZeroOptimizer(cpu_offload=True) keeps the
gradients; once the cause is removed, step() again finishes the step and
training goes on with the losses of a run that never failed. See [Note: a
failed CPU update in ZeRO]."""

from __future__ import annotations

import pytest
import torch

from zerostack.shard import ZeroOptimizer
from zerostack.testing import GPTConfig, TinyGPT, make_batch

# cpu_offload steps through zerostack-fused-adam, an optional dependency.
_kernels = pytest.importorskip("zerostack.fused_adam._kernels")
CONFIG = GPTConfig(bias=False, vocab_size=64, dim=32, max_seq_len=16)
STEPS, FAULT_STEP = 5, 2


class _KernelFault:
    """While ``active``, every CPU Adam kernel call raises before it runs."""

    def __init__(self, monkeypatch) -> None:
        self.active, self.raised = False, 0
        real = _kernels.launch

        def launch(params, *args, **kwargs):
            if self.active and params[0].device.type == "cpu":
                self.raised += 1
                raise OSError("nvme read failed: injected")
            return real(params, *args, **kwargs)

        monkeypatch.setattr(_kernels, "launch", launch)


def _wrapped(stage):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    opt = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
        module=model, stage=stage, cpu_offload=True, gc_every_n_steps=0,
    )  # fmt: skip
    return model, opt


def _state(model, opt):
    sd = opt.state_dict()
    return [p.detach().clone() for p in model.parameters()], sd["masters"], sd["optimizer"]["state"]


def _same(a, b):
    params = all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1], strict=True))
    return params and all(
        torch.equal(torch.as_tensor(a[2][i][k]), torch.as_tensor(b[2][i][k]))
        for i in a[2]
        for k in a[2][i]
    )


def _train(model, opt, fault=None):
    losses = []
    for step in range(STEPS):
        idx, tgt = make_batch(CONFIG, 4, 8, seed=step)
        loss = model(idx, tgt)
        opt.backward(loss)
        if fault is not None and step == FAULT_STEP:
            fault.active = True
            before = _state(model, opt)
            for _ in range(2):  # the cause stays: each step() raises, nothing changes
                with pytest.raises(RuntimeError, match=r"update failed \(OSError: nvme read"):
                    opt.step()
                assert _same(before, _state(model, opt))
            with pytest.raises(RuntimeError, match=r"call step\(\) again first"):
                opt.backward(model(idx, tgt))
            fault.active = False  # the cause removed
        assert opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stage", [1, 2])
def test_a_failed_cpu_update_runs_again_on_the_next_step(stage, monkeypatch):
    torch.set_num_threads(1)
    reference = _train(*_wrapped(stage))
    model, opt = _wrapped(stage)
    fault = _KernelFault(monkeypatch)
    assert _train(model, opt, fault) == reference  # bitwise
    assert fault.raised == 2
