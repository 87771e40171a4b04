"""ZeroOptimizer's training state (see [Note: ZeRO training state table]):
the table of moves, and the state each call of a step leaves."""

from __future__ import annotations

import warnings

import pytest
import torch

from zerostack.shard import TrainingState, ZeroOptimizer
from zerostack.shard._optimizer import _MOVES
from zerostack.testing import GPTConfig, TinyGPT, check_state_table, inner_steps, make_batch

CONFIG = GPTConfig(num_layers=1, dim=16, num_heads=2, bias=False)
T = TrainingState


def _loss(model, seed=0):
    idx, tgt = make_batch(CONFIG, 2, 8, seed=seed)
    return model(idx, tgt)


def test_the_training_state_table():
    zero = ZeroOptimizer(torch.optim.SGD(TinyGPT(CONFIG).parameters(), lr=0.1))
    assert check_state_table(zero, _MOVES) == 14
    assert set(_MOVES) == set(TrainingState)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "reduce-at-step"])
def test_each_call_of_a_step_leaves_its_state(overlap):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    zero = ZeroOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), module=model,
        overlap_communication=overlap,
    )  # fmt: skip
    assert zero.training_state is T.IDLE
    with zero.no_sync():
        zero.backward(_loss(model))
        assert zero.training_state is T.ACCUMULATED
        zero.zero_grad()
        assert zero.training_state is T.IDLE
        zero.backward(_loss(model))  # no_sync() outlasts zero_grad()
        assert zero.training_state is T.ACCUMULATED
    zero.backward(_loss(model, seed=1))
    assert zero.training_state is T.REDUCING
    with zero.no_sync():  # the reduced pieces are kept
        zero.backward(_loss(model, seed=2))
        assert zero.training_state is T.REDUCING
    zero.clip_grad_by_norm(1.0)
    assert zero.training_state is T.CLIPPED
    with pytest.raises(RuntimeError, match=r"a backward after clip_grad_by_norm\(\)"):
        zero.backward(_loss(model))
    assert zero.training_state is T.CLIPPED
    assert zero.step()
    assert zero.training_state is T.IDLE
    # A step without a backward: the last one consumed the gradients (as
    # DeepSpeed's), so it changes nothing, returns False and says so once.
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(UserWarning, match=r"no gradient since the last step on any rank .*nothing to\s+do: a step consumes its gradients"):  # fmt: skip
        assert not zero.step()
    assert zero.training_state is T.IDLE
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not zero.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


class _Fault:
    """While ``active``, the inner optimizer's step raises before it runs
    (given to ``inner_steps``)."""

    def __init__(self) -> None:
        self.active = False

    def __call__(self, optimizer: torch.optim.Optimizer) -> None:
        if self.active:
            raise OSError("disk read failed: injected")


@pytest.mark.parametrize("finish", ["step", "zero_grad"])
def test_a_failed_cpu_update_leaves_the_step_unfinished(finish):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    zero = ZeroOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), module=model, cpu_offload=True,
        overlap_cpu_step=False,
    )  # fmt: skip
    fault = _Fault()
    with inner_steps(zero.optimizer, fault):
        _fail_then_finish(model, zero, fault, finish)


def _fail_then_finish(model, zero, fault, finish):
    zero.backward(_loss(model))
    fault.active = True
    with pytest.raises(RuntimeError, match=r"failed \(OSError: disk read failed"):
        zero.step()
    assert zero.training_state is T.UNFINISHED
    with pytest.raises(RuntimeError, match=r"did not finish \(its CPU update, or the write-back"):
        zero.backward(_loss(model))
    with pytest.raises(RuntimeError, match=r"call step\(\) again first"):
        zero.clip_grad_by_norm(1.0)
    fault.active = False  # a direct backward would retry the update, then lose its gradients
    with pytest.raises(RuntimeError, match=r"call step\(\) again first"):
        _loss(model, seed=3).backward()
    fault.active = True
    assert zero.training_state is T.UNFINISHED
    fault.active = False
    if finish == "step":
        assert zero.step()
    else:
        zero.zero_grad()
    assert zero.training_state is T.IDLE
    zero.backward(_loss(model, seed=1))  # and training goes on
    assert zero.training_state is T.REDUCING
    assert zero.step()


def test_a_failed_write_back_leaves_the_step_unfinished_and_step_finishes_it():
    # The CPU update ran; writing the updated parameters back raised (a
    # collective's error): the refusal names the write-back too, and step()
    # writes them, as a run without the fault would have.
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ref_model = TinyGPT(CONFIG)
    ref_model.load_state_dict(model.state_dict())
    zero, ref = (
        ZeroOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1), module=m, cpu_offload=True,
            overlap_cpu_step=False,
        )
        for m in (model, ref_model)
    )  # fmt: skip
    write, failures = zero._write_back, []

    def failing(*args, **kwargs):
        if not failures:
            failures.append(True)
            raise RuntimeError("injected collective error")
        write(*args, **kwargs)

    zero._write_back = failing
    zero.backward(_loss(model))
    ref.backward(_loss(ref_model))
    with pytest.raises(RuntimeError, match="injected collective error"):
        zero.step()
    assert zero.training_state is T.UNFINISHED
    with pytest.raises(RuntimeError, match=r"the write-back of the updated parameters, raised"):
        zero.backward(_loss(model))
    assert zero.step() and ref.step()
    assert zero.training_state is T.IDLE
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
