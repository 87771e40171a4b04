"""A user's training script over zerostack's public API, for mypy: the
`lint` session type-checks it against the packages' annotations (their
py.typed), so that a signature or return type a user's type checker would
reject fails here. It is never run (it would need a process group, a GPU
and checkpoints on disk); its calls are the ones the docs show.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zerostack.auto_offload import (
    NOT_NVML,
    AMPOptimizer,
    BaseOffloadModule,
    HardwareProfile,
    MemoryBudgetError,
    memory_optimize,
    parameter_size,
)
from zerostack.booster import (
    AutoOffloadPlugin,
    Booster,
    GeminiPlugin,
    LazyInitContext,
    LowLevelZeroPlugin,
    ModelWrapper,
    OptimizerWrapper,
    Plugin,
    TorchDDPPlugin,
    launch,
    launch_from_torch,
)
from zerostack.chunk import search_chunk_configuration
from zerostack.fused_adam import CPUAdam, FusedAdam, HybridAdam
from zerostack.gemini import GeminiAdamOptimizer, GeminiDDP, GeminiOptimizer
from zerostack.shard import DynamicLossScaler, ZeroOptimizer


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def plugins() -> list[Plugin]:
    return [
        TorchDDPPlugin(bucket_cap_mb=25, find_unused_parameters=False),
        LowLevelZeroPlugin(stage=2, precision="bf16", max_norm=1.0, cpu_offload=True),
        GeminiPlugin(placement_policy="static", offload_optim_frac=1.0, precision="bf16"),
        GeminiPlugin(placement_policy="auto", gpu_capacity_bytes=1 << 30, max_prefetch=2),
        AutoOffloadPlugin(memory_budget=16, solver_name="asyn", precision="bf16"),
    ]


def train_with(plugin: Plugin, steps: int, path: str) -> float:
    """The Booster loop of the docs, with every plugin."""
    model = build_model()
    optimizer = HybridAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    data = TensorDataset(torch.randn(64, 16), torch.randn(64, 16))
    loader = DataLoader(data, batch_size=8)
    booster = Booster(plugin=plugin)
    boosted, boosted_optim, criterion, loader, scheduler = booster.boost(
        model, optimizer, nn.MSELoss(), loader, scheduler
    )
    wrapped: ModelWrapper = boosted
    user_module: nn.Module = wrapped.unwrap()
    loss = torch.zeros(())
    for x, y in loader:
        loss = criterion(boosted(x), y)
        booster.backward(loss, boosted_optim)
        boosted_optim.step()
        boosted_optim.zero_grad()
        scheduler.step()
    with booster.no_sync(boosted, boosted_optim):
        booster.backward(criterion(boosted(x), y), boosted_optim)
    booster.save_model(boosted, f"{path}/model", shard=True, size_per_shard=1024)
    booster.save_optimizer(boosted_optim, f"{path}/optimizer", shard=True)
    booster.save_lr_scheduler(scheduler, f"{path}/scheduler")
    booster.load_model(boosted, f"{path}/model", strict=False)
    booster.load_optimizer(boosted_optim, f"{path}/optimizer")
    booster.load_lr_scheduler(scheduler, f"{path}/scheduler")
    assert sum(p.numel() for p in user_module.parameters()) > 0
    return float(loss)


def boost_without_a_criterion() -> OptimizerWrapper:
    booster = Booster(device="cpu", mixed_precision="bf16")
    model = build_model()
    boosted, optimizer, *_ = booster.boost(model, CPUAdam(model.parameters(), lr=1e-3))
    booster.backward(boosted(torch.randn(2, 16)).sum(), optimizer)
    return optimizer


def lazy_init() -> nn.Module:
    with LazyInitContext():
        return build_model()


def gemini_directly(steps: int) -> bool:
    model = build_model()
    ddp = GeminiDDP(model, placement_policy="static", shard_param_frac=1.0, pin_memory=False)
    optimizer = GeminiOptimizer(HybridAdam(model.parameters(), lr=1e-3), ddp, max_norm=1.0)
    stepped = False
    for _ in range(steps):
        loss: torch.Tensor = ddp(torch.randn(4, 16)).float().pow(2).mean()
        optimizer.backward(loss)
        stepped = optimizer.step()
        optimizer.zero_grad()
    other = GeminiAdamOptimizer(GeminiDDP(build_model()), lr=1e-3)
    return stepped and other is not None


def zero_directly(module: nn.Module) -> bool:
    inner = FusedAdam(module.parameters(), lr=1e-3) if torch.cuda.is_available() else None
    optimizer = ZeroOptimizer(
        inner or torch.optim.AdamW(module.parameters(), lr=1e-3),
        stage=2,
        overlap_communication=True,
        max_norm=1.0,
        loss_scaler=DynamicLossScaler(initial_scale=2**16),
    )
    loss = module(torch.randn(4, 16)).float().pow(2).mean()
    optimizer.backward(loss)
    skipped_or_stepped: bool = optimizer.step()
    optimizer.zero_grad()
    return skipped_or_stepped


def offload_directly(inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> float:
    """ColossalAI's auto-offload example, ported."""
    model = build_model()
    print(f"parameters: {parameter_size(model) / 2**20:.1f} MiB (NVML: {not NOT_NVML})")
    profile = HardwareProfile.measure("cuda" if torch.cuda.is_available() else "cpu")
    try:
        offloaded: BaseOffloadModule = memory_optimize(
            model, inputs, 8 * 1024**3, "asyn", precision="bf16", profile=profile
        )
    except MemoryBudgetError as error:
        raise SystemExit(str(error)) from error
    optim = AMPOptimizer(HybridAdam(offloaded.master_parameters(), lr=1e-3), offloaded)
    optim.zero_grad()
    loss = nn.functional.cross_entropy(offloaded(**inputs).float(), labels)
    optim.backward(loss)
    optim.step()
    return float(loss)


def chunk_search(model: nn.Module) -> int:
    result = search_chunk_configuration(model, search_range_m=32, min_chunk_size_m=32)
    return result.total_size - result.wasted_size


def main() -> None:
    launch_from_torch(seed=1024)
    for plugin in plugins():
        train_with(plugin, steps=2, path="/tmp/ckpt")
    gemini_directly(steps=2)
    zero_directly(build_model())
    chunk_search(lazy_init())
    boost_without_a_criterion()


def spawned(rank: int, world_size: int, port: int) -> None:
    launch(rank=rank, world_size=world_size, host="localhost", port=port, backend="gloo")
    zero_directly(build_model())


if __name__ == "__main__":
    main()
