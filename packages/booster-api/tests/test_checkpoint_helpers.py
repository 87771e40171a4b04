"""Small ModelWrapper / OptimizerWrapper implementations for the checkpoint
tests (no tests here): a plain one for one rank or replicated ranks, and a
toy sharded one that keeps a piece of every parameter per rank and gathers."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerostack.booster._interface import ModelWrapper, OptimizerWrapper


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class PlainModel(ModelWrapper):
    """The module whole on every rank. ``share_memory`` returns the module's
    own tensors (tied names share memory), otherwise copies. Records every
    ``load_full_state_dict`` call's names in ``loads``."""

    def __init__(self, module: nn.Module, *, share_memory: bool = False) -> None:
        super().__init__(module)
        self.share_memory = share_memory
        self.loads: list[tuple[list[str], bool]] = []

    def unwrap(self) -> nn.Module:
        return self.module

    def full_state_dict(self, only_rank_0: bool = True) -> dict[str, torch.Tensor]:
        if only_rank_0 and _rank_world()[0] != 0:
            return {}
        state = self.module.state_dict()
        if self.share_memory:
            return {k: v.detach() for k, v in state.items()}
        return {k: v.detach().float().clone() for k, v in state.items()}

    def load_full_state_dict(
        self, state_dict: dict[str, torch.Tensor], strict: bool = True
    ) -> None:
        self.loads.append((sorted(state_dict), strict))
        self.module.load_state_dict(state_dict, strict=strict)


class ShardedModel(ModelWrapper):
    """Every parameter flattened, padded and cut into one piece per rank, as
    ZeRO does; ``full_state_dict`` all-gathers the pieces (to every rank, then
    drops them off rank 0 when ``only_rank_0``). The user's module keeps
    its names but empty parameters."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.rank, self.world = _rank_world()
        self.shapes: dict[str, torch.Size] = {}
        self.pieces: dict[str, torch.Tensor] = {}
        for name, tensor in module.state_dict().items():
            self.shapes[name] = tensor.shape
            self.pieces[name] = self._piece(tensor)
        for p in module.parameters():
            p.data = torch.empty(0)

    def _piece(self, tensor: torch.Tensor) -> torch.Tensor:
        flat = tensor.detach().float().reshape(-1)
        per = -(-flat.numel() // self.world)
        flat = torch.cat([flat, flat.new_zeros(per * self.world - flat.numel())])
        return flat[self.rank * per : (self.rank + 1) * per].clone()

    def unwrap(self) -> nn.Module:
        return self.module

    def full_state_dict(self, only_rank_0: bool = True) -> dict[str, torch.Tensor]:
        out = {}
        for name, piece in self.pieces.items():
            parts = [torch.empty_like(piece) for _ in range(self.world)]
            dist.all_gather(parts, piece)
            numel = self.shapes[name].numel()
            out[name] = torch.cat(parts)[:numel].reshape(self.shapes[name])
        if only_rank_0 and self.rank != 0:
            return {}
        return out

    def load_full_state_dict(
        self, state_dict: dict[str, torch.Tensor], strict: bool = True
    ) -> None:
        if strict and set(state_dict) != set(self.pieces):
            raise AssertionError(f"strict load of {sorted(state_dict)}")
        for name, tensor in state_dict.items():
            self.pieces[name] = self._piece(tensor)


class PlainOptimizer(OptimizerWrapper):
    """A torch optimizer over a module's parameters, its state keyed by name in
    the [Note: full state format]."""

    def __init__(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
        super().__init__(optimizer)
        ids = {id(p): n for n, p in module.named_parameters()}
        self.names = [ids[id(p)] for g in optimizer.param_groups for p in g["params"]]
        self.loss_scaler: dict[str, Any] | None = {"scale": 1024.0, "growth_tracker": 3}

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def full_state_dict(self) -> dict[str, Any]:
        sd = self.optim.state_dict()
        return {
            "state": {self.names[i]: dict(s) for i, s in sd["state"].items()},
            "param_groups": [
                {**g, "params": [self.names[i] for i in g["params"]]} for g in sd["param_groups"]
            ],
            "loss_scaler": self.loss_scaler,
        }

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        index = {n: i for i, n in enumerate(self.names)}
        self.optim.load_state_dict(
            {
                "state": {index[n]: s for n, s in state_dict["state"].items()},
                "param_groups": [
                    {**g, "params": [index[n] for n in g["params"]]}
                    for g in state_dict["param_groups"]
                ],
            }
        )
        self.loss_scaler = state_dict["loss_scaler"]


def mlp(seed: int, width: int = 512, depth: int = 3) -> nn.Module:
    """``depth`` Linear(width, width): 1 MB of fp32 weight each at width 512."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def train(model: nn.Module, optimizer: OptimizerWrapper, steps: int, width: int = 512) -> None:
    for step in range(steps):
        torch.manual_seed(100 + step)
        loss = model(torch.randn(4, width)).square().mean()
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def same(a: Any, b: Any, where: str = "") -> None:
    """Exact equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: {a.keys()} != {b.keys()}"
        for k in a:
            same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
