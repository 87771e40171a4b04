"""CPUAdam, FusedAdam and HybridAdam: one optimizer class, three routings.

All three keep torch's per-parameter state layout (``step``, ``exp_avg``,
``exp_avg_sq``), so ``state_dict()`` round-trips with ``torch.optim.AdamW``.
States and arithmetic are fp32 whatever the parameter dtype.
"""

from __future__ import annotations

import math
import numbers
import os
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from zerostack.fused_adam import _kernels

_SUPPORTED_DTYPES = tuple(_kernels.DTYPE_CODES)


def _is_number(value: object) -> bool:
    # A one-element tensor is a number too (torch takes a Tensor lr).
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.is_floating_point()
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_number(api: str, name: str, value: object) -> None:
    if not _is_number(value):
        raise TypeError(f"{api}: {name} must be a number (got {value!r}); pass a float")


def _check_hyper(api: str, lr: float, betas: tuple[float, float], eps: float, wd: float) -> None:
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", wd)):
        _check_number(api, name, value)
    if not lr >= 0.0:
        raise ValueError(f"{api}: lr must be >= 0 (got {lr}); pass a non-negative learning rate")
    if not eps >= 0.0:
        raise ValueError(f"{api}: eps must be >= 0 (got {eps}); pass a small positive eps")
    if not isinstance(betas, tuple | list) or not all(_is_number(b) for b in betas):
        raise TypeError(
            f"{api}: betas must be a pair of numbers (got {betas!r}); e.g. (0.9, 0.999)"
        )
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{api}: betas must be two values in [0, 1) (got {betas})")
    if not wd >= 0.0:
        raise ValueError(f"{api}: weight_decay must be >= 0 (got {wd})")
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", wd)):
        if not math.isfinite(float(value)):
            raise ValueError(f"{api}: {name} must be finite (got {value})")


def _check_flags(api: str, **flags: object) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{api}: {name} must be a bool (got {value!r})")


# torch.optim.Adam/AdamW options a parameter group may carry (torch keeps any
# key): changing the math or the step's nature, with the value that is off.
_TORCH_ONLY = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}


def _check_torch_keys(api: str, group: dict[str, Any], adamw_mode: bool) -> None:
    """Refuse torch's Adam options in a group: the kernels would ignore them."""
    _refuse_torch_options(api, group)
    decoupled = group.get("decoupled_weight_decay")
    if decoupled is not None and bool(decoupled) != adamw_mode:
        raise ValueError(
            f"{api}: decoupled_weight_decay={decoupled!r} contradicts adamw_mode="
            f"{adamw_mode!r}; set adamw_mode (True: decoupled decay as AdamW, "
            "False: L2 as Adam) and leave decoupled_weight_decay out"
        )


def _refuse_torch_options(api: str, group: dict[str, Any]) -> None:
    for key, off in _TORCH_ONLY.items():
        if key in group and group[key] != off:
            raise NotImplementedError(
                f"{api}: {key}={group[key]!r} is an option of torch.optim.AdamW that is not "
                f"implemented here (got {key}={group[key]!r} in a parameter group); use "
                f"torch.optim.AdamW for it, or leave {key} out"
            )


def _check_nvme(
    api: str, fraction: float, directory: str | None, backend: object, depth: object
) -> None:
    _check_number(api, "nvme_offload_fraction", fraction)
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(
            f"{api}: nvme_offload_fraction must be in [0, 1] (got {fraction}); "
            "0 keeps every state in memory, 1 puts all CPU states on disk"
        )
    if directory is not None and not isinstance(directory, str | os.PathLike):
        raise TypeError(f"{api}: nvme_offload_dir must be a path or None (got {directory!r})")
    if backend is not None and not isinstance(backend, str):
        raise TypeError(
            f"{api}: nvme_backend must be 'uring', 'aio', 'threads' or None (got {backend!r})"
        )
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"{api}: nvme_prefetch_depth must be an int >= 1 (got {depth!r})")


class _Adam(torch.optim.Optimizer):
    """Adam/AdamW stepped by the compiled kernels. Subclasses set the devices."""

    _api = "Adam"
    _allowed_devices: tuple[str, ...] = ("cpu", "cuda")

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        nvme_offload_fraction: float = 0.0,
        nvme_offload_dir: str | None = None,
        *,
        nvme_backend: str | None = None,
        nvme_prefetch_depth: int = 2,
    ) -> None:
        _check_hyper(self._api, lr, betas, eps, weight_decay)
        _check_flags(self._api, adamw_mode=adamw_mode, bias_correction=bias_correction)
        _check_nvme(
            self._api, nvme_offload_fraction, nvme_offload_dir, nvme_backend, nvme_prefetch_depth
        )
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults)
        self.nvme_offload_fraction = nvme_offload_fraction
        self.nvme_offload_dir = nvme_offload_dir
        self._copy_out: dict[torch.Tensor, torch.Tensor] = {}
        if "cuda" in self._allowed_devices and any(
            p.device.type == "cuda" for g in self.param_groups for p in g["params"]
        ):
            _kernels.require_cuda(self._api)
        self._nvme = None
        # Slices of on-disk states the next step leaves alone, by parameter.
        self._keep_on_disk: dict[torch.Tensor, list[slice]] = {}
        if nvme_offload_fraction > 0.0:
            from zerostack.fused_adam._nvme import NVMeStates

            # Which states go to disk is decided at the first step: see
            # [Note: NVMe binding].
            self._nvme = NVMeStates(
                self._api, nvme_offload_fraction, nvme_offload_dir, nvme_backend,
                nvme_prefetch_depth,
            )  # fmt: skip

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``, with the group's hyperparameters and
        tensors checked: a bad group raises and is not added."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_hyper(
                self._api, group["lr"], group["betas"], group["eps"], group["weight_decay"]
            )
            _check_flags(
                self._api, adamw_mode=group["adamw_mode"], bias_correction=group["bias_correction"]
            )
            _check_torch_keys(self._api, group, group["adamw_mode"])
            for pi, p in enumerate(group["params"]):
                self._check_param(len(self.param_groups) - 1, pi, p)
        except (TypeError, ValueError, NotImplementedError):
            self.param_groups.pop()
            raise

    # -- NVMe --------------------------------------------------------------

    def _disk(self) -> dict[torch.Tensor, list]:
        """The parameters whose states are on disk, binding (or rebinding) to
        the parameters the optimizer holds now; states already in RAM for a
        parameter that goes to disk are moved there."""
        if self._nvme is None:
            return {}
        params = [p for g in self.param_groups for p in g["params"]]
        if not self._nvme.bound_to(params):
            fresh, back = self._nvme.bind(self.param_groups)
            for p in fresh:
                state = self.state.get(p)
                if state and "exp_avg" in state:
                    self._nvme.load(p, state.pop("exp_avg"), state.pop("exp_avg_sq"))
            for p, (exp_avg, exp_avg_sq) in back.items():
                self.state[p].update(exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
        return self._nvme.keys

    def keep_disk_states(self, p: torch.Tensor, elements: slice) -> None:
        """Leave ``elements`` (of ``p`` flattened) of ``p``'s Adam moments as
        they are in the next step that steps ``p``, where those moments are on
        disk (a no-op for moments in RAM, which the caller can copy itself).

        For a wrapper that steps flat shards in which some parameters got no
        gradient: torch's optimizers skip a parameter whose gradient is None,
        and an update with a zero gradient would still decay its moments. The
        caller keeps ``p``'s own values.

        Raises:
            TypeError: ``elements`` is not a slice of step 1.
        """
        if not isinstance(elements, slice) or elements.step not in (None, 1):
            raise TypeError(
                f"{self._api}.keep_disk_states: elements must be a slice of step 1 "
                f"(got {elements!r})"
            )
        if self._nvme is not None and p in self._disk():
            self._keep_on_disk.setdefault(p, []).append(elements)

    def nvme_plan(self, params: list[torch.Tensor]) -> None:
        """The next ``step`` calls will each step one of ``params``, in this
        order: disk reads run ahead across them (a no-op without NVMe)."""
        if self._nvme is not None:
            self._disk()
            self._nvme.plan(params)

    def nvme_host_params(self, params: list[torch.Tensor] | None, hint: str = "") -> None:
        """Say which of this optimizer's parameters a wrapper's placement
        keeps in host memory: only their Adam states may go to disk
        (``nvme_offload_fraction`` is a share of their elements). Default,
        and with None: every CPU parameter. GeminiOptimizer names its
        offloaded master chunks, so a CPU compute device puts on disk what a
        GPU would. ``hint`` ends the warning given when none is host-held
        (how to hold states on the host). Takes effect at the next step; a
        no-op without NVMe."""
        if self._nvme is not None:
            self._nvme.set_host(None if params is None else list(params), hint)

    def set_step_waiter(self, wait: Callable[[], Any] | None) -> None:
        """A wrapper that runs this optimizer's steps on a worker thread
        (GeminiOptimizer, ZeroOptimizer with ``overlap_cpu_step``) passes the
        call that waits for those steps (no write-back, no collective);
        ``nvme_bytes_on_disk`` and ``nvme_host_buffers`` call it first, so a
        figure read right after the wrapper's ``step()`` describes the states
        after that step. It is kept with the NVMe states, so an optimizer that
        shares them (a wrapper's stepping twin) waits too. A bound method is
        held weakly. None removes it; a no-op without NVMe."""
        if wait is not None and not callable(wait):
            raise TypeError(
                f"{self._api}.set_step_waiter: wait must be callable or None (got {wait!r})"
            )
        if self._nvme is not None:
            waiter: Callable[[], Callable[[], None] | None] | None = None
            if wait is not None:
                waiter = weakref.WeakMethod(wait) if hasattr(wait, "__self__") else lambda: wait
            self._nvme.step_waiter = waiter

    @property
    def nvme_wait_s(self) -> float:
        """Seconds this optimizer waited for disk reads and writes (exposed I/O)."""
        return self._nvme.wait_s if self._nvme is not None else 0.0

    def nvme_host_buffers(self) -> list[torch.Tensor]:
        """The host buffers the NVMe path holds now: the prefetch pipeline's
        slots (bounded by (prefetch depth + 2) pieces) and states kept in RAM
        after a failed write; empty without NVMe. Waits for the steps in
        flight (see ``set_step_waiter``)."""
        if self._nvme is None:
            return []
        self._nvme.wait_steps()
        return self._nvme.host_buffers()

    def nvme_bytes_on_disk(self) -> int:
        """Bytes of Adam state on disk: the steps in flight (a wrapper's
        worker, see ``set_step_waiter``) and the writes in flight are waited
        for first, so the figure is never short of states that are in RAM
        only for their update."""
        if self._nvme is None:
            return 0
        self._nvme.wait_steps()
        return self._nvme.on_disk_bytes()

    # -- validation --------------------------------------------------------

    def _name(self, gi: int, pi: int, p: torch.Tensor) -> str:
        return f"param {gi}.{pi} (shape {tuple(p.shape)}, {p.dtype}, {p.device})"

    # Every step checks every parameter: a name is built only for a message
    # (building it each time was a third of CPUAdam.step's Python time).

    def _check_param(self, gi: int, pi: int, p: torch.Tensor) -> None:
        if p.device.type not in self._allowed_devices:
            hint = {
                "CPUAdam": "use FusedAdam or HybridAdam for CUDA parameters",
                "FusedAdam": "use CPUAdam or HybridAdam for CPU parameters",
            }.get(self._api, "move it to the CPU or a CUDA device")
            name = self._name(gi, pi, p)
            raise ValueError(f"{self._api}: {name} is on {p.device.type}; {hint}")
        if p.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(
                f"{self._api}: {self._name(gi, pi, p)} has unsupported dtype (got {p.dtype}); "
                "use float32, float16 or bfloat16"
            )
        if p.is_sparse or not p.is_contiguous():
            raise ValueError(
                f"{self._api}: {self._name(gi, pi, p)} must be a dense contiguous tensor; call "
                ".contiguous() on it before building the optimizer"
            )

    def _check_grad(self, gi: int, pi: int, p: torch.Tensor) -> torch.Tensor:
        self._check_param(gi, pi, p)
        g = p.grad
        if type(g) is not torch.Tensor and g.numel() and g.data_ptr() == 0:
            # A gradient that holds no values: zero-shard's ShardedGradient, what a
            # boosted model's param.grad is while its wrapper holds the gradient.
            raise RuntimeError(
                f"{self._api}: {self._name(gi, pi, p)}'s gradient holds no values (got "
                f"{type(g).__name__}): this parameter belongs to a boosted or wrapped model, "
                "whose optimizer steps it; step the optimizer booster.boost (or the wrapper) "
                "returned, not this one"
            )
        if g.is_sparse:
            name = self._name(gi, pi, p)
            raise ValueError(f"{self._api}: {name} has a sparse gradient; Adam needs dense ones")
        if g.shape != p.shape:
            raise ValueError(
                f"{self._api}: {self._name(gi, pi, p)} has a gradient of another shape (got "
                f"{tuple(g.shape)})"
            )
        if g.device != p.device:
            name = self._name(gi, pi, p)
            raise ValueError(f"{self._api}: {name} has its gradient on {g.device}")
        if g.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(
                f"{self._api}: {self._name(gi, pi, p)} has a gradient of unsupported dtype (got "
                f"{g.dtype}); use float32, float16 or bfloat16"
            )
        if not g.is_contiguous():
            name = self._name(gi, pi, p)
            raise ValueError(f"{self._api}: {name} has a non-contiguous gradient")
        return g

    # -- copy-out ----------------------------------------------------------

    def set_copy_out(self, param: torch.Tensor, out: torch.Tensor | None) -> None:
        """Also write ``param``'s updated value into ``out`` in the same pass.

        Typical use: an fp32 master on the CPU whose fp16/bf16 copy goes to a
        pinned buffer headed for the GPU, with no separate cast pass.

        Args:
            param: a parameter of this optimizer.
            out: a contiguous fp32/fp16/bf16 tensor with ``param``'s number of
                elements on ``param``'s device; ``None`` stops the copy-out.

        Raises:
            ValueError: ``param`` is not in this optimizer or ``out`` does not fit.
        """
        if not any(param is p for g in self.param_groups for p in g["params"]):
            raise ValueError(
                f"{self._api}.set_copy_out: the tensor is not a parameter of this optimizer"
            )
        if out is None:
            self._copy_out.pop(param, None)
            return
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"{self._api}.set_copy_out: out must be a tensor or None (got {type(out).__name__})"
            )
        if (
            out.numel() != param.numel()
            or out.device != param.device
            or out.dtype not in _SUPPORTED_DTYPES
            or not out.is_contiguous()
        ):
            raise ValueError(
                f"{self._api}.set_copy_out: out must be a contiguous float32/float16/bfloat16 "
                f"tensor of {param.numel()} elements on {param.device} "
                f"(got {out.numel()} elements, {out.dtype}, {out.device})"
            )
        self._copy_out[param] = out

    # -- stepping ----------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, div_scale: float = -1) -> Any:
        """Update every parameter that has a gradient.

        Args:
            closure: re-evaluates the model and returns the loss (optional).
            div_scale: when positive, gradients are divided by it first (the
                loss scale and the clipping coefficient folded into one).

        Returns:
            The closure's loss, or None.
        """
        self._check_step_args(closure, div_scale)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = 1.0 / div_scale if div_scale > 0 else 1.0
        for group in self.param_groups:  # torch's options set by hand since: not ignored
            _refuse_torch_options(self._api, group)
        # Every gradient is checked before any state changes: a bad one
        # leaves the whole optimizer as it was.
        grads = [
            [
                self._check_grad(gi, pi, p) if p.grad is not None else None
                for pi, p in enumerate(group["params"])
            ]
            for gi, group in enumerate(self.param_groups)
        ]
        # Step counts advance before the kernels run; those of parameters whose
        # kernel never ran are put back if the step raises (a kernel call or
        # a disk read that failed), so a retried step counts once.
        bumped: list[tuple[torch.Tensor, bool]] = []
        launched: set[int] = set()
        try:
            self._step_groups(grads, grad_scale, bumped, launched)
        except BaseException:
            _unbump(self.state, bumped, launched)
            raise
        return loss

    def _step_groups(self, grads, grad_scale, bumped, launched) -> None:
        on_disk = self._disk()
        for gi, group in enumerate(self.param_groups):
            live = [
                (p, g) for p, g in zip(group["params"], grads[gi], strict=True) if g is not None
            ]
            if not live:
                continue
            for p, _ in live:
                state = self.state[p]
                bumped.append((p, not state))
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    if p not in on_disk:
                        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            counts = _advance([self.state[p]["step"] for p, _ in live])
            launch = _launcher(group, grad_scale)
            buckets: dict[tuple, list[tuple]] = defaultdict(list)
            disk_params: list[torch.Tensor] = []
            for (p, g), count in zip(live, counts, strict=True):
                if p in on_disk:
                    disk_params.append(p)
                    continue
                state = self.state[p]
                out = self._copy_out.get(p)
                key = (p.device, p.dtype, g.dtype, None if out is None else out.dtype, count)
                buckets[key].append((p, g, state["exp_avg"], state["exp_avg_sq"], out))
            for key, items in buckets.items():
                launch(items, key[-1])
                launched.update(id(item[0]) for item in items)
            if disk_params:
                self._step_on_disk(disk_params, launch, launched)

    def _check_step_args(self, closure: Any, div_scale: Any) -> None:
        if closure is not None and not callable(closure):
            raise TypeError(
                f"{self._api}.step: closure must be callable or None (got {type(closure).__name__})"
            )
        if not _is_number(div_scale) or math.isnan(float(div_scale)):
            error = TypeError if not _is_number(div_scale) else ValueError
            raise error(
                f"{self._api}.step: div_scale must be a number, > 0 to divide the gradients by it "
                f"or <= 0 for none (got {div_scale!r})"
            )

    def _step_on_disk(
        self, params: list[torch.Tensor], launch: Callable, launched: set[int]
    ) -> None:
        """Step ``params``, whose moments are on disk, piece by piece through
        the prefetch pipeline; slices asked for by ``keep_disk_states`` get
        their moments back before each piece is written."""

        def piece_update(p, start, end, m, v):
            out = self._copy_out.get(p)
            kept = _kept(self._keep_on_disk.get(p, ()), start, end, m, v)
            piece = (
                p.view(-1)[start:end],
                p.grad.view(-1)[start:end],
                m,
                v,
                None if out is None else out.view(-1)[start:end],
            )
            launch([piece], float(self.state[p]["step"]))
            launched.add(id(p))  # after: a first piece that failed leaves the step uncounted
            for sl, old_m, old_v in kept:  # before the piece goes back to disk
                m[sl].copy_(old_m)
                v[sl].copy_(old_v)

        try:
            self._nvme.step(params, piece_update)
        finally:
            for p in params:
                self._keep_on_disk.pop(p, None)

    # -- state dict --------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's layout; states kept on disk come back as file-backed
        tensors (page cache, not RAM), read one parameter at a time."""
        sd = super().state_dict()
        on_disk = self._disk()
        if on_disk:
            params = [p for g in self.param_groups for p in g["params"]]
            for idx, p in enumerate(params):
                if p in on_disk and idx in sd["state"]:
                    m, v = self._nvme.snapshot(p)
                    sd["state"][idx] = {**sd["state"][idx], "exp_avg": m, "exp_avg_sq": v}
        return sd

    def _check_state_dict(self, state_dict: object) -> None:
        """Everything ``load_state_dict`` would reject, checked before anything
        is loaded, so that a bad state dict leaves the optimizer as it was."""
        api = f"{self._api}.load_state_dict"
        if (
            not isinstance(state_dict, dict)
            or not isinstance(state_dict.get("state"), dict)
            or not isinstance(state_dict.get("param_groups"), list)
        ):
            got: object = (
                sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            )
            raise TypeError(
                f"{api}: state_dict must be a dict with 'state' and 'param_groups' (got {got}); "
                "pass an optimizer's state_dict()"
            )
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups) or any(
            len(s.get("params", ())) != len(g["params"])
            for s, g in zip(saved, self.param_groups, strict=False)
        ):
            raise ValueError(
                f"{api}: the state dict has groups of "
                f"{[len(s.get('params', ())) for s in saved]} parameters, this optimizer "
                f"{[len(g['params']) for g in self.param_groups]}"
            )
        for s in saved:
            _check_hyper(
                api,
                s.get("lr", self.defaults["lr"]),
                s.get("betas", self.defaults["betas"]),
                s.get("eps", self.defaults["eps"]),
                s.get("weight_decay", self.defaults["weight_decay"]),
            )
            _check_torch_keys(api, s, self._saved_adamw_mode(s))
        params = {
            i: p
            for s, g in zip(saved, self.param_groups, strict=True)
            for i, p in zip(s["params"], g["params"], strict=True)
        }
        for i, state in state_dict["state"].items():
            p = params.get(i)
            if p is None or not state:
                continue
            missing = {"step", "exp_avg", "exp_avg_sq"} - state.keys()
            if missing:
                raise ValueError(
                    f"{api}: state of a parameter of shape "
                    f"{tuple(p.shape)} lacks {sorted(missing)}; is it an Adam state dict?"
                )
            for k in ("exp_avg", "exp_avg_sq"):
                t = state[k]
                if not isinstance(t, torch.Tensor) or t.shape != p.shape:
                    got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(
                        f"{api}: {k} of shape {got} does not match its parameter's shape "
                        f"{tuple(p.shape)}"
                    )

    def _saved_adamw_mode(self, group: dict[str, Any]) -> bool:
        """A saved group's decay mode: ours, else torch's decoupled_weight_decay
        (AdamW's True, Adam's False), else this optimizer's default."""
        if "adamw_mode" in group:
            return group["adamw_mode"]
        return bool(group.get("decoupled_weight_decay", self.defaults["adamw_mode"]))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of ours or of ``torch.optim.Adam``/``AdamW``
        (torch's ``decoupled_weight_decay`` gives ``adamw_mode``; ``amsgrad``
        and ``maximize`` are refused).

        ``step`` comes back as a CPU float32 scalar and the moments as fp32
        contiguous tensors on the parameter's device, whatever the source kept;
        they are copies, never shared with the source optimizer.
        """
        self._check_state_dict(state_dict)
        on_disk = self._disk()  # bound first: loaded states of disk parameters go straight there
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group.setdefault("adamw_mode", self._saved_adamw_mode(group))
            group.setdefault("bias_correction", self.defaults["bias_correction"])
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                missing = {"step", "exp_avg", "exp_avg_sq"} - state.keys()
                if missing:
                    raise ValueError(
                        f"{self._api}.load_state_dict: state of a parameter of shape "
                        f"{tuple(p.shape)} lacks {sorted(missing)}; is it an Adam state dict?"
                    )
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
                if p in on_disk:
                    for k in ("exp_avg", "exp_avg_sq"):
                        if state[k].shape != p.shape:
                            raise ValueError(
                                f"{self._api}.load_state_dict: {k} of shape {tuple(state[k].shape)} "
                                f"does not match its parameter's shape {tuple(p.shape)}"
                            )
                    self._nvme.load(p, state.pop("exp_avg"), state.pop("exp_avg_sq"))
                    continue
                for k in ("exp_avg", "exp_avg_sq"):
                    t = state[k]
                    if t.shape != p.shape:
                        raise ValueError(
                            f"{self._api}.load_state_dict: {k} of shape {tuple(t.shape)} does "
                            f"not match its parameter's shape {tuple(p.shape)}"
                        )
                    # A copy, never an alias: torch's loader hands back the
                    # source optimizer's own tensors when dtype and device match.
                    state[k] = torch.empty_like(p, dtype=torch.float32).copy_(t)


class CPUAdam(_Adam):
    """Adam/AdamW for CPU parameters, through the SIMD, multi-threaded C++ kernel.

    Args:
        params: parameters or parameter groups, all on the CPU.
        lr: learning rate. Default 1e-3.
        betas: coefficients of the running averages. Default (0.9, 0.999).
        eps: added to the denominator. Default 1e-8.
        weight_decay: decay coefficient. Default 0.
        adamw_mode: True for decoupled decay (AdamW), False for L2 (Adam). Default True.
        bias_correction: apply Adam's bias correction. Default True.
        nvme_offload_fraction: share of the CPU-resident parameters' elements,
            in parameter order, whose Adam states (exp_avg, exp_avg_sq; not
            the parameters) live on disk between steps. Chosen at the first
            step, so it applies to the tensors really stepped (the master
            shards when GeminiOptimizer or ZeroOptimizer(cpu_offload=True)
            wraps this optimizer). Needs ``zerostack-fused-adam[nvme]``.
            Default 0.0.
        nvme_offload_dir: directory for those states; a temporary directory,
            removed with the optimizer, when None. Default None.
        nvme_backend: "uring", "aio" or "threads"; None takes
            $ZEROSTACK_NVME_BACKEND, else "threads" (tensornvme only by
            name; the nvme-offload guide says why). Default None.
        nvme_prefetch_depth: parameters read ahead while one is updated. Default 2.

    Raises:
        ValueError: a bad hyperparameter, or a parameter not on the CPU.
        TypeError: a parameter of an unsupported dtype.
        ImportError: a non-zero nvme_offload_fraction without zerostack-nvme.
    """

    _api = "CPUAdam"
    _allowed_devices = ("cpu",)


class FusedAdam(_Adam):
    """Adam/AdamW for CUDA parameters, through the multi-tensor CUDA kernel.

    Same arguments as :class:`CPUAdam`; every parameter must be on a CUDA
    device, and the install must include the CUDA kernel.

    Raises:
        RuntimeError: the CUDA kernel was not compiled into this install.
        ValueError: a bad hyperparameter, or a parameter not on a CUDA device.
    """

    _api = "FusedAdam"
    _allowed_devices = ("cuda",)

    def __init__(self, params: Any, *args: Any, **kwargs: Any) -> None:
        _kernels.require_cuda(self._api)
        super().__init__(params, *args, **kwargs)


class HybridAdam(_Adam):
    """Adam/AdamW that steps CPU parameters on the CPU kernel and CUDA
    parameters on the CUDA kernel, in one ``step()``.

    Same arguments as :class:`CPUAdam`.
    """

    _api = "HybridAdam"


def _advance(steps: list[torch.Tensor]) -> list[float]:
    """Add one to every step count (CPU float32 scalars, as torch's Adam
    keeps them) and read them, in three torch calls whatever their number.

    [Note: few torch calls on the CPU-step worker] Every torch call from
    Python lets go of the GIL and takes it back. On the worker of an
    overlapped CPU step (ZeroOptimizer's and GeminiOptimizer's
    ``overlap_cpu_step``) the main thread is running the next forward's
    Python at the time, so each of those calls is a handover of the GIL both
    ways, and the worker waits while the forward runs. One ``+= 1`` and one
    ``float()`` a parameter made 1,160 of them a step for GPT-2 XL's 580
    parameters under ZeroOptimizer; these three calls a parameter group
    (per CPU Adam call) give the same counts. The gain was not measured
    alone: with it, on an H200, the CPU step of GPT-2 XL's shape with every
    update in CPU Adam spent 0.023-0.046 s a step outside the kernel, in 22
    calls (docs/benchmarks.md, "2026-12-05 seventeenth session")."""
    torch._foreach_add_(steps, 1.0)
    return torch.stack(steps).tolist()


def _unbump(state: Any, bumped: list[tuple[torch.Tensor, bool]], launched: set[int]) -> None:
    """Undo the step counts (and fresh states) of parameters whose kernel never ran."""
    for p, created in bumped:
        if id(p) in launched:
            continue
        if created:
            state.pop(p, None)
        else:
            state[p]["step"] -= 1


def _launcher(group: dict[str, Any], grad_scale: float) -> Callable:
    """``launch(items, step)``: the kernel over ``items`` (param, grad, m, v,
    out) with ``group``'s hyperparameters at Adam step ``step``."""
    beta1, beta2 = group["betas"]

    def launch(items: list[tuple], step: float) -> None:
        ps, gs, ms, vs, outs = zip(*items, strict=True)
        if group["bias_correction"]:
            bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
        else:
            bc1 = bc2 = 1.0
        _kernels.launch(
            ps, gs, ms, vs, outs if outs[0] is not None else None,
            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"], bias_correction1=bc1, bias_correction2=bc2,
            adamw_mode=group["adamw_mode"], grad_scale=grad_scale,
        )  # fmt: skip

    return launch


def _kept(
    slices: Iterable[slice], start: int, end: int, m: torch.Tensor, v: torch.Tensor
) -> list[tuple[slice, torch.Tensor, torch.Tensor]]:
    """Copies of the moments of the piece [start, end) (read into ``m``,
    ``v``) that fall in ``slices``, as slices of the piece."""
    kept = []
    for sl in slices:
        lo, hi = max(sl.start or 0, start), min(end if sl.stop is None else sl.stop, end)
        if lo < hi:
            piece = slice(lo - start, hi - start)
            kept.append((piece, m[piece].clone(), v[piece].clone()))
    return kept
