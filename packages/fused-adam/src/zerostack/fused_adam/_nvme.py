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


# Largest piece of a parameter swapped as one unit. Pieces bound the RAM of
# the pipeline's slots ((prefetch_depth + 2) x 8 bytes x this) whatever the
# largest parameter, e.g. 128 MiB at depth 2 next to a 38M-element embedding.
PIECE_NUMEL = 1 << 22


class NVMeStates:
    """Which parameters keep ``exp_avg``/``exp_avg_sq`` on disk, and their I/O.

    A parameter is cut into pieces of at most PIECE_NUMEL elements; each piece
    is one key holding ``[exp_avg piece, exp_avg_sq piece]`` as one fp32
    buffer, so a piece costs one read and one write per step.
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
        self.keys: dict[torch.Tensor, list[tuple[str, int, int]]] = {}
        offloaded = 0
        for gi, group in enumerate(param_groups):
            for pi, p in enumerate(group["params"]):
                if p.device.type == "cpu" and offloaded + p.numel() <= target:
                    pieces = []
                    for start in range(0, p.numel(), PIECE_NUMEL):
                        end = min(p.numel(), start + PIECE_NUMEL)
                        key = f"{gi}.{pi}:{start}"
                        self.swapper.register(key, 2 * (end - start))
                        pieces.append((key, start, end))
                    self.keys[p] = pieces
                    offloaded += p.numel()
        logger.info(
            "nvme: Adam states of %d parameters (%d elements, %.1f MB) on disk in %s",
            len(self.keys),
            offloaded,
            8 * offloaded / 2**20,
            self.swapper.workdir,
        )

    def step(self, params: list[torch.Tensor], update: Callable) -> None:
        """Run ``update(param, start, end, exp_avg, exp_avg_sq)`` piece by piece
        through the prefetch pipeline."""
        pieces = [(p, *piece) for p in params for piece in self.keys[p]]
        pipe = self.swapper.pipeline([key for _, key, _, _ in pieces])
        pipe.pre_step()
        for i, (p, _, start, end) in enumerate(pieces):
            buf = pipe.pre_update(i)
            n = end - start
            update(p, start, end, buf[:n], buf[n:])
            pipe.post_update(i)
        pipe.post_step()

    def snapshot(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This parameter's states, read into a file-backed mapping.

        The mapping's file is unlinked at once: the pages are page cache the
        kernel can write back and drop, so a state_dict of states on disk
        never needs them all in RAM at once.
        """
        path = os.path.join(self.swapper.workdir, f"snapshot-{uuid.uuid4().hex}")
        out = torch.from_file(path, shared=True, size=2 * p.numel(), dtype=torch.float32)
        os.unlink(path)
        n = p.numel()
        m, v = out[:n], out[n:]
        scratch = torch.empty(2 * min(n, PIECE_NUMEL), dtype=torch.float32)
        for key, start, end in self.keys[p]:
            piece = self.swapper.read(key, scratch[: 2 * (end - start)])
            m[start:end].copy_(piece[: end - start])
            v[start:end].copy_(piece[end - start :])
        return m.view_as(p), v.view_as(p)

    def load(self, p: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Write loaded states of one parameter to disk, a piece at a time."""
        m, v = exp_avg.reshape(-1), exp_avg_sq.reshape(-1)
        for key, start, end in self.keys[p]:
            piece = torch.cat([m[start:end].float(), v[start:end].float()]).cpu()
            self.swapper.write(key, piece)

    def close(self) -> None:
        self.swapper.close()
