"""A tiny GPT-2-like reference model for tests, benchmarks and examples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"GPTConfig: {name} must be an int >= {minimum} (got {value!r}); "
            f"pass an int of at least {minimum}"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    """Shape of a :class:`TinyGPT`. The defaults build a 137K-parameter model.

    The GPT-2 sizes are presets: ``GPTConfig.gpt2_small()`` and friends, each
    taking field overrides, e.g. ``GPTConfig.gpt2_small(max_seq_len=256)``.
    """

    vocab_size: int = 256
    """Number of token ids. Default 256."""

    max_seq_len: int = 64
    """Longest sequence; sizes the learned position embedding. Default 64."""

    num_layers: int = 2
    """Number of transformer blocks. Default 2."""

    dim: int = 64
    """Width of the residual stream. Default 64."""

    num_heads: int = 4
    """Attention heads; must divide ``dim``. Default 4."""

    mlp_ratio: int = 4
    """MLP hidden width is ``mlp_ratio * dim``. Default 4."""

    dropout: float = 0.0
    """Dropout on embeddings, attention and residuals, in [0, 1). Default 0.0."""

    tie_embeddings: bool = False
    """Share the token embedding with the LM head, as GPT-2 does. Default False."""

    add_unused_param: bool = False
    """Add a Linear (``model.unused``) that forward never touches, for tests of
    parameters that get no gradient. Default False."""

    bias: bool = True
    """Biases in the blocks' Linear and LayerNorm layers and the final LayerNorm
    (the LM head never has one, as in GPT-2). Default True."""

    def __post_init__(self) -> None:
        _check_int("vocab_size", self.vocab_size, 1)
        _check_int("max_seq_len", self.max_seq_len, 1)
        _check_int("num_layers", self.num_layers, 0)
        _check_int("dim", self.dim, 1)
        _check_int("num_heads", self.num_heads, 1)
        _check_int("mlp_ratio", self.mlp_ratio, 1)
        if self.dim % self.num_heads:
            raise ValueError(
                f"GPTConfig: dim must be divisible by num_heads (got dim={self.dim}, "
                f"num_heads={self.num_heads}); pick num_heads that divides dim"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(
                f"GPTConfig: dropout must be in [0, 1) (got {self.dropout!r}); "
                "pass 0.0 for deterministic tests"
            )

    @property
    def head_dim(self) -> int:
        """``dim // num_heads``."""
        return self.dim // self.num_heads

    @classmethod
    def gpt2_small(cls, **overrides: object) -> GPTConfig:
        """GPT-2 small, 124M parameters (12 layers, dim 768, 12 heads)."""
        return cls._gpt2(dict(num_layers=12, dim=768, num_heads=12), overrides)

    @classmethod
    def gpt2_medium(cls, **overrides: object) -> GPTConfig:
        """GPT-2 medium, 355M parameters (24 layers, dim 1024, 16 heads)."""
        return cls._gpt2(dict(num_layers=24, dim=1024, num_heads=16), overrides)

    @classmethod
    def gpt2_large(cls, **overrides: object) -> GPTConfig:
        """GPT-2 large, 774M parameters (36 layers, dim 1280, 20 heads)."""
        return cls._gpt2(dict(num_layers=36, dim=1280, num_heads=20), overrides)

    @classmethod
    def gpt2_xl(cls, **overrides: object) -> GPTConfig:
        """GPT-2 XL, 1.56B parameters (48 layers, dim 1600, 25 heads)."""
        return cls._gpt2(dict(num_layers=48, dim=1600, num_heads=25), overrides)

    @classmethod
    def _gpt2(cls, shape: dict[str, Any], overrides: dict[str, Any]) -> GPTConfig:
        fields = {"vocab_size": 50257, "max_seq_len": 1024, "tie_embeddings": True, **shape}
        return cls(**{**fields, **overrides})


class _CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=config.bias)
        self.proj = nn.Linear(config.dim, config.dim, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=2)
        q, k, v = (t.view(batch, seq, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(batch, seq, dim)
        return self.resid_drop(self.proj(y))


class _MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.dim
        self.fc = nn.Linear(config.dim, hidden, bias=config.bias)
        self.proj = nn.Linear(hidden, config.dim, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class _Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.dim, bias=config.bias)
        self.attn = _CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.dim, bias=config.bias)
        self.mlp = _MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A GPT-2-like decoder: token and learned position embeddings, pre-LN blocks
    (causal self-attention through ``scaled_dot_product_attention``, GELU MLP),
    a final LayerNorm and an LM head.

    Weights are drawn from torch's global RNG, so ``torch.manual_seed(s)`` before
    construction makes them reproducible: Linear and Embedding weights
    ``normal(0, 0.02)``, biases zero, LayerNorm weights one. Construction draws
    exactly what :meth:`reset_parameters` draws, so a model built under
    ``with torch.device("meta"):`` and materialized with
    ``model.to_empty(device="cpu")``, ``torch.manual_seed(s)``,
    ``model.reset_parameters()`` equals one built on the CPU after
    ``torch.manual_seed(s)``.

    Submodules: ``tok_emb``, ``pos_emb``, ``blocks[i]`` (``ln_1``, ``attn.qkv``,
    ``attn.proj``, ``ln_2``, ``mlp.fc``, ``mlp.proj``), ``ln_f``, ``lm_head``,
    and ``unused`` when ``config.add_unused_param``.

    Args:
        config: the model's shape. Default ``GPTConfig()``.
    """

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        config = GPTConfig() if config is None else config
        if not isinstance(config, GPTConfig):
            raise TypeError(
                f"TinyGPT: config must be a GPTConfig (got {type(config).__name__}); "
                "pass GPTConfig(...)"
            )
        self.config = config
        # The layers' own default init draws from the RNG too; undo that, so that
        # construction draws exactly what reset_parameters() draws.
        with torch.random.fork_rng(devices=[]):
            self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
            self.pos_emb = nn.Embedding(config.max_seq_len, config.dim)
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(_Block(config) for _ in range(config.num_layers))
            self.ln_f = nn.LayerNorm(config.dim, bias=config.bias)
            self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
            if config.tie_embeddings:
                self.lm_head.weight = self.tok_emb.weight
            if config.add_unused_param:
                self.unused = nn.Linear(config.dim, config.dim, bias=config.bias)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-draw every weight from torch's global RNG, in module order.

        With ``tie_embeddings`` it first re-ties the LM head to the token
        embedding, which ``to_empty()`` un-ties.
        """
        if self.config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                bias = getattr(module, "bias", None)  # nn.Embedding has none
                if bias is not None:
                    nn.init.zeros_(bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits, or the mean cross-entropy against ``targets``.

        Args:
            idx: token ids, shape ``(batch, seq)`` with ``seq <= max_seq_len``.
            targets: next-token ids, the shape of ``idx``. Default None.

        Returns:
            Logits ``(batch, seq, vocab_size)`` in the model's dtype when
            ``targets`` is None, else the scalar mean loss (computed in float32
            or wider).

        Raises:
            ValueError: ``idx`` or ``targets`` has the wrong shape or dtype.
        """
        if idx.dim() != 2 or idx.dtype != torch.long:
            raise ValueError(
                f"TinyGPT.forward: idx must be a 2-D long tensor (got shape "
                f"{tuple(idx.shape)}, dtype {idx.dtype}); pass (batch, seq) token ids"
            )
        seq = idx.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(
                f"TinyGPT.forward: sequence longer than max_seq_len (got {seq} > "
                f"{self.config.max_seq_len}); shorten it or raise GPTConfig.max_seq_len"
            )
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        if targets.shape != idx.shape:
            raise ValueError(
                f"TinyGPT.forward: targets must have the shape of idx (got "
                f"{tuple(targets.shape)} vs {tuple(idx.shape)}); pass one target per token"
            )
        logits = logits.flatten(0, 1)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return F.cross_entropy(logits, targets.flatten())


def num_parameters(model: nn.Module) -> int:
    """Number of parameter elements of ``model``, shared (tied) parameters once.

    Works on meta-device models.

    Args:
        model: any module.

    Returns:
        The total ``numel`` of ``model.parameters()``.
    """
    return sum(p.numel() for p in model.parameters())


def make_batch(
    config: GPTConfig,
    batch_size: int,
    seq_len: int,
    *,
    seed: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random next-token batch that depends only on ``seed``.

    Drawn on the CPU from a private ``torch.Generator`` (the global RNG is left
    alone), then moved, so every device gets the same ids. Use ``seed=base + rank``
    for rank-dependent inputs.

    Args:
        config: gives ``vocab_size`` and the ``max_seq_len`` bound.
        batch_size: rows, >= 1.
        seq_len: tokens per row, in [1, max_seq_len].
        seed: the generator's seed.
        device: where the tensors go. Default "cpu".

    Returns:
        ``(idx, targets)``, long tensors of shape ``(batch_size, seq_len)``;
        ``targets`` is ``idx`` shifted left by one token.

    Raises:
        ValueError: ``batch_size`` or ``seq_len`` is out of range.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"make_batch: batch_size must be a positive int (got {batch_size!r}); pass 1 or more"
        )
    if (
        isinstance(seq_len, bool)
        or not isinstance(seq_len, int)
        or not 1 <= seq_len <= config.max_seq_len
    ):
        raise ValueError(
            f"make_batch: seq_len must be in [1, max_seq_len={config.max_seq_len}] "
            f"(got {seq_len!r}); shorten it or raise GPTConfig.max_seq_len"
        )
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)
