"""The bad-input matrix of zero-shard (issue 17): ZeroOptimizer, ZeroConfig,
DynamicLossScaler, CollectorSchedule, the clipping and partition helpers.

One row per bad call: the error type, a regex that names the argument (or
the misused call) and the value got, and whether this table's work added the
check (``fixed``: before it the call gave an unclear error or was accepted).
Every row also checks that the failed call changed nothing (the model's
parameters, the wrapper's ``state_dict()``, a spare torch optimizer's
parameters, the loss scaler, the collective debug switch) and that a
training step still works afterwards.
"""

from __future__ import annotations

import copy
import math
import sys
from typing import Any
from unittest import mock

import pytest
import torch

from zerostack.chunk import debug_collectives
from zerostack.shard import (
    CollectorSchedule,
    DynamicLossScaler,
    ZeroConfig,
    ZeroOptimizer,
    clip_coefficient,
    grad_stats,
    shard_bounds,
    shard_numel,
)
from zerostack.testing import (
    BadInput,
    GPTConfig,
    TinyGPT,
    check_bad_input,
    check_unique_ids,
    make_batch,
    one_torch_thread,
    same_state,
)

CONFIG = GPTConfig(num_layers=1, dim=16, num_heads=2)


def _train_step(env: dict[str, Any], seed: int = 0) -> None:
    idx, tgt = make_batch(CONFIG, 2, 8, seed=seed)
    env["z"].backward(env["model"](idx, tgt))
    assert env["z"].step()


def _env(dtype: torch.dtype) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT(CONFIG).to(dtype)
    # gc_every_n_steps=0: the first step of a schedule runs a full collection (slow).
    z = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), module=model, gc_every_n_steps=0
    )
    env = {"model": model, "z": z, "scaler": DynamicLossScaler()}
    _train_step(env)
    # A torch optimizer not wrapped yet, for the constructor's cases.
    env["fresh"] = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True)
    return env


def _snapshot(env: dict[str, Any]) -> Any:
    return copy.deepcopy(
        {
            "params": [p.detach().clone() for p in env["model"].parameters()],
            "state": env["z"].state_dict(),
            "fresh": [id(p) for g in env["fresh"].param_groups for p in g["params"]],
            "fresh_state": len(env["fresh"].state),
            "scaler": env["scaler"].state_dict(),
            "debug": debug_collectives(),
        }
    )


def _wrap(optimizer=None, **kwargs):
    return lambda env: ZeroOptimizer(
        env["fresh"] if optimizer is None else optimizer(env), **kwargs
    )


def _params(env):
    return list(env["model"].parameters())


def _adamw(env):
    return torch.optim.AdamW(_params(env), lr=1e-2)


def _sd(edit, full=False):
    def call(env):
        z = env["z"]
        sd = copy.deepcopy(z.full_state_dict() if full else z.state_dict())
        edit(sd)
        (z.load_full_state_dict if full else z.load_state_dict)(sd)

    return call


def _clip_in_no_sync(env):
    with env["z"].no_sync():
        env["z"].clip_grad_by_norm(1.0)


def _unscaled_backward(env):
    idx, tgt = make_batch(CONFIG, 2, 8, seed=1)
    env["model"](idx, tgt).backward()  # not env["z"].backward(loss)
    env["z"].step()


def _without_fused_adam(env):
    with mock.patch.dict(sys.modules, {"zerostack.fused_adam": None}):
        ZeroOptimizer(env["fresh"], cpu_offload=True)


CASES = [
    # -- ZeroOptimizer(...): the optimizer ------------------------------------------------
    BadInput("optimizer-module", _wrap(lambda env: env["model"]), TypeError, r"ZeroOptimizer: optimizer must be a torch\.optim\.Optimizer .* \(got TinyGPT\)", True),
    BadInput("optimizer-params", _wrap(_params), TypeError, r"ZeroOptimizer: optimizer must be a torch\.optim\.Optimizer .* \(got list\)", True),
    BadInput("wrap-a-wrapper", _wrap(lambda env: env["z"]), TypeError, r"ZeroOptimizer: the optimizer is a ZeroOptimizer already", True),
    BadInput("wrap-inner-twice", _wrap(lambda env: env["z"].optimizer), RuntimeError, r"ZeroOptimizer: this optimizer is wrapped by a ZeroOptimizer already", True),
    BadInput("optimizer-stepped", _wrap(lambda env: _stepped(env)), ValueError, r"wrap the optimizer before its first step \(it already has state: got state for \d+ tensors, from a step or optimizer\.load_state_dict before the wrap\); wrap a fresh optimizer .*booster\.load_optimizer"),
    BadInput("module-param-missing", lambda env: ZeroOptimizer(torch.optim.AdamW(_params(env)[1:]), module=env["model"]), ValueError, r"parameter 'tok_emb\.weight' of the module is missing from the wrapped optimizer"),
    BadInput("module-str", _wrap(module="model"), TypeError, r"ZeroOptimizer: module must be an nn\.Module or None \(got str\)", True),
    BadInput("param-meta", _wrap(lambda env: torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3, device="meta"))])), ValueError, r"ZeroOptimizer: param 0 \(shape \(3,\)\) is on the meta device", True),
    BadInput("param-int64", _wrap(lambda env: torch.optim.SGD([torch.zeros(3, dtype=torch.int64)], lr=0.1)), TypeError, r"ZeroOptimizer: param 0 \(shape \(3,\)\) must be floating point \(got torch\.int64\)", True),
    BadInput("cpu-offload-amsgrad", _wrap(cpu_offload=True), NotImplementedError, r"cpu_offload does not support amsgrad or maximize \(got amsgrad=True, maximize=False\)", True),
    BadInput("cpu-offload-no-fused-adam", _without_fused_adam, ImportError, r"ZeroOptimizer: cpu_offload with AdamW .* pip install zerostack-fused-adam", True),
    BadInput("gpu-fraction-negative", _wrap(_adamw, cpu_offload=True, gpu_update_fraction=-0.1), ValueError, r"ZeroOptimizer: gpu_update_fraction must be in \[0, 1\] \(got -0\.1\)", True),
    BadInput("gpu-fraction-above-1", _wrap(_adamw, cpu_offload=True, gpu_update_fraction=1.5), ValueError, r"gpu_update_fraction must be in \[0, 1\] \(got 1\.5\)", True),
    BadInput("gpu-fraction-str", _wrap(_adamw, cpu_offload=True, gpu_update_fraction="0.5"), TypeError, r"gpu_update_fraction must be a number in \[0, 1\] or 'auto' \(got '0\.5'\)", True),
    BadInput("gpu-fraction-bool", _wrap(_adamw, cpu_offload=True, gpu_update_fraction=True), TypeError, r"gpu_update_fraction must be a number in \[0, 1\] or 'auto' \(got True\)", True),
    BadInput("gpu-fraction-list", _wrap(_adamw, cpu_offload=True, gpu_update_fraction=[0.5]), TypeError, r"gpu_update_fraction must be a number in \[0, 1\] or 'auto' \(got \[0\.5\]\)", True),
    BadInput("gpu-fraction-sgd", _wrap(lambda env: torch.optim.SGD(_params(env), lr=0.1), cpu_offload=True, gpu_update_fraction=0.5), NotImplementedError, r"gpu_update_fraction steps Adam/AdamW in fused-adam's kernels \(got SGD\)", True),
    # -- ZeroOptimizer(...): settings -----------------------------------------------------
    BadInput("stage-0", _wrap(stage=0), ValueError, r"stage must be 1 or 2 \(got 0\); use gemini for stage 3"),
    BadInput("stage-3", _wrap(stage=3), ValueError, r"stage must be 1 or 2 \(got 3\)"),
    BadInput("stage-str", _wrap(stage="2"), ValueError, r"stage must be 1 or 2 \(got '2'\)"),
    BadInput("bucket-0", _wrap(reduce_bucket_size=0), ValueError, r"reduce_bucket_size must be >= 1 \(got 0\)"),
    BadInput("bucket-str", _wrap(reduce_bucket_size="1024"), TypeError, r"reduce_bucket_size must be an int \(got '1024'\)", True),
    BadInput("bucket-float", _wrap(reduce_bucket_size=1e6), TypeError, r"reduce_bucket_size must be an int \(got 1000000\.0\)", True),
    BadInput("max-norm-negative", _wrap(max_norm=-1), ValueError, r"max_norm must be >= 0 \(got -1\)"),
    BadInput("max-norm-str", _wrap(max_norm="1.0"), TypeError, r"max_norm must be a number \(got '1\.0'\)", True),
    BadInput("max-norm-nan", _wrap(max_norm=math.nan), ValueError, r"max_norm must be >= 0 \(got nan\)", True),
    BadInput("comm-dtype-str", _wrap(communication_dtype="fp16"), TypeError, r"communication_dtype must be a floating-point torch\.dtype or None \(got 'fp16'\)", True),
    BadInput("comm-dtype-int", _wrap(communication_dtype=torch.int32), TypeError, r"communication_dtype must be .* \(got torch\.int32\)", True),
    BadInput("gc-negative", _wrap(gc_every_n_steps=-1), ValueError, r"gc_every_n_steps must be an int >= 0 \(got -1\)"),
    BadInput("gc-str", _wrap(gc_every_n_steps="50"), ValueError, r"gc_every_n_steps must be an int >= 0 \(got '50'\)"),
    BadInput("cpu-update-numel-0", _wrap(cpu_update_numel=0), ValueError, r"ZeroOptimizer: cpu_update_numel must be >= 1 \(got 0\); e\.g\. 2\*\*26", True),
    BadInput("cpu-update-numel-negative", _wrap(cpu_update_numel=-1), ValueError, r"ZeroOptimizer: cpu_update_numel must be >= 1 \(got -1\)", True),
    BadInput("cpu-update-numel-float", _wrap(cpu_update_numel=1.5), TypeError, r"ZeroOptimizer: cpu_update_numel must be an int \(got 1\.5\)", True),
    BadInput("cpu-update-numel-bool", _wrap(cpu_update_numel=True), TypeError, r"ZeroOptimizer: cpu_update_numel must be an int \(got True\)", True),
    BadInput("cpu-update-numel-str", _wrap(cpu_update_numel="x"), TypeError, r"ZeroOptimizer: cpu_update_numel must be an int \(got 'x'\)", True),
    BadInput("loss-scaler-float", _wrap(loss_scaler=1024.0), TypeError, r"ZeroOptimizer: loss_scaler must be a DynamicLossScaler or None \(got float\)", True),
    BadInput("scaler-unknown-keyword", _wrap(initial_scael=1024), TypeError, r"unknown keyword arguments \['initial_scael'\]"),
    BadInput("scaler-and-keywords", _wrap(loss_scaler=DynamicLossScaler(), hysteresis=1), TypeError, r"pass either loss_scaler or its keyword arguments \(got both: \['hysteresis'\]\)"),
    BadInput("scaler-scale-keyword", _wrap(scale=2.0), TypeError, r"unknown keyword arguments \['scale'\]"),
    BadInput("debug-collectives-str", _wrap(debug_collectives="yes"), TypeError, r"debug_collectives: enabled must be a bool or None \(got 'yes'\)"),
    # -- ZeroConfig(...) --------------------------------------------------------------------
    BadInput("config-cpu-update-numel-0", lambda env: ZeroConfig(cpu_update_numel=0), ValueError, r"ZeroOptimizer: cpu_update_numel must be >= 1 \(got 0\)", True),
    BadInput("config-cpu-update-numel-negative", lambda env: ZeroConfig(cpu_update_numel=-1), ValueError, r"cpu_update_numel must be >= 1 \(got -1\)", True),
    BadInput("config-cpu-update-numel-float", lambda env: ZeroConfig(cpu_update_numel=1.5), TypeError, r"cpu_update_numel must be an int \(got 1\.5\)", True),
    BadInput("config-cpu-update-numel-bool", lambda env: ZeroConfig(cpu_update_numel=True), TypeError, r"cpu_update_numel must be an int \(got True\)", True),
    BadInput("config-cpu-update-numel-str", lambda env: ZeroConfig(cpu_update_numel="x", api="Api"), TypeError, r"Api: cpu_update_numel must be an int \(got 'x'\)", True),
    # -- misuse ----------------------------------------------------------------------------
    BadInput("backward-float", lambda env: env["z"].backward(2.0), TypeError, r"ZeroOptimizer\.backward: loss must be a tensor \(got float\)", True),
    BadInput("clip-max-norm-zero", lambda env: env["z"].clip_grad_by_norm(0.0), ValueError, r"ZeroOptimizer\.clip_grad_by_norm: max_norm must be > 0 \(got 0\.0\)"),
    BadInput("clip-norm-type-negative", lambda env: env["z"].clip_grad_by_norm(1.0, -1), ValueError, r"ZeroOptimizer\.clip_grad_by_norm: norm_type must be > 0 or inf \(got -1\)"),
    BadInput("clip-in-no-sync", _clip_in_no_sync, RuntimeError, r"ZeroOptimizer\.clip_grad_by_norm: called inside no_sync\(\)"),
    BadInput("fp16-plain-backward", _unscaled_backward, RuntimeError, r"ZeroOptimizer\.step: fp16 gradients were not scaled; call optimizer\.backward\(loss\)", options={"dtype": torch.float16}),
    # -- load_state_dict / load_full_state_dict --------------------------------------------------
    BadInput("load-list", lambda env: env["z"].load_state_dict([]), TypeError, r"load_state_dict: the state must be a dict with \['optimizer', 'masters', 'scaler', 'layout'\] \(got list\)", True),
    BadInput("load-no-layout", _sd(lambda sd: sd.pop("layout")), TypeError, r"load_state_dict: the state must be a dict with .* \(got \['masters', 'optimizer', 'scaler'\]\)", True),
    BadInput("load-other-model", _sd(lambda sd: sd["layout"]["numels"].pop()), ValueError, r"load_state_dict: the state is for another model"),
    BadInput("load-other-world", _sd(lambda sd: sd["layout"].update(world=2)), ValueError, r"load_state_dict: saved by rank 0 of 2, this is rank 0 of 1"),
    BadInput("load-masters-count", _sd(lambda sd: sd["masters"].pop()), ValueError, r"load_state_dict: masters must be \d+ tensors .* \(got \d+, first mismatch at \[\]\)", True),
    BadInput("load-master-shape", _sd(lambda sd: sd["masters"].__setitem__(3, torch.zeros(5))), ValueError, r"load_state_dict: masters must be .* first mismatch at \[3\]\)", True),
    BadInput("load-full-empty", lambda env: env["z"].load_full_state_dict({}), TypeError, r"load_full_state_dict: the state must be a dict with \['params', 'param_groups', 'scaler', 'numels'\] \(got \[\]\)", True),
    BadInput("load-full-other-model", _sd(lambda sd: sd["numels"].pop(), full=True), ValueError, r"ZeroOptimizer\.load_full_state_dict: the state is for another model \(16 params", True),
    BadInput("load-full-master-numel", _sd(lambda sd: sd["params"][2].update(master=torch.zeros(5)), full=True), ValueError, r"load_full_state_dict: params must hold \d+ entries, .* first mismatch at \[2\]\)", True),
    # -- DynamicLossScaler ---------------------------------------------------------------------
    BadInput("scaler-initial-str", lambda env: DynamicLossScaler(initial_scale="1024"), TypeError, r"DynamicLossScaler: initial_scale must be a number \(got '1024'\)", True),
    BadInput("scaler-interval-float", lambda env: DynamicLossScaler(growth_interval=1.5), TypeError, r"DynamicLossScaler: growth_interval must be an int \(got 1\.5\)", True),
    BadInput("scaler-hysteresis-0", lambda env: DynamicLossScaler(hysteresis=0), ValueError, r"DynamicLossScaler: hysteresis must be >= 1 \(got 0\)"),
    BadInput("scaler-min-0", lambda env: DynamicLossScaler(min_scale=0), ValueError, r"min_scale must be > 0 \(got 0\)"),
    BadInput("scaler-backoff-1", lambda env: DynamicLossScaler(backoff_factor=1.0), ValueError, r"backoff_factor must be in \(0, 1\) \(got 1\.0\)"),
    BadInput("scaler-growth-1", lambda env: DynamicLossScaler(growth_factor=1), ValueError, r"growth_factor must be > 1 \(got 1\)"),
    BadInput("scaler-initial-above-max", lambda env: DynamicLossScaler(initial_scale=2.0**40), ValueError, r"initial_scale must lie in \[min_scale, max_scale\] \(got 1099511627776\.0\)"),
    BadInput("scaler-positional", lambda env: DynamicLossScaler(1024.0), TypeError, r"DynamicLossScaler\.__init__\(\) takes 1 positional argument"),
    BadInput("scaler-load-empty", lambda env: env["scaler"].load_state_dict({}), ValueError, r"DynamicLossScaler\.load_state_dict: state must hold \['clean_steps', 'hysteresis_left', 'scale'\] \(got \[\]\)", True),
    BadInput("scaler-load-negative", lambda env: env["scaler"].load_state_dict({**env["scaler"].state_dict(), "scale": -1.0}), ValueError, r"load_state_dict: scale must be a finite number > 0 \(got -1\.0\)", True),
    # -- CollectorSchedule ----------------------------------------------------------------------
    BadInput("collector-negative", lambda env: CollectorSchedule("Api", -1), ValueError, r"Api: gc_every_n_steps must be an int >= 0 \(got -1\)"),
    BadInput("collector-float", lambda env: CollectorSchedule("Api", 2.5), ValueError, r"gc_every_n_steps must be an int >= 0 \(got 2\.5\)"),
    # -- clipping and partition helpers -----------------------------------------------------------
    BadInput("clip-norm-str", lambda env: clip_coefficient("1.0", 1.0), TypeError, r"clip_coefficient: total_norm must be a number \(got '1\.0'\)", True),
    BadInput("clip-max-negative", lambda env: clip_coefficient(2.0, -1.0), ValueError, r"clip_coefficient: max_norm must be >= 0 \(got -1\.0\)", True),
    BadInput("clip-max-nan", lambda env: clip_coefficient(2.0, math.nan), ValueError, r"clip_coefficient: max_norm must be >= 0 \(got nan\)", True),
    BadInput("clip-norm-negative", lambda env: clip_coefficient(-2.0, 1.0), ValueError, r"clip_coefficient: total_norm is a norm, >= 0 \(got -2\.0\)", True),
    BadInput("grad-stats-extra-list", lambda env: grad_stats([torch.ones(3)], [1.0], None), TypeError, r"grad_stats: extra must be a tensor \(got list\)", True),
    BadInput("grad-stats-shard-float", lambda env: grad_stats([1.0], torch.ones(1), None), TypeError, r"grad_stats: shards must be tensors \(got \['float'\]\)", True),
    BadInput("shard-numel-world-0", lambda env: shard_numel(10, 0), ValueError, r"shard_numel: world must be >= 1 \(got 0\)", True),
    BadInput("shard-numel-negative", lambda env: shard_numel(-1, 2), ValueError, r"shard_numel: numel must be >= 0 \(got -1\)", True),
    BadInput("shard-numel-float", lambda env: shard_numel(10.0, 2), TypeError, r"shard_numel: numel must be an int \(got 10\.0\)", True),
    BadInput("shard-bounds-rank", lambda env: shard_bounds(10, 2, 2), ValueError, r"shard_bounds: rank must be < world \(2\) \(got 2\)", True),
]  # fmt: skip


def _stepped(env):
    opt = torch.optim.SGD(_params(env), lr=0.0, momentum=0.9)
    for p in _params(env):
        p.grad = torch.zeros_like(p)
    opt.step()  # lr 0: the parameters stay, the optimizer has state
    for p in _params(env):
        p.grad = None
    return opt


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case: BadInput) -> None:
    dtype = case.options.get("dtype", torch.float32)  # of the model the wrapper trains
    check_bad_input(case, _env(dtype), _snapshot, _still_works)


def _still_works(env: dict[str, Any]) -> None:
    """A training step moves the parameters."""
    before = _snapshot(env)["params"]
    _train_step(env, seed=2)
    assert not same_state(before, _snapshot(env)["params"])


def test_the_table_names_every_case_once() -> None:
    check_unique_ids(CASES)
