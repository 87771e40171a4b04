"""What happens when something goes wrong: a failed CPU update stops the
model for good, and the training state refuses steps out of order."""

from __future__ import annotations

import pytest
import torch

from zerostack.fused_adam import HybridAdam
from zerostack.gemini import CpuStepError, GeminiDDP, GeminiOptimizer, TrainingState
from zerostack.gemini._ddp import _MOVES
from zerostack.testing import GPTConfig, TinyGPT, make_batch

CONFIG = GPTConfig(bias=False)
CHUNKS = {1: {"chunk_size": 20_000, "keep_gathered": False}}


class _FailingAdam(HybridAdam):
    """Raises in its CPU step from the ``fail_at``-th call on."""

    def __init__(self, params, fail_at):
        super().__init__(params, lr=1e-3)
        self.calls, self.fail_at = 0, fail_at

    def step(self, closure=None, div_scale=-1.0):
        if any(
            p.grad is not None and p.device.type == "cpu" for p in self.param_groups[0]["params"]
        ):
            self.calls += 1
            if self.calls >= self.fail_at:
                raise OSError("disk on fire")
        return super().step(closure, div_scale=div_scale)


def _wrapped(overlap, max_norm=0.0):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(
        model, mixed_precision=torch.float32, chunk_config_dict=CHUNKS, compute_device="cpu",
        offload_optim_frac=1.0,
    )  # fmt: skip
    opt = GeminiOptimizer(
        _FailingAdam(list(model.parameters()), fail_at=len(ddp.grad_chunks) + 1), ddp,
        overlap_cpu_step=overlap, max_norm=max_norm,
    )  # fmt: skip
    return ddp, opt


@pytest.mark.parametrize(
    ("overlap", "max_norm"),
    [(True, 0.0), (True, 1.0), (False, 0.0)],
    ids=["early", "clip", "inline"],
)
def test_a_failed_cpu_update_stops_the_model(overlap, max_norm):
    ddp, opt = _wrapped(overlap, max_norm)
    idx, tgt = make_batch(CONFIG, 2, 16, seed=0)
    opt.backward(ddp(idx, tgt))  # step 1: every chunk updates
    assert opt.step()
    with pytest.raises(
        CpuStepError, match=r"the CPU update of chunk \d+ failed \(OSError: disk on fire\)"
    ) as first:
        # The first chunk update of step 2 fails: during backward (early),
        # in step (inline) or on the worker, surfacing by the next forward.
        opt.backward(ddp(idx, tgt))
        opt.step()
        ddp(idx, tgt)
    assert isinstance(first.value.__cause__, OSError)
    # From then on every forward and step raises the same error.
    with pytest.raises(CpuStepError) as again:
        ddp(idx, tgt)
    assert again.value is first.value
    with pytest.raises(CpuStepError):
        opt.step()
    with pytest.raises(CpuStepError):
        ddp.state_dict()


def test_the_training_state_table():
    moves = {(a, b) for a, targets in _MOVES.items() for b in targets}
    assert len(moves) == 9 and all(a is not b for a, b in moves)
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(
        model, mixed_precision=torch.float32, chunk_config_dict=CHUNKS, compute_device="cpu"
    )
    for old in TrainingState:
        for new in TrainingState:
            ddp._state = old
            if (old, new) in moves:
                ddp._transition(new)
                assert ddp.training_state is new
            else:
                with pytest.raises(
                    RuntimeError, match=rf"illegal transition {old.name} -> {new.name}"
                ):
                    ddp._transition(new)


def test_steps_out_of_order_are_refused():
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(
        model, mixed_precision=torch.float32, chunk_config_dict=CHUNKS, compute_device="cpu",
        enable_gradient_accumulation=True,
    )  # fmt: skip
    opt = GeminiOptimizer(HybridAdam(list(model.parameters())), ddp)
    idx, tgt = make_batch(CONFIG, 2, 16, seed=0)
    with pytest.warns(UserWarning, match=r"no backward since the last step"):
        assert opt.step() is False
    loss = ddp(idx, tgt)
    assert ddp.training_state is TrainingState.AWAIT_BACKWARD
    with pytest.raises(RuntimeError, match=r"state AWAIT_BACKWARD; step after a backward"):
        opt.step()
    with ddp.no_sync():
        opt.backward(loss)
    assert ddp.training_state is TrainingState.ACCUMULATED
    with pytest.raises(RuntimeError, match=r"state ACCUMULATED"):
        opt.step()
    opt.backward(ddp(idx, tgt))
    assert ddp.training_state is TrainingState.REDUCED
    with pytest.raises(RuntimeError, match=r"call optimizer.step\(\) before the next forward"):
        ddp(idx, tgt)
    assert opt.step()
    assert ddp.training_state is TrainingState.IDLE
    with torch.no_grad():  # evaluation does not move the state
        ddp(idx, tgt)
    assert ddp.training_state is TrainingState.IDLE
