"""Region: a run of consecutive graph nodes and the parameters they own.

[Note: region storage] Each region keeps one flat device buffer of its
half-precision parameters, and every parameter's ``.data`` is a view into it,
set once. Offloading frees the buffer's *storage* (``resize_(0)``) and
uploading re-grows that same storage and copies into it, so the parameter
objects, and any view of them that autograd saved in forward, stay valid
across offload and upload. (ColossalAI swapped ``.data`` to other tensors and
pooled blocks, which breaks saved views.) The fp32 master, the half copy
that is uploaded and the gradient that comes back live on the host; the
optimizer writes the half copy as it steps the master (fused-adam's
copy-out), so an upload moves 2 bytes per parameter, not 4.
"""

from __future__ import annotations

import torch

from zerostack.auto_offload._trace import NodeInfo

_NORM_CHUNK_NUMEL = 1 << 24  # bounds the fp32 temporary of the gradient norm


class Region:
    """A container owning a run of consecutive nodes of the linearized graph.

    The planning fields (``need_offload``, ``is_syn``, prefetch links) are set
    by the solver; the runtime fields by :meth:`init_param_data`.

    Args:
        r_id: the index of the region in the graph (forward order).
    """

    def __init__(self, r_id: int = 0) -> None:
        self.r_id = r_id
        self.nodes: list[NodeInfo] = []
        self.params: list[torch.nn.Parameter] = []
        """Parameters this region owns (first read here), in order of first use."""
        self.grad_params: list[torch.nn.Parameter] = []
        """The owned parameters that get a gradient (read and trainable)."""
        self.shared = False
        """Another region reads one of its parameters (it stays resident)."""
        self.need_offload = False
        """Freed after forward and uploaded again for backward."""
        self.is_syn = False
        """Its backward upload is synchronous (no prefetch)."""
        self.fwd_prefetch_region: Region | None = None
        self.bwd_prefetch_region: Region | None = None
        """The region whose upload this one issues when its backward starts."""
        self.cut_node: torch.fx.Node | None = None
        """The one gradient-carrying value that enters this region (None for region 0)."""
        # runtime
        self.cuda_data: torch.Tensor | None = None
        self.cpu_master: torch.Tensor | None = None
        self.cpu_half: torch.Tensor | None = None
        # cpu_master's version counter when cpu_half last matched it (see
        # BaseOffloadModule's [Note: half copies follow the masters]).
        self.half_version = -1
        self.cpu_grad: torch.Tensor | None = None
        self.param_to_range: dict[torch.nn.Parameter, tuple[int, int]] = {}
        self.grad_numel_done = 0

    # -- sizes ---------------------------------------------------------------

    @property
    def param_numel(self) -> int:
        """Elements of the owned parameters."""
        return sum(p.numel() for p in self.params)

    @property
    def param_bytes(self) -> int:
        """Bytes of the owned parameters on the device (compute dtype)."""
        return sum(p.numel() * p.element_size() for p in self.params)

    @property
    def grad_numel(self) -> int:
        """Gradient elements a backward delivers to this region."""
        return sum(p.numel() for p in self.grad_params)

    @property
    def offloadable(self) -> bool:
        """Whether the solver may free it between forward and backward: it
        owns parameters, none read elsewhere, and gets gradients (which is
        what frees it in backward)."""
        return bool(self.params) and not self.shared and bool(self.grad_params)

    def __repr__(self) -> str:
        return (
            f"Region({self.r_id}, nodes={len(self.nodes)}, params={len(self.params)}, "
            f"bytes={self.param_bytes}, offload={self.need_offload}, syn={self.is_syn})"
        )

    # -- planning ------------------------------------------------------------

    def split(self, cut_node_idx: int, cut_param_idx: int) -> Region:
        """Split the region in two and return the latter part, which takes
        ``nodes[cut_node_idx:]`` and ``params[cut_param_idx:]``.

        Raises:
            ValueError: an index outside the region, or runtime data already built.
        """
        if not 0 < cut_node_idx < len(self.nodes):
            raise ValueError(
                f"Region.split: cut_node_idx must be in [1, {len(self.nodes) - 1}] "
                f"(got {cut_node_idx})"
            )
        if not 0 <= cut_param_idx <= len(self.params):
            raise ValueError(
                f"Region.split: cut_param_idx must be in [0, {len(self.params)}] (got {cut_param_idx})"
            )
        if self.cuda_data is not None:
            raise ValueError("Region.split: the region's data is already built; split before")
        latter = Region(r_id=self.r_id + 1)
        latter.nodes, self.nodes = self.nodes[cut_node_idx:], self.nodes[:cut_node_idx]
        latter.params, self.params = self.params[cut_param_idx:], self.params[:cut_param_idx]
        moved = {id(p) for p in latter.params}
        latter.grad_params = [p for p in self.grad_params if id(p) in moved]
        self.grad_params = [p for p in self.grad_params if id(p) not in moved]
        latter.shared = self.shared
        return latter

    # -- runtime -------------------------------------------------------------

    def init_param_data(
        self, device: torch.device, dtype: torch.dtype, masters: dict[int, torch.Tensor]
    ) -> None:
        """Build the flat buffers and point every parameter into the device one.

        Args:
            device: the compute device.
            dtype: the compute dtype (float16 or bfloat16).
            masters: ``id(param)`` -> the parameter's original (full-precision)
                value, copied into the fp32 master and then dropped.
        """
        numel, pin = self.param_numel, device.type == "cuda"
        self.cpu_master = torch.empty(numel, dtype=torch.float32)
        self.cpu_half = torch.empty(numel, dtype=dtype, pin_memory=pin)
        self.cpu_grad = torch.empty(numel, dtype=dtype, pin_memory=pin)
        self.cuda_data = torch.empty(numel, dtype=dtype, device=device)
        offset = 0
        for p in self.params:
            n = p.numel()
            self.cpu_master[offset : offset + n].copy_(masters.pop(id(p)).reshape(-1))
            self.param_to_range[p] = (offset, offset + n)
            offset += n
        self.cpu_half.copy_(self.cpu_master)
        self.half_version = self.cpu_master._version
        for p in self.params:
            begin, end = self.param_to_range[p]
            p.data = self.cuda_data[begin:end].view(p.shape)
        self.free_cuda_data()

    @property
    def is_resident(self) -> bool:
        """The device buffer holds data now."""
        return self.cuda_data is not None and self.cuda_data.untyped_storage().nbytes() > 0

    def move_param_to_cuda(self) -> None:
        """Upload the half-precision parameters on the current stream (grows
        the buffer's storage first). See [Note: region storage]."""
        storage = self.cuda_data.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.cuda_data.numel() * self.cuda_data.element_size())
        self.cuda_data.copy_(self.cpu_half, non_blocking=True)

    def copy_grad_to_region_slice(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Write ``param``'s finished gradient over its (no longer needed) values."""
        begin, end = self.param_to_range[param]
        self.cuda_data[begin:end].copy_(grad.reshape(-1))
        self.grad_numel_done += end - begin

    @property
    def can_release(self) -> bool:
        """Every gradient of the region has arrived."""
        return bool(self.grad_params) and self.grad_numel_done >= self.grad_numel

    def _grad_slices(self) -> list[torch.Tensor]:
        """The buffer's gradient parts: frozen and unread parameters keep their
        values in the buffer, and must not count as gradients."""
        ranges = sorted(self.param_to_range[p] for p in self.grad_params)
        merged: list[list[int]] = []
        for begin, end in ranges:
            if merged and merged[-1][1] == begin:
                merged[-1][1] = end
            else:
                merged.append([begin, end])
        return [self.cuda_data[b:e] for b, e in merged]

    @property
    def has_inf_or_nan(self) -> torch.Tensor:
        """A device bool: the gradients now in the buffer hold an inf or a nan."""
        flags = [~torch.isfinite(s).all() for s in self._grad_slices()]
        return torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool)

    def grad_norm_sq(self) -> torch.Tensor:
        """Squared L2 norm (fp32, on the device) of the gradients in the buffer;
        non-finite when any of them is."""
        total = torch.zeros((), dtype=torch.float32, device=self.cuda_data.device)
        for part in self._grad_slices():
            for chunk in part.split(_NORM_CHUNK_NUMEL):
                total += torch.linalg.vector_norm(chunk, dtype=torch.float32).square()
        return total

    def move_grad_to_cpu(self) -> None:
        """Copy the gradients to the pinned host buffer on the current stream,
        then free the device storage (the caller records the stream)."""
        self.cpu_grad.copy_(self.cuda_data, non_blocking=True)
        self.free_cuda_data()
        self.grad_numel_done = 0

    def free_cuda_data(self) -> None:
        """Free the device storage (the parameter views stay)."""
        self.cuda_data.untyped_storage().resize_(0)
