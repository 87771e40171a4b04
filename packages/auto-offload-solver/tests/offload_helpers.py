"""Test helpers: a profile given as a dict, tiny transformers models, the
parity recipe. (A distinct module name: conftest would collide with the
other packages' conftest modules in a combined pytest run.)"""

from __future__ import annotations

import functools

import pytest
import torch

from zerostack.auto_offload import HardwareProfile

VOCAB = 128


def fake_profile(**over) -> HardwareProfile:
    data = dict(
        device_name="test-gpu",
        device_memory_bytes=10**9,
        h2d_bandwidth={4096: 1e9, 1 << 20: 2e10},
        d2h_bandwidth={4096: 1e9, 1 << 20: 2e10},
        gemm_flops={"float16": 1e12, "bfloat16": 1e12, "float32": 2.5e11},
        memory_bandwidth=1e12,
        kernel_launch_s=5e-6,
    )
    data.update(over)
    return HardwareProfile.from_dict(data)


class LogitsOnly(torch.nn.Module):
    """A transformers causal LM returning only its logits (ColossalAI's GPTLMModel)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).logits


def tiny_gpt2(num_layers: int = 3) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_embd=64, n_layer=num_layers, n_head=4, vocab_size=VOCAB, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return LogitsOnly(transformers.GPT2LMHeadModel(cfg))


def tiny_llama(
    num_layers: int = 2, tie: bool = False, hidden: int = 64, intermediate: int = 128
) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
        max_position_embeddings=32, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return LogitsOnly(transformers.LlamaForCausalLM(cfg))


def tiny_ref_gpt(num_layers: int = 2, dim: int = 64, vocab: int = VOCAB) -> torch.nn.Module:
    """zerostack.testing's TinyGPT with a tied head and an unused parameter
    (no transformers needed: what the GPU tests train)."""
    from zerostack.testing import GPTConfig, TinyGPT

    cfg = GPTConfig(vocab_size=vocab, max_seq_len=256, num_layers=num_layers, dim=dim,
                    num_heads=4, tie_embeddings=True, add_unused_param=True)  # fmt: skip
    return TinyGPT(cfg)


def ref_batch(batch_size: int = 2, seq: int = 8, seed: int = 0) -> dict:
    """TinyGPT's input: ``idx``."""
    return {"idx": batch(batch_size, seq, seed)["input_ids"]}


def batch(batch_size: int = 2, seq: int = 8, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch_size, seq), generator=g)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids))


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy in fp32 (ColossalAI's GPTLMLoss)."""
    shift = logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(
        shift.reshape(-1, shift.size(-1)), input_ids[:, 1:].reshape(-1)
    )


def reference_losses(model, inputs, *, steps, dtype, device, clip, lr, weight_decay, scale=1.0,
                     sgd=False):  # fmt: skip
    """Plain training of a copy of ``model``: ``dtype`` compute on ``device``,
    fp32 masters stepped by torch's Adam in L2 mode, global-norm clipping.
    Returns the losses and the final masters (``model.parameters()`` order)."""
    import copy

    masters = [p.detach().clone().float() for p in model.parameters()]
    work = copy.deepcopy(model).to(device=device, dtype=dtype)
    params = list(work.parameters())
    cls = torch.optim.SGD if sgd else torch.optim.Adam
    opt = cls(masters, lr=lr, weight_decay=weight_decay)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    losses = []
    ids = next(iter(inputs.values()))
    for _ in range(steps):
        loss = lm_loss(work(**inputs), ids)
        (loss * scale).backward()
        grads = [None if p.grad is None else p.grad.float() / scale for p in params]
        norms = [torch.linalg.vector_norm(g) for g in grads if g is not None]
        norm = torch.linalg.vector_norm(torch.stack(norms))
        coef = min(1.0, clip / (float(norm) + 1e-6)) if clip > 0 else 1.0
        for m, g in zip(masters, grads, strict=True):
            m.grad = None if g is None else (g * coef).cpu()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(params, masters, strict=True):
                p.copy_(m)
                p.grad = None
        losses.append(float(loss.detach()))
    return losses, masters


def offload_losses(model, inputs, *, steps, precision, device, clip, lr, weight_decay, solver,
                   budget, profile, check=None, sgd=False, on_model_params=False,
                   torch_adam=False):  # fmt: skip
    """The same training through memory_optimize + AMPOptimizer + HybridAdam
    (torch's SGD with `sgd`, torch's Adam with `torch_adam`)."""
    from zerostack.auto_offload import AMPOptimizer, memory_optimize
    from zerostack.fused_adam import HybridAdam

    params = list(model.parameters())
    om = memory_optimize(model, inputs, budget, solver, precision=precision, profile=profile,
                         device=device)  # fmt: skip
    # ColossalAI built the optimizer on the model's parameters; AMPOptimizer swaps them
    targets = list(om.parameters()) if on_model_params else om.master_parameters()
    inner = (
        torch.optim.SGD(targets, lr=lr, weight_decay=weight_decay) if sgd
        else torch.optim.Adam(targets, lr=lr, weight_decay=weight_decay) if torch_adam
        else HybridAdam(targets, lr=lr, weight_decay=weight_decay, adamw_mode=False)
    )  # fmt: skip
    opt = AMPOptimizer(inner, om, clipping_norm=clip)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        out = om(**inputs)
        if check is not None:
            check("forward", om)
        loss = lm_loss(out, next(iter(inputs.values())).to(out.device))
        opt.backward(loss)
        if check is not None:
            check("backward", om)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, [om.master_of(p) for p in params], om, opt


def gpt2_2() -> torch.nn.Module:
    """The two-layer tiny GPT-2 most runtime tests train."""
    return tiny_gpt2(2)


@functools.cache
def halfway_budget(build, solver: str, make_inputs=None) -> float:
    """A budget halfway between no offload and the least plan, for ``build()``
    on ``make_inputs()`` (default ``batch(2, 8)``) in bf16: one trace per model
    and solver per session."""
    from zerostack.auto_offload import plan_offload

    inputs = batch(2, 8) if make_inputs is None else make_inputs()
    _, rm, _ = plan_offload(build(), inputs, -1, solver, precision="bf16", profile=fake_profile())
    free = rm.solver.best_ts.peak_mem
    least = rm.solver.least_memory_plan().peak_mem
    return (least + 0.5 * (free - least)) / 0.95
