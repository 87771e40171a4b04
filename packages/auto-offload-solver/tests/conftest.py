"""Shared fixtures: a profile given as a dict, tiny transformers models."""

from __future__ import annotations

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


@pytest.fixture
def profile() -> HardwareProfile:
    return fake_profile()


class LogitsOnly(torch.nn.Module):
    """A transformers causal LM returning only its logits (the seed's GPTLMModel)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def tiny_gpt2(num_layers: int = 3) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_embd=64, n_layer=num_layers, n_head=4, vocab_size=VOCAB, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return LogitsOnly(transformers.GPT2LMHeadModel(cfg))


def tiny_llama(num_layers: int = 2, tie: bool = False) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
        max_position_embeddings=32, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return LogitsOnly(transformers.LlamaForCausalLM(cfg))


def batch(batch_size: int = 2, seq: int = 8, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch_size, seq), generator=g)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids))
