"""GeminiDDP + GeminiOptimizer on a Hugging Face transformers GPT-2 (built from a
config, tied wte/lm_head): parity with DDP + torch optimizers step by step
(gloo), and LazyInitContext construction."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.chunk import LazyInitContext
from zerostack.fused_adam import HybridAdam
from zerostack.gemini import GeminiDDP, GeminiOptimizer
from zerostack.testing import spawn

# The nox unit session installs it (noxfile.py, TEST_REQUIREMENTS).
transformers = pytest.importorskip("transformers")

VOCAB = 128
DIM = 64
STEPS = 6
LR = 1e-3
# Small chunks, so that this 0.1M-parameter model spans several of them.
CHUNKS = {"chunk_size": 20_000, "keep_gathered": False}
# (id, mixed_precision, adamw_mode, offload_optim_frac, activation checkpointing)
# Adam in L2 mode too: Adam(W) hides a gradient-scale bug, weight decay in the
# gradient does not.
CASES = [
    ("fp32-zero3", torch.float32, True, 0.0, False),
    ("bf16-offload-optim", torch.bfloat16, True, 1.0, False),
    ("fp32-l2-checkpointing", torch.float32, False, 0.0, True),
]
# bf16: the masters start from bf16-rounded weights and an element whose
# gradient changes sign moves 2 lr the other way; seen: 4e-3 (params), 2e-4 (loss).
TOL = {torch.float32: dict(rtol=1e-5, atol=5e-6), torch.bfloat16: dict(rtol=0, atol=1e-2)}


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=DIM,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return transformers.GPT2LMHeadModel(config)


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(seed))


def _assert_params_close(full, ref_model, tol, name, step):
    for pname, b in ref_model.named_parameters():
        a, b = full[pname], b.detach()
        if pname.endswith("attn.c_attn.bias"):
            # The key bias (the middle third) shifts every score of a query row
            # alike, which softmax ignores: its true gradient is zero and the
            # computed one rounding noise (~1e-11), which Adam turns into steps
            # of up to ~lr whose sign depends on the last bit. Bound it by that;
            # the query and value biases stay exact.
            key = slice(DIM, 2 * DIM)
            drift = (a[key] - b[key]).abs().max().item()
            assert drift <= 3 * LR * (step + 1), (
                f"{name} step {step} {pname}: key bias drift {drift}"
            )
            a, b = torch.cat([a[:DIM], a[2 * DIM :]]), torch.cat([b[:DIM], b[2 * DIM :]])
        torch.testing.assert_close(
            a, b, **tol, msg=lambda m, p=pname: f"{name} step {step} {p}: {m}"
        )


def _run_case(rank, world, case):
    name, dtype, adamw, optim_frac, checkpointing = case
    torch.manual_seed(0)
    ref_model = _gpt2()
    if checkpointing:
        ref_model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    model = copy.deepcopy(ref_model)
    assert model.lm_head.weight is model.transformer.wte.weight
    ref = DDP(ref_model)
    ref_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref_opt = ref_cls(ref.parameters(), lr=LR, weight_decay=0.1, foreach=False)
    ddp = GeminiDDP(
        model,
        mixed_precision=dtype,
        shard_param_frac=1.0,
        offload_optim_frac=optim_frac,
        chunk_config_dict={world: CHUNKS},
        compute_device="cpu",
    )
    opt = GeminiOptimizer(
        HybridAdam(model.parameters(), lr=LR, weight_decay=0.1, adamw_mode=adamw), ddp
    )
    # The tie survives wrapping, is registered once, and has both names in the state dict.
    assert model.lm_head.weight is model.transformer.wte.weight
    assert len(ddp.params) == len(list(ref.module.parameters()))
    assert len(ddp.chunk_manager.chunks("fp16_param")) > 3
    full = ddp.state_dict()
    assert list(full) == list(ref.module.state_dict())
    assert full["lm_head.weight"] is full["transformer.wte.weight"]
    for step in range(STEPS):
        idx = _batch(100 * step + rank)
        ref_loss = ref(idx, labels=idx).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        loss = ddp(idx, labels=idx).loss
        opt.backward(loss.float())
        assert opt.step()
        torch.testing.assert_close(
            loss.float(), ref_loss, **TOL[dtype], msg=lambda m, s=step: f"{name} step {s} loss: {m}"
        )
        _assert_params_close(ddp.state_dict(), ref.module, TOL[dtype], name, step)


def _all(rank, world, cases):
    for case in cases:
        _run_case(rank, world, case)


@pytest.mark.parametrize("world_size", [1, 2])
def test_gpt2_parity_with_ddp(world_size):
    spawn(_all, world_size, args=(CASES,), backend="gloo", timeout_s=120)


# GPT-2's construction is not its modules' reset_parameters: Conv1D draws in
# __init__ and post_init draws every weight again (c_proj scaled). LazyInitContext
# replays all of it, so the lazy model equals the eager one without an init_fn.
def test_gpt2_lazy_init_equals_eager_construction():
    torch.manual_seed(0)
    with LazyInitContext():
        lazy = _gpt2()
    assert all(p.is_meta for p in lazy.parameters())
    ddp = GeminiDDP(
        lazy, mixed_precision=torch.float32, chunk_config_dict={1: CHUNKS}, compute_device="cpu"
    )
    assert lazy.lm_head.weight is lazy.transformer.wte.weight
    torch.manual_seed(0)
    eager = _gpt2()
    full = ddp.state_dict()
    assert list(full) == list(eager.state_dict())
    for name, p in eager.named_parameters():
        assert torch.equal(full[name], p.detach()), name


def test_gpt2_state_dict_round_trips_with_the_plain_model():
    torch.manual_seed(0)
    ddp = GeminiDDP(
        _gpt2(), mixed_precision=torch.float32, chunk_config_dict={1: CHUNKS}, compute_device="cpu"
    )
    torch.manual_seed(1)
    plain = _gpt2()
    ddp.load_state_dict(plain.state_dict())
    full = ddp.state_dict()
    assert list(full) == list(plain.state_dict())
    fresh = _gpt2()
    fresh.load_state_dict(full)  # strict
    for name, p in plain.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], p), name
