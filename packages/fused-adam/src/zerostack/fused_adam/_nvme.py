"""Adam states on disk: the bridge from the optimizers to zerostack-nvme.

Imported only when ``nvme_offload_fraction > 0``; zerostack-nvme is the
optional extra ``zerostack-fused-adam[nvme]``.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)


def _import_nvme() -> Any:
    try:
        import zerostack.nvme as nvme
    except ImportError:
        raise ImportError(
            "nvme_offload_fraction > 0 needs zerostack-nvme: "
            "pip install 'zerostack-fused-adam[nvme]' (or pip install zerostack-nvme)"
        ) from None
    return nvme


class NVMeStates:
    """Which parameters keep ``exp_avg``/``exp_avg_sq`` on disk, and their I/O.

    Every chosen parameter has one key holding ``[exp_avg, exp_avg_sq]`` as
    one fp32 buffer of ``2 * numel`` elements, so a parameter costs one read
    and one write per step.
    """

    def __init__(
        self,
        param_groups: list[dict],
        fraction: float,
        directory: str | None,
        backend: str | None,
        prefetch_depth: int,
    ) -> None:
        nvme = _import_nvme()
        self.swapper = nvme.StateSwapper(directory, backend=backend, prefetch_depth=prefetch_depth)
        params = [p for g in param_groups for p in g["params"]]
        target = fraction * sum(p.numel() for p in params)
        # As in the reference: a share of all parameter elements, in
        # parameter order, of which only CPU-resident ones are eligible.
        self.keys: dict[torch.Tensor, str] = {}
        offloaded = 0
        for gi, group in enumerate(param_groups):
            for pi, p in enumerate(group["params"]):
                if p.device.type == "cpu" and offloaded + p.numel() <= target:
                    key = f"{gi}.{pi}"
                    self.swapper.register(key, 2 * p.numel())
                    self.keys[p] = key
                    offloaded += p.numel()
        logger.info(
            "nvme: Adam states of %d parameters (%d elements, %.1f MB) on disk in %s",
            len(self.keys),
            offloaded,
            8 * offloaded / 2**20,
            self.swapper.workdir,
        )

    def step(self, items: list[tuple[torch.Tensor, dict]], update: Callable) -> None:
        """Run ``update(param, exp_avg, exp_avg_sq)`` over ``items`` through the pipeline."""
        pipe = self.swapper.pipeline([self.keys[p] for p, _ in items])
        pipe.pre_step()
        for i, (p, _) in enumerate(items):
            buf = pipe.pre_update(i)
            n = p.numel()
            update(p, buf[:n], buf[n:])
            pipe.post_update(i)
        pipe.post_step()

    def snapshot(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This parameter's states, read into a file-backed mapping.

        The mapping's file is unlinked at once: the pages are page cache the
        kernel can write back and drop, so a state_dict of states on disk
        never needs them all in RAM at once.
        """
        path = os.path.join(self.swapper.workdir, f"snapshot-{uuid.uuid4().hex}")
        buf = torch.from_file(path, shared=True, size=2 * p.numel(), dtype=torch.float32)
        os.unlink(path)
        self.swapper.read(self.keys[p], buf)
        n = p.numel()
        return buf[:n].view_as(p), buf[n:].view_as(p)

    def load(self, p: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Write loaded states of one parameter to disk (one parameter in RAM at a time)."""
        buf = torch.cat([exp_avg.reshape(-1).float(), exp_avg_sq.reshape(-1).float()]).cpu()
        self.swapper.write(self.keys[p], buf)

    def close(self) -> None:
        self.swapper.close()
