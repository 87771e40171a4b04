"""The model of the examples here: a Hugging Face transformers GPT-2
(``GPT2LMHeadModel``) built from a ``GPT2Config``, the model users train, at
whatever size a script asks for. Needs ``pip install transformers``
(the examples were run with transformers 5.24.0).

Imported by the scripts next to it (``python examples/<script>.py`` puts
this folder on ``sys.path``); not a script of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError as error:
    raise SystemExit("the examples train transformers' GPT-2: pip install transformers") from error


def gpt2(
    *, layers: int, dim: int, heads: int, seq_len: int, vocab: int = 50257,
    checkpointing: bool = False,
) -> GPT2LMHeadModel:  # fmt: skip
    """A freshly initialised GPT-2 (tied embeddings, as GPT-2) of ``layers``
    blocks of width ``dim`` with ``heads`` attention heads, ``seq_len``
    positions and a ``vocab``-token vocabulary (50257 is GPT-2's, 256 one per
    byte). No dropout and no KV cache: the examples compare losses between
    runs and only train. With ``checkpointing``, every block is activation
    checkpointed (transformers' non-reentrant checkpointing)."""
    config = GPT2Config(
        n_layer=layers, n_embd=dim, n_head=heads, n_positions=seq_len, vocab_size=vocab,
        # GPT-2's special token (50256) lies outside a smaller vocabulary.
        bos_token_id=vocab - 1, eos_token_id=vocab - 1,
        use_cache=False, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
        # GPT-2's GELU (the tanh approximation, "gelu_new") as torch's one fused
        # kernel: gelu_new's elementwise ops made a CPU step of the main job's
        # model about 1.4x as long.
        activation_function="gelu_pytorch_tanh",
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    if checkpointing:
        kwargs = {"use_reentrant": False}
        # activation_checkpointing_enable in transformers >= 5 (the old name warns there).
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (batch, seq, vocab) against
    ``targets`` (batch, seq), the tokens that follow each input position;
    computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
