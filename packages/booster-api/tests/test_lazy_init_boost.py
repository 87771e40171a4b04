"""A model built under LazyInitContext and boosted, as ColossalAI's GPT-2
Booster demo does: every plugin materializes it with the values an eager
build has (bitwise, read back through ``full_state_dict``), at 1 and 2 ranks
(gloo), and it trains; ColoInitContext builds eagerly on its device."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from zerostack.booster import (
    Booster,
    ColoInitContext,
    GeminiPlugin,
    LazyInitContext,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
)
from zerostack.testing import spawn

VOCAB, DIM, SEQ = 128, 64, 16


class Head(nn.Module):
    """No reset_parameters; its values are computed in __init__."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(VOCAB) * 0.02 + 1.0)
        self.register_buffer("pos", torch.arange(SEQ))
        mask = torch.tril(torch.ones(SEQ, SEQ)).bool()
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits * self.gain


class Model(nn.Module):
    """A plain module around a transformers GPT2LMHeadModel (lm_head tied to
    wte), or around an embedding where transformers is missing."""

    def __init__(self, with_transformers: bool) -> None:
        super().__init__()
        if with_transformers:
            import transformers

            config = transformers.GPT2Config(
                n_layer=2, n_embd=DIM, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                bos_token_id=0, eos_token_id=0, use_cache=False,
            )  # fmt: skip
            self.body = transformers.GPT2LMHeadModel(config)
        else:
            self.body = nn.Embedding(VOCAB, VOCAB)
        self.head = Head()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.body(ids)
        logits = out.logits if hasattr(out, "logits") else out
        return self.head(logits).float().logsumexp(-1).mean()


def _plugin(name: str):
    if name == "gemini":
        return GeminiPlugin(precision="fp32", chunk_config_dict=None, search_range_m=1)
    if name == "zero":
        return LowLevelZeroPlugin(precision="fp32")
    return TorchDDPPlugin()


def _boost_lazy(rank: int, world: int, plugin: str, with_transformers: bool) -> None:
    torch.manual_seed(0)
    with LazyInitContext(default_device=torch.device("cpu")):
        lazy = Model(with_transformers)
    assert all(p.is_meta for p in lazy.parameters())
    opt = torch.optim.SGD(lazy.parameters(), lr=0.1)  # torch's optimizers take meta params
    booster = Booster(plugin=_plugin(plugin))
    model, opt, *_ = booster.boost(lazy, opt)
    torch.manual_seed(0)
    eager = Model(with_transformers)
    full = model.full_state_dict(only_rank_0=False)
    want = eager.state_dict()
    assert sorted(full) == sorted(want)  # gemini lists buffers after every parameter
    for name, value in want.items():
        assert torch.equal(full[name].cpu(), value), f"{plugin}: rank {rank}: {name}"
    if with_transformers:
        assert lazy.body.lm_head.weight is lazy.body.transformer.wte.weight
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(rank))
    booster.backward(model(ids), opt)
    opt.step()
    after = model.full_state_dict(only_rank_0=False)
    assert not torch.equal(after["head.gain"].cpu(), want["head.gain"])  # it trained


def _all(rank: int, world: int, with_transformers: bool) -> None:
    for plugin in ("gemini", "zero", "ddp"):
        _boost_lazy(rank, world, plugin, with_transformers)


@pytest.mark.parametrize("world", [1, 2])
def test_a_lazy_model_boosts_to_its_eager_values(world):
    with_transformers = importlib.util.find_spec("transformers") is not None
    spawn(_all, world, args=(with_transformers,), backend="gloo", timeout_s=180)


def test_colo_init_context_builds_on_its_device_in_its_dtype():
    torch.manual_seed(0)
    with ColoInitContext(device=torch.device("cpu"), dtype=torch.float64):
        model = Model(False)
    torch.manual_seed(0)
    ref = Model(False)
    params = dict(model.named_parameters())
    assert list(params) == ["body.weight", "head.gain"]
    for (n, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items(), strict=True):
        assert a.device == torch.device("cpu"), n
        assert a.dtype == (torch.float64 if n in params else b.dtype), n  # buffers keep theirs
        assert torch.equal(a, b.to(a.dtype)), n
