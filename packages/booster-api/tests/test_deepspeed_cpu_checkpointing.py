"""activation_checkpointing.cpu_checkpointing of a DeepSpeed config: the
tensors the forward saves outside checkpointed regions (the checkpoint
inputs) go through the host-memory hooks, one per checkpointed block, and
training is bitwise what it is without them (see [Note: cpu_checkpointing])."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from zerostack.booster import Booster, LowLevelZeroPlugin
from zerostack.testing import GPTConfig, TinyGPT, make_batch, one_torch_thread

BATCH, SEQ = 2, 8


def _checkpointed(model: TinyGPT, reentrant: bool) -> TinyGPT:
    for block in model.blocks:
        forward = block.forward
        block.forward = lambda x, f=forward: checkpoint(f, x, use_reentrant=reentrant)
    return model


def _boost(model, cpu_checkpointing):
    config = {"zero_optimization": {"stage": 2},
              "activation_checkpointing": {"cpu_checkpointing": cpu_checkpointing},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}  # fmt: skip
    booster = Booster(plugin=LowLevelZeroPlugin.from_deepspeed_config(config))
    model, opt, *_ = booster.boost(model)
    return booster, model, opt


def _saved(layers: int, reentrant: bool | None) -> tuple[int, int]:
    """What one forward of a ``layers``-block model puts through the hooks."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(bias=False, vocab_size=64, dim=16, max_seq_len=16, num_layers=layers))
    if reentrant is not None:
        _checkpointed(model, reentrant)
    booster, model, opt = _boost(model, True)
    idx, tgt = make_batch(model.unwrap().config, BATCH, SEQ, seed=0)
    with one_torch_thread():
        booster.backward(model(idx, tgt), opt)
    return model.host_activations.saved_tensors, model.host_activations.saved_bytes


@pytest.mark.parametrize("reentrant", [False, True])
def test_each_checkpointed_block_saves_only_its_input_through_the_hooks(reentrant):
    one, two = _saved(1, reentrant), _saved(2, reentrant)
    # One more checkpointed block: one more saved tensor, its (batch, seq, dim) fp32 input.
    assert two[0] - one[0] == 1
    assert two[1] - one[1] == BATCH * SEQ * 16 * 4
    plain_one, plain_two = _saved(1, None), _saved(2, None)
    assert plain_two[0] - plain_one[0] > 10  # without checkpointing: every activation


def test_training_is_bitwise_the_same_with_and_without_it():
    torch.manual_seed(0)
    base = _checkpointed(
        TinyGPT(GPTConfig(bias=False, vocab_size=64, dim=16, max_seq_len=16)), False
    )
    runs = []
    for on in (True, False):
        booster, model, opt = _boost(copy.deepcopy(base), on)
        losses = []
        for step in range(3):
            idx, tgt = make_batch(model.unwrap().config, BATCH, SEQ, seed=step)
            loss = model(idx, tgt)
            booster.backward(loss, opt)
            opt.step()
            losses.append(loss.detach())
        runs.append((losses, [p.detach() for p in model.unwrap().parameters()]))
        assert (getattr(model, "host_activations", None) is not None) == on
    for a, b in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_checkpoint_inputs_leave_the_gpu():
    """On a GPU the saved inputs live in pinned host memory until backward:
    the peak after forward is lower by about their size."""
    torch.manual_seed(0)
    config = GPTConfig(bias=False, vocab_size=256, dim=512, max_seq_len=256, num_layers=8)
    base = _checkpointed(TinyGPT(config), False)
    peaks = {}
    for on in (False, True):
        booster, model, opt = _boost(copy.deepcopy(base), on)
        idx, tgt = make_batch(config, 8, 256, seed=0, device="cuda")
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        loss = model(idx, tgt)
        torch.cuda.synchronize()
        peaks[on] = torch.cuda.memory_allocated() - start
        booster.backward(loss, opt)
        opt.step()
        del booster, model, opt, loss
    inputs = config.num_layers * 8 * 256 * 512 * 4
    assert peaks[False] - peaks[True] >= 0.9 * inputs, peaks


def test_a_tensor_saved_twice_goes_to_the_host_once_and_parameters_stay():
    from zerostack.booster._plugins._deepspeed_train import HostActivations

    class Square(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            y = (x * self.w).sin()  # mul saves x (and w, a parameter); sin saves x * w
            return y * y  # saves y twice: once to the host

    module = Square()
    hooks = HostActivations(module)
    module(torch.randn(3, 4)).sum().backward()
    assert hooks.saved_tensors == 3 and hooks.saved_bytes == 3 * 12 * 4
    hooks.remove()
    module(torch.randn(3, 4))
    assert hooks.saved_tensors == 3  # no hooks after remove()
