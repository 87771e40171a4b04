"""TinyGPT, GPTConfig and make_batch."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from zerostack.testing import GPTConfig, TinyGPT, make_batch, num_parameters


def _seeded(config: GPTConfig, seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(config)


def test_logits_and_loss_shapes() -> None:
    config = GPTConfig()
    model = _seeded(config)
    idx, targets = make_batch(config, 3, 10, seed=0)
    assert model(idx).shape == (3, 10, config.vocab_size)
    loss = model(idx, targets)
    assert loss.shape == ()
    assert loss.dtype == torch.float32


def test_initial_loss_is_near_uniform() -> None:
    config = GPTConfig()
    idx, targets = make_batch(config, 4, 32, seed=0)
    loss = _seeded(config)(idx, targets).item()
    assert math.isfinite(loss)
    # std-0.02 weights give near-uniform logits; torch's default init would give ~ +0.2.
    assert abs(loss - math.log(config.vocab_size)) < 0.05, loss


def test_init_is_deterministic_under_the_global_seed() -> None:
    config = GPTConfig(add_unused_param=True)
    a, b, c = _seeded(config, 0), _seeded(config, 0), _seeded(config, 1)
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if pa.dim() > 1 or name.endswith("emb.weight"):
            assert not torch.equal(pa, pc), name


def test_init_statistics() -> None:
    model = _seeded(GPTConfig(dim=128))
    fc = model.blocks[0].mlp.fc
    assert abs(fc.weight.std().item() - 0.02) < 0.001
    assert torch.count_nonzero(fc.bias) == 0
    assert torch.equal(model.ln_f.weight, torch.ones(128))
    assert torch.count_nonzero(model.ln_f.bias) == 0


def test_meta_build_then_reset_matches_a_cpu_build() -> None:
    config = GPTConfig(tie_embeddings=True)
    with torch.device("meta"):
        meta = TinyGPT(config)
    meta.to_empty(device="cpu")
    torch.manual_seed(7)
    meta.reset_parameters()
    cpu = _seeded(config, 7)
    for (name, pm), pc in zip(meta.named_parameters(), cpu.parameters(), strict=True):
        assert torch.equal(pm, pc), name
    assert meta.lm_head.weight is meta.tok_emb.weight


def test_attention_is_causal() -> None:
    config = GPTConfig()
    model = _seeded(config)
    idx, _ = make_batch(config, 2, 16, seed=0)
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % config.vocab_size
    before, after = model(idx), model(changed)
    assert torch.equal(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_unused_param_exists_and_gets_no_grad() -> None:
    config = GPTConfig(add_unused_param=True)
    model = _seeded(config)
    idx, targets = make_batch(config, 2, 8, seed=0)
    model(idx, targets).backward()
    assert model.unused.weight.grad is None and model.unused.bias.grad is None
    used = [name for name, p in model.named_parameters() if p.grad is not None]
    assert len(used) == len(list(model.parameters())) - 2
    assert not hasattr(_seeded(GPTConfig()), "unused")


def test_tied_embeddings_share_one_parameter() -> None:
    untied = num_parameters(_seeded(GPTConfig()))
    tied_model = _seeded(GPTConfig(tie_embeddings=True))
    assert tied_model.lm_head.weight is tied_model.tok_emb.weight
    assert num_parameters(tied_model) == untied - 256 * 64


def test_bias_false_removes_every_bias() -> None:
    names = [name for name, _ in _seeded(GPTConfig(bias=False)).named_parameters()]
    assert not [name for name in names if name.endswith("bias")]
    with_bias = [name for name, _ in _seeded(GPTConfig()).named_parameters()]
    assert "lm_head.bias" not in with_bias and "blocks.0.attn.qkv.bias" in with_bias


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        # Hugging Face's GPT-2 checkpoints have exactly these sizes.
        (GPTConfig.gpt2_small, 124_439_808),
        (GPTConfig.gpt2_medium, 354_823_168),
        (GPTConfig.gpt2_large, 774_030_080),
        (GPTConfig.gpt2_xl, 1_557_611_200),
    ],
)
def test_gpt2_presets_have_gpt2_parameter_counts(preset, expected) -> None:
    with torch.device("meta"):
        model = TinyGPT(preset())
    assert num_parameters(model) == expected


def test_presets_take_overrides() -> None:
    config = GPTConfig.gpt2_small(max_seq_len=256, num_layers=2)
    assert (config.max_seq_len, config.num_layers, config.dim) == (256, 2, 768)
    with pytest.raises(ValueError, match=r"GPTConfig: dim must be divisible by num_heads"):
        GPTConfig.gpt2_xl(num_heads=3)


def test_adam_steps_reduce_the_loss_on_a_fixed_batch() -> None:
    config = GPTConfig()
    model = _seeded(config)
    idx, targets = make_batch(config, 4, 32, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = model(idx, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_dropout_is_random_in_train_mode_only() -> None:
    config = GPTConfig(dropout=0.5)
    model = _seeded(config)
    idx, _ = make_batch(config, 2, 8, seed=0)
    assert not torch.equal(model(idx), model(idx))
    model.eval()
    assert torch.equal(model(idx), model(idx))


def test_bf16_model_returns_a_float32_loss() -> None:
    config = GPTConfig()
    model = _seeded(config).to(torch.bfloat16)
    idx, targets = make_batch(config, 2, 8, seed=0)
    assert model(idx).dtype == torch.bfloat16
    loss = model(idx, targets)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - math.log(config.vocab_size)) < 0.1


def test_make_batch_is_deterministic_and_shifted() -> None:
    config = GPTConfig(vocab_size=50)
    idx, targets = make_batch(config, 3, 20, seed=5)
    again, _ = make_batch(config, 3, 20, seed=5)
    other, _ = make_batch(config, 3, 20, seed=6)
    assert idx.dtype == targets.dtype == torch.long
    assert idx.shape == targets.shape == (3, 20)
    assert torch.equal(idx, again) and not torch.equal(idx, other)
    assert torch.equal(idx[:, 1:], targets[:, :-1])
    assert int(idx.min()) >= 0 and int(idx.max()) < 50
    # The global RNG is left alone.
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    make_batch(config, 3, 20, seed=5)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"vocab_size": 0}, r"GPTConfig: vocab_size must be an int >= 1 \(got 0\)"),
        ({"max_seq_len": 8.0}, r"GPTConfig: max_seq_len must be an int >= 1 \(got 8\.0\)"),
        ({"num_layers": -1}, r"GPTConfig: num_layers must be an int >= 0 \(got -1\)"),
        ({"dim": True}, r"GPTConfig: dim must be an int >= 1 \(got True\)"),
        ({"mlp_ratio": 0}, r"GPTConfig: mlp_ratio must be an int >= 1 \(got 0\)"),
        (
            {"dim": 64, "num_heads": 5},
            r"GPTConfig: dim must be divisible by num_heads \(got dim=64, num_heads=5\); "
            r"pick num_heads that divides dim",
        ),
        ({"dropout": 1.0}, r"GPTConfig: dropout must be in \[0, 1\) \(got 1\.0\)"),
        ({"dropout": -0.1}, r"GPTConfig: dropout must be in \[0, 1\) \(got -0\.1\)"),
    ],
)
def test_config_validation_messages(fields, match) -> None:
    with pytest.raises(ValueError, match=match):
        GPTConfig(**fields)


def test_config_is_frozen_and_keyword_only() -> None:
    config = GPTConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.dim = 32  # type: ignore[misc]
    with pytest.raises(TypeError):
        GPTConfig(256)  # type: ignore[misc]
    assert config.head_dim == 16


def test_forward_and_make_batch_validate_their_inputs() -> None:
    config = GPTConfig(max_seq_len=8)
    model = _seeded(config)
    with pytest.raises(
        ValueError, match=r"TinyGPT.forward: sequence longer than max_seq_len \(got 9 > 8\)"
    ):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"TinyGPT.forward: idx must be a 2-D long tensor"):
        model(torch.zeros(4, dtype=torch.long))
    idx, targets = make_batch(config, 2, 8, seed=0)
    with pytest.raises(ValueError, match=r"TinyGPT.forward: targets must have the shape of idx"):
        model(idx, targets[:, :4])
    with pytest.raises(
        ValueError, match=r"make_batch: seq_len must be in \[1, max_seq_len=8\] \(got 9\)"
    ):
        make_batch(config, 2, 9, seed=0)
    with pytest.raises(
        ValueError, match=r"make_batch: batch_size must be a positive int \(got 0\)"
    ):
        make_batch(config, 0, 8, seed=0)
    with pytest.raises(TypeError, match=r"TinyGPT: config must be a GPTConfig \(got dict\)"):
        TinyGPT({"dim": 64})  # type: ignore[arg-type]
