"""The bad-input matrix of gemini-placement (issue 17): the configs,
GeminiDDP, GeminiOptimizer and GeminiAdamOptimizer.

One row per bad call: the error type, a regex that names the argument (or
the misused call) and the value got, and whether this table's work added the
check (``fixed``: before it the call gave an unclear error or was accepted).
Every row also checks that the failed call changed nothing (the model's
values through ``state_dict()``, the optimizer's ``state_dict()``, the
training state, the callbacks the optimizer hooks on the model, the chunks'
bytes, a spare plain model) and that a training step still works afterwards.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

from zerostack.fused_adam import HybridAdam
from zerostack.gemini import (
    AutoPlacementConfig,
    ChunkConfig,
    GeminiAdamOptimizer,
    GeminiConfig,
    GeminiDDP,
    GeminiOptimizer,
    MixedPrecision,
    StaticPlacementConfig,
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
TABLE = {1: {"chunk_size": 4096}}
BASE = dict(mixed_precision=torch.float32, chunk_config_dict=TABLE, compute_device="cpu")


def _build(dtype: torch.dtype) -> tuple[GeminiDDP, GeminiOptimizer]:
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(model, **{**BASE, "mixed_precision": dtype})
    return ddp, _optimizer(ddp)


def _optimizer(ddp: GeminiDDP) -> GeminiOptimizer:
    # gc_every_n_steps=0: a schedule's first step runs a full collection (slow).
    # fp16: a small initial scale, so that the steps of the test are not skipped.
    scale = {"initial_scale": 2.0**8} if ddp.mixed_precision == torch.float16 else {}
    return GeminiOptimizer(HybridAdam(_params(ddp), lr=1e-2), ddp, gc_every_n_steps=0, **scale)


def _params(ddp: GeminiDDP) -> list[torch.Tensor]:
    return list(ddp.module.parameters())


def _train_step(env: dict[str, Any], seed: int = 0) -> None:
    idx, tgt = make_batch(CONFIG, 2, 8, seed=seed)
    env["opt"].backward(env["ddp"](idx, tgt).float())
    assert env["opt"].step()


def _env(dtype: torch.dtype) -> dict[str, Any]:
    ddp, opt = _build(dtype)
    env = {"ddp": ddp, "opt": opt, "plain": TinyGPT(CONFIG)}
    _train_step(env)
    return env


def _snapshot(env: dict[str, Any]) -> Any:
    ddp, opt = env["ddp"], env["opt"]
    return copy.deepcopy(
        {
            "model": ddp.state_dict(),
            "opt": opt.state_dict(),
            "training_state": ddp.training_state,
            "step": id(ddp.step_pipeline),
            "mem": dict(ddp.chunk_manager.total_mem),
            "plain": [p.detach().clone() for p in env["plain"].parameters()],
        }
    )


def _ddp(**kwargs):
    return lambda env: GeminiDDP(env["plain"], **{**BASE, **kwargs})


def _opt(inner=None, module=None, **kwargs):
    def call(env):
        ddp = env["ddp"] if module is None else module(env)
        optimizer = HybridAdam(_params(env["ddp"])) if inner is None else inner(env)
        return GeminiOptimizer(optimizer, ddp, **kwargs)

    return call


def _stepped(env):
    """An optimizer that loaded a checkpoint (of a plain model's steps)
    before the wrap, as a resumed script does."""
    saved = torch.optim.SGD(env["plain"].parameters(), lr=0.0, momentum=0.9)
    for p in env["plain"].parameters():
        p.grad = torch.zeros_like(p)
    saved.step()  # lr 0: the parameters stay, the optimizer has state
    env["plain"].zero_grad()
    opt = torch.optim.SGD(_params(env["ddp"]), lr=0.0, momentum=0.9)
    opt.load_state_dict(saved.state_dict())
    return opt


def _close(env):
    env["opt"].close()


def _reopen(env):
    env["opt"] = _optimizer(env["ddp"])


def _model_sd(edit):
    def call(env):
        sd = {k: v + 1 for k, v in env["ddp"].state_dict().items()}  # a change on every entry
        edit(sd)
        env["ddp"].load_state_dict(sd)

    return call


def _full_sd(edit):
    def call(env):
        full = copy.deepcopy(env["opt"].full_state_dict())
        for entry in full["params"].values():
            entry["master"] = entry["master"] + 1
        edit(full)
        env["opt"].load_full_state_dict(full)

    return call


def _last_param(sd):
    return sorted(sd)[-1]


def _last_loaded(sd):
    return list(sd)[-1]  # the others would be loaded before it without the checks first


def _forward(env):
    idx, tgt = make_batch(CONFIG, 2, 8, seed=1)
    return env["ddp"](idx, tgt)


def _forward_backward(env):
    env["opt"].backward(_forward(env))


def _unscaled_backward(env):
    idx, tgt = make_batch(CONFIG, 2, 8, seed=1)
    env["ddp"](idx, tgt).float().backward()  # not env["opt"].backward(loss)
    env["opt"].step()


def _finish_pending_step(env):
    env["opt"].step()


def _no_sync(env):
    with env["ddp"].no_sync():
        pass


def _meta_model(env):
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    GeminiDDP(model, **BASE)


CASES = [
    # -- configs -------------------------------------------------------------------------
    BadInput("static-frac-str", lambda env: StaticPlacementConfig(shard_param_frac="1"), TypeError, r"GeminiDDP: shard_param_frac must be a number \(got '1'\)", True),
    BadInput("static-frac-1.5", lambda env: StaticPlacementConfig(offload_optim_frac=1.5), ValueError, r"offload_optim_frac must be in \[0, 1\] \(got 1\.5\)"),
    BadInput("static-frac-negative", lambda env: StaticPlacementConfig(offload_param_frac=-0.1), ValueError, r"offload_param_frac must be in \[0, 1\] \(got -0\.1\)"),
    BadInput("static-frac-nan", lambda env: StaticPlacementConfig(shard_param_frac=math.nan), ValueError, r"shard_param_frac must be in \[0, 1\] \(got nan\)"),
    BadInput("auto-prefetch-negative", lambda env: AutoPlacementConfig(max_prefetch=-1), ValueError, r"max_prefetch must be >= 0 \(got -1\)"),
    BadInput("auto-prefetch-float", lambda env: AutoPlacementConfig(max_prefetch=1.5), TypeError, r"max_prefetch must be an int \(got 1\.5\)", True),
    BadInput("auto-capacity-0", lambda env: AutoPlacementConfig(gpu_capacity_bytes=0), ValueError, r"gpu_capacity_bytes must be > 0 \(got 0\)"),
    BadInput("auto-capacity-str", lambda env: AutoPlacementConfig(gpu_capacity_bytes="1GB"), TypeError, r"gpu_capacity_bytes must be an int \(got '1GB'\)", True),
    BadInput("auto-ratio-2", lambda env: AutoPlacementConfig(warmup_non_model_data_ratio=2), ValueError, r"warmup_non_model_data_ratio must be in \[0, 1\] \(got 2\)"),
    BadInput("auto-ratio-str", lambda env: AutoPlacementConfig(steady_cuda_cap_ratio="0.9"), TypeError, r"steady_cuda_cap_ratio must be a number \(got '0\.9'\)", True),
    BadInput("chunk-range-negative", lambda env: ChunkConfig(search_range_m=-1), ValueError, r"search_range_m and min_chunk_size_m must be >= 0 \(got -1, 32\)"),
    BadInput("chunk-range-str", lambda env: ChunkConfig(search_range_m="32"), TypeError, r"search_range_m must be a number \(got '32'\)", True),
    BadInput("chunk-hidden-dim-0", lambda env: ChunkConfig(hidden_dim=0), ValueError, r"hidden_dim must be >= 1 or None \(got 0\)", True),
    BadInput("chunk-hidden-dim-float", lambda env: ChunkConfig(hidden_dim=64.0), TypeError, r"hidden_dim must be an int \(got 64\.0\)", True),
    BadInput("chunk-dict-list", lambda env: ChunkConfig(chunk_config_dict=[4096]), TypeError, r"chunk_config_dict must be a dict .* or None \(got \[4096\]\)", True),
    BadInput("chunk-dict-entry-int", lambda env: ChunkConfig(chunk_config_dict={1: 4096}), TypeError, r"chunk_config_dict\[1\] must be a dict with chunk_size \(got 4096\)", True),
    BadInput("chunk-dict-unknown-key", lambda env: ChunkConfig(chunk_config_dict={1: {"size": 3}}), ValueError, r"chunk_config_dict\[1\] must hold chunk_size .* \(got keys \['size'\]\)"),
    BadInput("chunk-dict-size-0", lambda env: ChunkConfig(chunk_config_dict={1: {"chunk_size": 0}}), ValueError, r"chunk_config_dict\[1\]\['chunk_size'\] must be an int >= 1 \(got 0\)", True),
    BadInput("chunk-dict-size-str", lambda env: ChunkConfig(chunk_config_dict={1: {"chunk_size": "4096"}}), ValueError, r"chunk_config_dict\[1\]\['chunk_size'\] must be an int >= 1 \(got '4096'\)", True),
    BadInput("chunk-dict-keep-str", lambda env: ChunkConfig(chunk_config_dict={1: {"chunk_size": 8, "keep_gathered": "no"}}), TypeError, r"chunk_config_dict\[1\]\['keep_gathered'\] must be a bool \(got 'no'\)", True),
    BadInput("chunk-pin-str", lambda env: ChunkConfig(pin_memory="yes"), TypeError, r"pin_memory must be a bool \(got 'yes'\)", True),
    BadInput("precision-float64", lambda env: MixedPrecision(param_dtype=torch.float64), ValueError, r"mixed_precision must be float16, bfloat16 or float32 \(got torch\.float64\)"),
    BadInput("precision-str", lambda env: MixedPrecision(param_dtype="float16"), TypeError, r"mixed_precision must be float16, bfloat16 or float32, a torch\.dtype \(got 'float16'\)", True),
    BadInput("precision-cast-int", lambda env: MixedPrecision(cast_forward_inputs=1), TypeError, r"cast_forward_inputs must be a bool \(got 1\)", True),
    BadInput("config-placement-str", lambda env: GeminiConfig(placement="static"), TypeError, r"placement must be a StaticPlacementConfig or AutoPlacementConfig \(got str\)"),
    BadInput("config-chunk-dict", lambda env: GeminiConfig(chunk={"search_range_m": 1}), TypeError, r"GeminiDDP: chunk must be a ChunkConfig \(got dict\)", True),
    BadInput("config-precision-dtype", lambda env: GeminiConfig(precision=torch.float16), TypeError, r"GeminiDDP: precision must be a MixedPrecision \(got dtype\)", True),
    BadInput("config-async-str", lambda env: GeminiConfig(enable_async_reduce="yes"), TypeError, r"enable_async_reduce must be a bool \(got 'yes'\)", True),
    BadInput("kwargs-policy", lambda env: GeminiConfig.from_kwargs(placement_policy="const"), ValueError, r"placement_policy must be 'static' or 'auto'.* \(got 'const'\)"),
    BadInput("kwargs-master-weights", lambda env: GeminiConfig.from_kwargs(master_weights=False), NotImplementedError, r"master_weights=False .* is not implemented"),
    BadInput("kwargs-auto-static-frac", lambda env: GeminiConfig.from_kwargs(placement_policy="auto", offload_optim_frac=0.5), ValueError, r"shard_param_frac, offload_optim_frac and offload_param_frac are for placement_policy='static'"),
    # -- GeminiDDP(...) ---------------------------------------------------------------------
    BadInput("ddp-config-str", lambda env: GeminiDDP(env["plain"], "static"), TypeError, r"GeminiDDP: config must be a GeminiConfig or None \(got str\)", True),
    BadInput("ddp-config-and-keywords", lambda env: GeminiDDP(env["plain"], GeminiConfig(), max_prefetch=1), TypeError, r"pass either config or keyword settings \(got both: \['max_prefetch'\]\)"),
    BadInput("ddp-unknown-keyword", _ddp(offload_fraction=0.5), TypeError, r"unexpected keyword argument 'offload_fraction'"),
    BadInput("ddp-module-list", lambda env: GeminiDDP([env["plain"]], **BASE), TypeError, r"GeminiDDP: module must be an nn\.Module \(got list\)", True),
    BadInput("ddp-wrap-a-wrapper", lambda env: GeminiDDP(env["ddp"], **BASE), TypeError, r"GeminiDDP: the module is a GeminiDDP already", True),
    BadInput("ddp-wrap-twice", lambda env: GeminiDDP(env["ddp"].module, **BASE), RuntimeError, r"GeminiDDP: the module is wrapped by another GeminiDDP already \(got TinyGPT\)", True),
    BadInput("ddp-device-bogus", _ddp(compute_device="gpu"), ValueError, r"GeminiDDP: compute_device is not a device \(got 'gpu'\)", True),
    BadInput("ddp-device-meta", _ddp(compute_device="meta"), ValueError, r"GeminiDDP: compute_device cannot be meta \(got 'meta'\)", True),
    BadInput("ddp-device-int", _ddp(compute_device=0), TypeError, r"GeminiDDP: compute_device must be a torch\.device, str or None \(got 0\)", True),
    BadInput("ddp-dtype-float64", _ddp(mixed_precision=torch.float64), ValueError, r"mixed_precision must be float16, bfloat16 or float32 \(got torch\.float64\)"),
    BadInput("ddp-frac-1.5", _ddp(offload_optim_frac=1.5), ValueError, r"offload_optim_frac must be in \[0, 1\] \(got 1\.5\)"),
    BadInput("ddp-no-entry-for-world", _ddp(chunk_config_dict={2: {"chunk_size": 4096}}), ValueError, r"chunk_config_dict has no entry for the data-parallel size 1 \(got keys \[2\]\)"),
    BadInput("ddp-auto-without-capacity", _ddp(placement_policy="auto"), ValueError, r"placement_policy='auto' on a cpu compute device needs gpu_capacity_bytes"),
    BadInput("ddp-meta-not-lazy", _meta_model, ValueError, r"the model was not built under LazyInitContext \(got Linear\)"),
    BadInput("ddp-debug-str", _ddp(debug_collectives="on"), TypeError, r"debug_collectives: enabled must be a bool or None \(got 'on'\)"),
    # -- GeminiDDP misuse -----------------------------------------------------------------------
    BadInput("ddp-forward-before-step", _forward, RuntimeError, r"GeminiDDP\.forward: the reduced gradients .*; call optimizer\.step\(\) before the next forward", options={"prepare": _forward_backward, "after": _finish_pending_step}),
    BadInput("ddp-no-sync-off", _no_sync, RuntimeError, r"GeminiDDP\.no_sync: build GeminiDDP with enable_gradient_accumulation=True"),
    BadInput("ddp-load-list", lambda env: env["ddp"].load_state_dict([]), TypeError, r"GeminiDDP\.load_state_dict: state_dict must be a dict of tensors \(got list\)", True),
    BadInput("ddp-load-missing", _model_sd(lambda sd: sd.pop(_last_param(sd))), KeyError, r"load_state_dict: missing \['tok_emb\.weight'\], unexpected \[\]"),
    BadInput("ddp-load-shape", _model_sd(lambda sd: sd.__setitem__(_last_loaded(sd), torch.zeros(3))), ValueError, r"load_state_dict: lm_head\.weight has shape \(3,\), the model's is \(256, 16\)", True),
    BadInput("ddp-load-not-tensor", _model_sd(lambda sd: sd.__setitem__(_last_loaded(sd), [0.0])), TypeError, r"load_state_dict: lm_head\.weight must be a tensor \(got list\)", True),
    # -- GeminiOptimizer(...) --------------------------------------------------------------------
    BadInput("opt-inner-list", _opt(inner=lambda env: _params(env["ddp"])), TypeError, r"GeminiOptimizer: optimizer must be a torch\.optim\.Optimizer \(got list\)", True),
    BadInput("opt-wrap-a-wrapper", _opt(inner=lambda env: env["opt"]), TypeError, r"GeminiOptimizer: the optimizer is a GeminiOptimizer already", True),
    BadInput("opt-inner-twice", _opt(inner=lambda env: env["opt"].optimizer), RuntimeError, r"GeminiOptimizer: this optimizer is wrapped by a GeminiOptimizer already", True),
    BadInput("opt-module-plain", _opt(module=lambda env: env["plain"]), TypeError, r"GeminiOptimizer: module must be the GeminiDDP model \(got TinyGPT\)", True),
    BadInput("opt-second-on-model", _opt(), RuntimeError, r"GeminiOptimizer: the model has a GeminiOptimizer already; one optimizer per GeminiDDP", True),
    BadInput("opt-missing-params", _opt(inner=lambda env: HybridAdam(_params(env["ddp"])[:2])), ValueError, r"the optimizer lacks parameters of the module \(got none for \[", options={"prepare": _close, "after": _reopen}),
    BadInput("opt-stepped", _opt(inner=lambda env: _stepped(env)), ValueError, r"GeminiOptimizer: the optimizer already has state \(got state for \d+ tensors, from a step or optimizer\.load_state_dict before the wrap\), which the master chunks would drop; wrap a fresh optimizer .*booster\.load_optimizer", True, options={"prepare": _close, "after": _reopen}),
    BadInput("opt-user-add-group", lambda env: env["opt"]._user.add_param_group({"params": [nn.Parameter(torch.zeros(3))]}), NotImplementedError, r"HybridAdam\.add_param_group: this optimizer was handed to GeminiOptimizer \(through booster\.boost or directly\), whose master chunks its one group steps; a group added now would never be stepped \(got a group of 1 tensors\)", True),
    BadInput("opt-two-groups", _opt(inner=lambda env: HybridAdam([{"params": _params(env["ddp"])[:2]}, {"params": _params(env["ddp"])[2:]}])), NotImplementedError, r"GeminiOptimizer: 2 parameter groups; .*\(got groups of \[2, \d+\] tensors\); put every parameter in one group .*or use LowLevelZeroPlugin", options={"prepare": _close, "after": _reopen}),
    BadInput("opt-max-norm-negative", _opt(max_norm=-1.0), ValueError, r"GeminiOptimizer: max_norm must be >= 0 \(got -1\.0\)", options={"prepare": _close, "after": _reopen}),
    BadInput("opt-max-norm-str", _opt(max_norm="1"), TypeError, r"GeminiOptimizer: max_norm must be a number \(got '1'\)", True, options={"prepare": _close, "after": _reopen}),
    BadInput("opt-max-norm-nan", _opt(max_norm=math.nan), ValueError, r"GeminiOptimizer: max_norm must be >= 0 \(got nan\)", True, options={"prepare": _close, "after": _reopen}),
    BadInput("opt-overlap-str", _opt(overlap_cpu_step="no"), TypeError, r"GeminiOptimizer: overlap_cpu_step must be a bool \(got 'no'\)", True, options={"prepare": _close, "after": _reopen}),
    BadInput("opt-loss-scaler-float", _opt(loss_scaler=1024.0), TypeError, r"GeminiOptimizer: loss_scaler must be a DynamicLossScaler or None \(got float\)", True, options={"prepare": _close, "after": _reopen}),
    BadInput("opt-scaler-unknown-keyword", _opt(initial_scael=2.0), TypeError, r"GeminiOptimizer: unknown keyword arguments \['initial_scael'\]", options={"prepare": _close, "after": _reopen}),
    BadInput("opt-gc-negative", _opt(gc_every_n_steps=-1), ValueError, r"GeminiOptimizer: gc_every_n_steps must be an int >= 0 \(got -1\)", options={"prepare": _close, "after": _reopen}),
    # -- GeminiOptimizer misuse -------------------------------------------------------------------
    BadInput("opt-step-before-backward", lambda env: env["opt"].step(), RuntimeError, r"GeminiOptimizer\.step: the model is in state AWAIT_BACKWARD; step after a backward", options={"prepare": _forward}),
    BadInput("opt-fp16-plain-backward", _unscaled_backward, RuntimeError, r"GeminiOptimizer\.step: fp16 gradients were not scaled; call optimizer\.backward\(loss\)", options={"dtype": torch.float16}),
    BadInput("opt-backward-float", lambda env: env["opt"].backward(2.0), TypeError, r"GeminiOptimizer\.backward: loss must be a tensor \(got float\)", True),
    BadInput("opt-clip-max-norm-zero", lambda env: env["opt"].clip_grad_by_norm(0.0), ValueError, r"GeminiOptimizer\.clip_grad_by_norm: max_norm must be > 0 \(got 0\.0\)"),
    BadInput("opt-clip-norm-type-str", lambda env: env["opt"].clip_grad_by_norm(1.0, "l2"), TypeError, r"GeminiOptimizer\.clip_grad_by_norm: norm_type must be a number or 'inf' \(got 'l2'\)"),
    BadInput("opt-clip-before-backward", lambda env: env["opt"].clip_grad_by_norm(1.0), RuntimeError, r"GeminiOptimizer\.clip_grad_by_norm: the model is in state IDLE; clip after a backward"),
    BadInput("opt-closed-step", lambda env: env["opt"].step(), RuntimeError, r"GeminiOptimizer\.step: the optimizer is closed", True, options={"prepare": _close, "after": _reopen}),
    BadInput("opt-closed-backward", lambda env: env["opt"].backward(torch.zeros((), requires_grad=True)), RuntimeError, r"GeminiOptimizer\.backward: the optimizer is closed", True, options={"prepare": _close, "after": _reopen}),
    BadInput("opt-closed-load", lambda env: env["opt"].load_state_dict(env["opt"].state_dict()), RuntimeError, r"GeminiOptimizer\.load_state_dict: the optimizer is closed", True, options={"prepare": _close, "after": _reopen}),
    BadInput("opt-load-empty", lambda env: env["opt"].load_state_dict({}), TypeError, r"GeminiOptimizer\.load_state_dict: the state must be a dict with \['optimizer', 'scaler'\] \(got \[\]\)", True),
    BadInput("opt-load-inner-lr", lambda env: env["opt"].load_state_dict({"optimizer": _edited_inner(env), "scaler": None}), ValueError, r"HybridAdam\.load_state_dict: lr must be >= 0 \(got -1\.0\)", True),
    BadInput("opt-load-full-list", lambda env: env["opt"].load_full_state_dict([]), TypeError, r"GeminiOptimizer\.load_full_state_dict: the state must be a dict with \['params', 'param_group', 'scaler'\] \(got list\)", True),
    BadInput("opt-load-full-missing", _full_sd(lambda full: full["params"].pop("lm_head.weight")), KeyError, r"load_full_state_dict: no state for \['lm_head\.weight'\]"),
    BadInput("opt-load-full-numel", _full_sd(lambda full: full["params"]["lm_head.weight"].update(exp_avg=torch.zeros(5))), ValueError, r"load_full_state_dict: lm_head\.weight has 5 elements in the state.*, 4096 in the model", True),
    # -- GeminiAdamOptimizer --------------------------------------------------------------------------
    BadInput("adam-module-plain", lambda env: GeminiAdamOptimizer(env["plain"]), TypeError, r"GeminiAdamOptimizer: module must be the GeminiDDP model \(got TinyGPT\)", True),
    BadInput("adam-lr-negative", lambda env: GeminiAdamOptimizer(env["ddp"], lr=-1.0), ValueError, r"HybridAdam: lr must be >= 0 \(got -1\.0\)"),
    BadInput("adam-betas-float", lambda env: GeminiAdamOptimizer(env["ddp"], betas=0.9), TypeError, r"HybridAdam: betas must be a pair of numbers \(got 0\.9\)", True),
    BadInput("adam-second-on-model", lambda env: GeminiAdamOptimizer(env["ddp"]), RuntimeError, r"GeminiOptimizer: the model has a GeminiOptimizer already", True),
]  # fmt: skip


def _edited_inner(env):
    sd = copy.deepcopy(env["opt"].optimizer.state_dict())
    sd["param_groups"][0]["lr"] = -1.0
    return sd


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case: BadInput) -> None:
    # options: "dtype" of the wrapped model (default float32), "prepare" runs
    # before the snapshot, "after" is what a user does next.
    env = _env(case.options.get("dtype", torch.float32))
    prepare, after = case.options.get("prepare"), case.options.get("after")
    if prepare is not None:
        prepare(env)

    def still_works(env: dict[str, Any]) -> None:  # after the case's own clean-up
        if after is not None:
            after(env)
        before = env["ddp"].state_dict()
        _train_step(env, seed=2)
        assert not same_state(before, env["ddp"].state_dict())

    check_bad_input(case, env, _snapshot, still_works)


def test_the_table_names_every_case_once() -> None:
    check_unique_ids(CASES)


def test_a_parameter_frozen_when_wrapped_and_unfrozen_later_is_refused_at_forward():
    """It has no fp32 master and no gradient hook: trained as before it was
    silently not (1.4e-2 off torch at the first step after unfreezing)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[0].weight.requires_grad_(False)
    ddp = GeminiDDP(model, mixed_precision=torch.float32, compute_device="cpu")
    ddp(torch.randn(2, 4))  # frozen: fine
    model[0].weight.requires_grad_(True)
    with pytest.raises(NotImplementedError, match=r"GeminiDDP: parameters frozen when the model was wrapped cannot be unfrozen \(got requires_grad=True on \['0\.weight'\]\)"):  # fmt: skip
        ddp(torch.randn(2, 4))
