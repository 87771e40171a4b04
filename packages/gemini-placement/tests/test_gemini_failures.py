"""What happens when something goes wrong: a failed CPU update is kept
with its gradient and runs again once its cause is removed, giving the
losses of a run that never failed; the training state refuses steps out of
order. See [Note: a failed CPU update]."""

from __future__ import annotations

import threading
import traceback

import pytest
import torch

from zerostack.fused_adam import HybridAdam, _kernels
from zerostack.gemini import CpuStepError, GeminiDDP, GeminiOptimizer, TrainingState
from zerostack.gemini._ddp import _MOVES
from zerostack.testing import GPTConfig, TinyGPT, check_state_table, make_batch

CONFIG = GPTConfig(bias=False)
CHUNKS = {1: {"chunk_size": 20_000, "keep_gathered": False}}
STEPS, FAULT_STEP = 5, 2


class _KernelFault:
    """While ``active``, the CPU Adam kernel raises before it touches anything
    (as a failed call would), from its ``after``-th CPU call on."""

    def __init__(self, monkeypatch, after: int, hold: threading.Event | None = None) -> None:
        self.active, self.after, self.calls, self.raised = False, after, 0, 0
        real = _kernels.launch

        def launch(params, *args, **kwargs):
            if self.active and params[0].device.type == "cpu":
                self.calls += 1
                if self.calls > self.after:
                    self.raised += 1
                    if hold is not None and threading.current_thread().name != "MainThread":
                        hold.wait(60)  # on the worker: fail only once a gather waits
                    raise OSError("nvme read failed: injected")
            return real(params, *args, **kwargs)

        monkeypatch.setattr(_kernels, "launch", launch)


def _wrapped(overlap, max_norm, frac):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(
        model, mixed_precision=torch.float32, chunk_config_dict=CHUNKS, compute_device="cpu",
        offload_optim_frac=frac,
    )  # fmt: skip
    opt = GeminiOptimizer(
        HybridAdam(list(model.parameters()), lr=1e-2, weight_decay=0.1), ddp,
        overlap_cpu_step=overlap, max_norm=max_norm,
    )  # fmt: skip
    return ddp, opt


def _state(opt, chunks=None):
    """Copies of the masters and optimizer states (of the pairs whose chunk
    index is in ``chunks``; all by default): what a failed update must not change."""
    keep = [i for i, (chunk, _) in enumerate(opt.pairs) if chunks is None or chunk.index in chunks]
    masters = [opt.masters[i].detach().clone() for i in keep]
    states = [opt.optimizer.state.get(opt.masters[i], {}) for i in keep]
    inner = [{k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()} for st in states]
    return masters, inner


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True)) and all(
        torch.equal(x[k], y[k]) for x, y in zip(a[1], b[1], strict=True) for k in x
    )


def _train(ddp, opt, fault=None):
    """STEPS steps on fixed batches; with ``fault`` it is switched on for
    step FAULT_STEP and removed where its CpuStepError is caught."""
    losses, caught = [], []

    def removed(error):
        caught.append(error)
        if len(caught) == 1:  # the cause still there: a retry fails, changing nothing
            # (of the failed chunks: the worker may still be updating others)
            failed = opt.pipeline.failed
            assert error.chunk_index in failed
            before = _state(opt, failed)
            with pytest.raises(CpuStepError, match=r"chunk \d+ failed") as again:
                opt.retry_failed_updates()
            # Fresh: an update still running on the worker may have failed since.
            assert again.value.chunk_index in opt.pipeline.failed
            assert _same(before, _state(opt, failed)), "a failed retry changed the state"
        fault.active = False

    for step in range(STEPS):
        if fault is not None and step == FAULT_STEP:
            fault.active = True
        idx, tgt = make_batch(CONFIG, 2, 16, seed=step)
        try:
            loss = ddp(idx, tgt)
        except CpuStepError as error:  # the worker's failure, met by this forward
            removed(error)
            loss = ddp(idx, tgt)  # the forward again, the failed update first
        opt.backward(loss)
        try:
            opt.step()
        except CpuStepError as error:  # an inline update: the step is done but for it
            removed(error)
        losses.append(loss.item())
    opt.retry_failed_updates()  # a failure of the last step
    return losses, caught


CASES = [
    # (overlap, max_norm, offload_optim_frac): where the update runs
    (False, 0.0, 1.0),  # inline, in step
    (True, 0.0, 1.0),  # on the worker, started by step
    (True, 1.0, 1.0),  # on the worker, started by step (clipping)
    (False, 0.0, 0.5),  # half the masters stepped as device-held
    (True, 1.0, 1.0),  # on the worker, failing while the next forward gathers
]
IDS = ["inline", "worker", "worker-clip", "half-inline", "worker-mid-forward"]


@pytest.mark.parametrize(("case", "where"), list(zip(CASES, IDS, strict=True)), ids=IDS)
def test_a_failed_cpu_update_runs_again_once_the_cause_is_removed(case, where, monkeypatch):
    reference, _ = _train(*_wrapped(*case))
    ddp, opt = _wrapped(*case)
    hold = threading.Event() if where == "worker-mid-forward" else None
    # The second CPU chunk of the step fails.
    fault = _KernelFault(monkeypatch, after=1, hold=hold)
    if hold is not None:
        real_await = opt.pipeline.await_chunk

        def await_chunk(chunk):
            if ddp.training_state is TrainingState.FORWARD and fault.raised:
                hold.set()  # a failing update waits: let it fail while forward waits for it
            real_await(chunk)

        monkeypatch.setattr(opt.pipeline, "await_chunk", await_chunk)
    losses, caught = _train(ddp, opt, fault)
    assert fault.raised >= 2 and len(caught) == 1, (fault.raised, caught)
    assert isinstance(caught[0].__cause__, OSError)
    if hold is not None:  # raised by a gather in the middle of a forward
        frames = [f.name for f in traceback.extract_tb(caught[0].__traceback__)]
        assert "_gather" in frames, frames
    assert losses == reference  # bitwise: the failed step completed as if it had not failed
    assert opt.pipeline.failed == []


@pytest.mark.filterwarnings("error::UserWarning")  # no "no backward" warning either
def test_a_fault_that_stays_keeps_failing_without_changing_anything(monkeypatch):
    ddp, opt = _wrapped(False, 0.0, 1.0)
    fault = _KernelFault(monkeypatch, after=0)
    idx, tgt = make_batch(CONFIG, 2, 16, seed=0)
    opt.backward(ddp(idx, tgt))
    opt.step()
    before = _state(opt)
    fault.active = True
    opt.backward(ddp(idx, tgt))
    with pytest.raises(CpuStepError, match=r"failed \(OSError: nvme read failed: injected\)"):
        opt.step()
    failed = list(opt.pipeline.failed)
    assert failed, "no chunk is waiting for its update"
    for call in (lambda: ddp(idx, tgt), opt.step, opt.retry_failed_updates):
        with pytest.raises(CpuStepError):
            call()
        assert opt.pipeline.failed == failed
    assert _same(before, _state(opt))  # every CPU chunk failed: nothing moved


def test_the_training_state_table():
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(
        model, mixed_precision=torch.float32, chunk_config_dict=CHUNKS, compute_device="cpu"
    )
    assert check_state_table(ddp, _MOVES) == 15
    assert set(_MOVES) == set(TrainingState)


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
    # With enable_gradient_accumulation a forward carries the reduced
    # gradients to the next backward, as ColossalAI's (without it: raises,
    # see test_bad_inputs.py's ddp-forward-before-step).
    loss = ddp(idx, tgt)
    assert ddp.training_state is TrainingState.AWAIT_BACKWARD
    with pytest.raises(RuntimeError, match=r"state AWAIT_BACKWARD; step after a backward"):
        opt.step()
    opt.backward(loss)
    assert ddp.training_state is TrainingState.REDUCED
    assert opt.step()
    assert ddp.training_state is TrainingState.IDLE
    with torch.no_grad():  # evaluation does not move the state
        ddp(idx, tgt)
    assert ddp.training_state is TrainingState.IDLE


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "worker"])
def test_a_new_optimizer_runs_the_failed_updates_of_the_closed_one(overlap, monkeypatch):
    """close() and a new GeminiOptimizer on the model (what close() allows)
    after a CPU update failed: the kept update still runs before the chunk
    is used, as it would for the old optimizer; it is not forgotten with the
    old optimizer's pipeline (its chunk would then hold the gradient)."""
    idx, tgt = make_batch(CONFIG, 2, 16, seed=0)

    def run(hand_over):
        ddp, opt = _wrapped(overlap, 0.0, 1.0)
        fault = _KernelFault(monkeypatch, after=0)
        opt.backward(ddp(idx, tgt))
        opt.step()
        ddp.wait_updates()  # the worker's updates of this step run before the fault
        fault.active = True
        opt.backward(ddp(idx, tgt))
        try:
            opt.step()
            ddp(idx, tgt)  # the worker's failure meets the next forward
        except CpuStepError:
            pass
        assert opt.pipeline.failed, "no update failed"
        fault.active = False
        if hand_over:
            opt.close()
            GeminiOptimizer(HybridAdam(list(ddp.module.parameters()), lr=1e-2), ddp)
        else:
            opt.retry_failed_updates()
        with torch.no_grad():
            return ddp(idx, tgt).item(), ddp.state_dict()

    loss, state = run(hand_over=False)
    loss_new, state_new = run(hand_over=True)
    assert loss_new == loss
    assert all(torch.equal(state[k], state_new[k]) for k in state)


def test_a_new_optimizer_is_refused_while_a_failed_update_of_the_closed_one_fails(monkeypatch):
    ddp, opt = _wrapped(False, 0.0, 1.0)
    fault = _KernelFault(monkeypatch, after=0)
    idx, tgt = make_batch(CONFIG, 2, 16, seed=0)
    fault.active = True
    opt.backward(ddp(idx, tgt))
    with pytest.raises(CpuStepError):
        opt.step()
    failed, pipeline = opt.pipeline.failed, opt.pipeline
    opt.close()
    inner = HybridAdam(list(ddp.module.parameters()), lr=1e-2)
    with pytest.raises(CpuStepError, match=r"chunk \d+ failed \(OSError"):
        GeminiOptimizer(inner, ddp)
    assert ddp.step_pipeline is pipeline and pipeline.failed == failed  # still kept
    fault.active = False
    GeminiOptimizer(inner, ddp)  # the cause removed: the kept updates run, then it is built
    assert pipeline.failed == [] and ddp.step_pipeline is not pipeline
