"""Which torch optimizers can step flat pieces of the parameters.

[Note: optimizers over flat pieces] ZeroOptimizer steps each rank's flat
fp32 piece of every parameter, and GeminiOptimizer each chunk's flat shard,
which holds pieces of many parameters and keeps one optimizer state for all
of them. Element-wise optimizers whose state starts at zeros step those
pieces as torch steps the whole parameters: SGD, Adam, AdamW, NAdam, RAdam,
Adamax, RMSprop, Adadelta and fused-adam's (under Gemini the Adam-like ones
count steps per chunk, as ColossalAI's Gemini does). Others gave other
results, silently, and are refused where they are built:

- an optimizer that reads a parameter's shape: Adafactor factors its second
  moment over rows and columns and scales by the parameter's own RMS (7.3e-3
  off torch after four steps under ZeRO-2); LBFGS steps every parameter as
  one vector with line searches over closures; SparseAdam takes sparse
  gradients; Muon orthogonalizes 2-D matrices;
- Adagrad creates its state at construction, for the parameters it was
  built on: ZeroOptimizer refused it as "already has state", and
  GeminiOptimizer's state_dict() raised KeyError;
- under Gemini only, where one chunk's state stands for many parameters:
  Rprop starts each parameter's step sizes at ``lr`` (a parameter without a
  gradient at its chunk's first step got zeros: 1e-2 off torch), and ASGD
  keeps ``eta``, ``mu`` and its step as one number per parameter (its
  averages 3e-3 off torch after a parameter skipped steps).

Optimizers from other libraries are not known here and pass: element-wise
ones are exact; the guides say which are not.
"""

from __future__ import annotations

import torch

_SHAPED = {
    "Adafactor": "factors its second moment over a parameter's rows and columns and scales "
    "updates by the parameter's own RMS",
    "LBFGS": "steps every parameter as one vector with line searches over closures",
    "SparseAdam": "takes sparse gradients",
    "Muon": "orthogonalizes each 2-D parameter's update",
    "Adagrad": "creates its state at construction for the parameters it was built on",
}
_PER_PARAMETER = {
    "Rprop": "starts each parameter's step sizes at lr, which a parameter without a gradient "
    "at its chunk's first step would not get",
    "ASGD": "keeps eta, mu and its step count as one number per parameter",
}


def check_flat_optimizer(api: str, optimizer: torch.optim.Optimizer, chunks: bool) -> None:
    """Raise NotImplementedError for a torch optimizer that cannot step flat
    pieces (``chunks``: pieces of many parameters with one state, Gemini's);
    see [Note: optimizers over flat pieces]."""
    refused = {**_SHAPED, **(_PER_PARAMETER if chunks else {})}
    for name, why in refused.items():
        cls = getattr(torch.optim, name, None)
        if cls is not None and isinstance(optimizer, cls):
            where = "chunk shards holding many parameters" if chunks else "flat shards"
            raise NotImplementedError(
                f"{api}: torch.optim.{name} cannot step the {where} this optimizer steps (got "
                f"{type(optimizer).__name__}: it {why}); use an element-wise optimizer: "
                "HybridAdam, torch.optim.AdamW or Adam, SGD, RMSprop"
            )
