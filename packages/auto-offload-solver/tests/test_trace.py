"""Tracing transformers GPT-2 and LLaMA on fake tensors; per-node facts on meta."""

from __future__ import annotations

import operator

import pytest
import torch
from offload_helpers import batch, tiny_gpt2, tiny_llama

from zerostack.auto_offload import propagate, retarget_devices, trace_model

MATMULS = {"aten.addmm.default", "aten.linear.default", "aten.mm.default"}


def _matmul_params(model: torch.nn.Module) -> int:
    """Elements of the 2-D weights used as matmul operands (not the embeddings)."""
    names = ("c_attn", "c_proj", "c_fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
             "up_proj", "down_proj", "lm_head")  # fmt: skip
    return sum(
        p.numel()
        for n, p in model.named_parameters(remove_duplicate=False)
        if p.dim() == 2 and any(k in n for k in names)
    )


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_trace_and_propagate(build):
    model = build().to(torch.bfloat16)
    inputs = batch(2, 8)
    gm = trace_model(model, inputs)
    # the traced graph reads the model's own parameter objects
    own = {id(p) for p in model.parameters()}
    assert {id(p) for p in gm.parameters()} <= own
    infos = propagate(gm, inputs)
    tokens = 16
    mm = [i for i in infos if str(i.node.target) in MATMULS]
    assert mm, "no matmul node found"
    # forward matmul FLOPs: 2 * tokens * weights; backward: twice that
    assert sum(i.fwd_flops for i in mm) == 2 * tokens * _matmul_params(model)
    assert sum(i.bwd_flops for i in mm) == 2 * sum(i.fwd_flops for i in mm)
    first = next(i for i in infos if str(i.node.target) == "aten.embedding.default")
    assert first.out_bytes == tokens * 64 * 2  # bf16 hidden states
    assert first.params and first.requires_grad
    out = [i for i in infos if i.is_output]
    assert len(out) == 1 and out[0].out_bytes == tokens * 128 * 2  # the logits
    for i in infos:
        if i.node.target is operator.getitem or "view" in str(i.node.target):
            assert i.out_bytes == 0, f"{i.node.name} is a view and allocates nothing"
    for i in infos:  # attention keeps what the fused CUDA kernels keep
        if str(i.node.target) == "aten.scaled_dot_product_attention.default":
            assert i.index in i.saves and i.temp_bytes == 2 * 4 * 8 * 4  # fp32 lse per (b, h, q)
    read = {id(p) for i in infos for p in i.params}
    assert read == {id(p) for p in model.parameters()}


def test_views_are_attributed_to_their_base():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            y = x @ self.w  # saves x (an input) and w
            z = y.view(-1)  # a view: no new memory
            return torch.tanh(z)  # saves its output

    gm = trace_model(M(), (torch.randn(4, 8),))
    infos = {i.node.name: i for i in propagate(gm, (torch.randn(4, 8),))}
    mm = next(i for n, i in infos.items() if "mm" in n or "matmul" in n)
    view = next(i for n, i in infos.items() if "view" in n)
    tanh = infos["tanh"]
    assert mm.out_bytes == 4 * 8 * 4 and mm.grad_bytes == 4 * 8 * 4
    assert view.out_bytes == 0 and view.inputs == (mm.index,)
    assert tanh.saves == (tanh.index,) and tanh.is_output
    assert mm.fwd_flops == 2 * 4 * 8 * 8


def test_retarget_devices_rewrites_the_trace_constants():
    model = tiny_gpt2(1)
    gm = trace_model(model, batch())
    assert retarget_devices(gm, torch.device("cpu"), torch.device("meta")) > 0
    devices = {
        a
        for n in gm.graph.nodes
        for a in [*n.args, *n.kwargs.values()]
        if isinstance(a, torch.device)
    }
    assert devices == {torch.device("meta")}


def test_bad_inputs():
    with pytest.raises(TypeError, match="inputs must be a dict"):
        trace_model(tiny_gpt2(1), torch.zeros(2, 8, dtype=torch.long))
    gm = trace_model(tiny_gpt2(1), batch())
    with pytest.raises(ValueError, match="lack the graph's arguments"):
        propagate(gm, {"input_ids": torch.zeros(2, 8, dtype=torch.long)})
