"""Bad inputs to the Booster API: each case raises the right error, names
the argument, and changes nothing (the boosted model's parameters and its
optimizer's state); a training step still works afterwards. See
docs/reliability.md."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerostack.booster import (
    Booster,
    CheckpointCorruptError,
    DeepSpeedConfigError,
    GeminiPlugin,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
)
from zerostack.fused_adam import HybridAdam
from zerostack.testing import (
    BadInput,
    GPTConfig,
    TinyGPT,
    check_bad_input,
    check_unique_ids,
    make_batch,
    one_torch_thread,
)

CONFIG = GPTConfig(bias=False, vocab_size=64, dim=16, max_seq_len=16, num_layers=1)


@pytest.fixture
def env(tmp_path) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    booster = Booster(device="cpu")
    boosted, opt, *_ = booster.boost(model, HybridAdam(model.parameters(), lr=1e-2))
    _step(booster, boosted, opt)
    plain = TinyGPT(CONFIG)
    (tmp_path / "a-file").write_text("x")
    booster.save_model(boosted, tmp_path / "model.pt")
    booster.save_model(boosted, tmp_path / "model-dir", shard=True)
    (tmp_path / "model-dir" / "zerostack-checkpoint.json").unlink(missing_ok=True)  # lost
    return {
        "booster": booster, "model": boosted, "opt": opt, "tmp": tmp_path, "plain": plain,
        "plain_opt": HybridAdam(plain.parameters()), "model-as-text": "model", "sched": "sched",
    }  # fmt: skip


def _step(booster, model, opt, seed=0):
    idx, tgt = make_batch(CONFIG, 2, 8, seed=seed)
    booster.backward(model(idx, tgt), opt)
    opt.step()
    opt.zero_grad()


def _snapshot(env):
    return {
        "params": [p.detach().clone() for p in env["model"].unwrap().parameters()],
        "state": env["opt"].full_state_dict(),
        "plain": [p.detach().clone() for p in env["plain"].parameters()],
        "files": sorted(p.name for p in env["tmp"].iterdir()),
    }


def _still_works(env):
    before = [p.detach().clone() for p in env["model"].unwrap().parameters()]
    _step(env["booster"], env["model"], env["opt"], seed=1)
    after = list(env["model"].unwrap().parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def _boost(*args):
    return lambda env: env["booster"].boost(*[env.get(a, a) for a in args])


def _b(method, *args, **kwargs):
    def call(env):
        resolved = [env[a] if isinstance(a, str) and a in env else a for a in args]
        resolved = [
            env["tmp"] / a[1:] if isinstance(a, str) and a.startswith("/") else a for a in resolved
        ]
        return getattr(env["booster"], method)(*resolved, **kwargs)

    return call


def _scheduler(env):
    return torch.optim.lr_scheduler.StepLR(env["plain_opt"], 1)


# fmt: off
CASES = [
    # -- Booster(...) ----------------------------------------------------------------------
    BadInput("booster-device-list", lambda env: Booster(device=["cpu"]), TypeError, r"Booster: device must be a str, an int, a torch\.device or None \(got \['cpu'\]\)", True),
    BadInput("booster-device-bogus", lambda env: Booster(device="gpu"), ValueError, r"Booster: device is not a usable device \(got 'gpu'\)", True),
    BadInput("booster-mixed-precision-int", lambda env: Booster(mixed_precision=16), TypeError, r"mixed_precision must be 'fp16', 'bf16', a MixedPrecision or None \(got int\)"),
    BadInput("booster-mixed-precision-fp8", lambda env: Booster(mixed_precision="fp8"), NotImplementedError, r"mixed_precision='fp8' is not implemented"),
    BadInput("booster-plugin-str", lambda env: Booster(plugin="gemini"), TypeError, r"Booster: plugin must be a Plugin \(got str\)"),
    # -- boost(...) ------------------------------------------------------------------------
    BadInput("boost-model-str", _boost("model-as-text"), TypeError, r"Booster\.boost: model must be an nn\.Module \(got str\)", True),
    BadInput("boost-model-none", lambda env: env["booster"].boost(None), TypeError, r"model must be an nn\.Module \(got NoneType\)", True),
    BadInput("boost-optimizer-str", _boost("plain", "adam"), TypeError, r"optimizer must be a torch\.optim\.Optimizer or None \(got str\)", True),
    BadInput("boost-criterion-str", _boost("plain", "plain_opt", "mse"), TypeError, r"criterion must be callable or None \(got str\)", True),
    BadInput("boost-scheduler-str", _boost("plain", "plain_opt", None, None, "cosine"), TypeError, r"lr_scheduler must be a torch lr scheduler or None \(got str\)", True),
    BadInput("boost-optimizer-of-another-model", lambda env: env["booster"].boost(env["plain"], HybridAdam([*TinyGPT(CONFIG).parameters()][:1])), ValueError, r"the optimizer holds parameters that are not the model's \(got 1 of 1 foreign; their number or shapes differ"),
    # -- plugins ---------------------------------------------------------------------------
    BadInput("low-level-zero-stage-3", lambda env: LowLevelZeroPlugin(stage=3), NotImplementedError, r"LowLevelZeroPlugin: stage 3 .* \(got stage=3\)"),
    BadInput("low-level-zero-stage-str", lambda env: LowLevelZeroPlugin(stage="2"), ValueError, r"stage must be 1 or 2 \(got '2'\)"),
    BadInput("low-level-zero-precision", lambda env: LowLevelZeroPlugin(precision="fp8"), ValueError, r"precision must be 'fp16', 'bf16' or 'fp32' \(got 'fp8'\)"),
    BadInput("low-level-zero-cpu-offload-str", lambda env: LowLevelZeroPlugin(cpu_offload="yes"), TypeError, r"LowLevelZeroPlugin: cpu_offload must be a bool \(got 'yes'\)", True),
    BadInput("low-level-zero-gpu-fraction", lambda env: LowLevelZeroPlugin(cpu_offload=True, gpu_update_fraction=2), ValueError, r"LowLevelZeroPlugin: gpu_update_fraction must be in \[0, 1\] \(got 2\)", True),
    BadInput("low-level-zero-cpu-update-numel-0", lambda env: LowLevelZeroPlugin(cpu_offload=True, cpu_update_numel=0), ValueError, r"LowLevelZeroPlugin: cpu_update_numel must be >= 1 \(got 0\)", True),
    BadInput("low-level-zero-cpu-update-numel-float", lambda env: LowLevelZeroPlugin(cpu_offload=True, cpu_update_numel=1.5), TypeError, r"LowLevelZeroPlugin: cpu_update_numel must be an int \(got 1\.5\)", True),
    BadInput("low-level-zero-max-norm-negative", lambda env: LowLevelZeroPlugin(max_norm=-1.0), ValueError, r"max_norm must be >= 0 \(got -1\.0\)"),
    BadInput("low-level-zero-growth-interval-0", lambda env: LowLevelZeroPlugin(growth_interval=0), ValueError, r"LowLevelZeroPlugin: growth_interval must be >= 1 \(got 0\)"),
    BadInput("gemini-gpu-fraction", lambda env: GeminiPlugin(gpu_update_fraction=-1), ValueError, r"GeminiPlugin: gpu_update_fraction must be in \[0, 1\] \(got -1\)"),
    BadInput("gemini-min-scale-0", lambda env: GeminiPlugin(min_scale=0), ValueError, r"GeminiPlugin: min_scale must be > 0 \(got 0\)"),
    BadInput("low-level-zero-max-norm-str", lambda env: LowLevelZeroPlugin(max_norm="1"), TypeError, r"LowLevelZeroPlugin: max_norm must be a number \(got '1'\)", True),
    BadInput("low-level-zero-unknown-keyword", lambda env: LowLevelZeroPlugin(offload=True), TypeError, r"unexpected keyword argument 'offload'"),
    BadInput("gemini-precision", lambda env: GeminiPlugin(precision="fp8"), ValueError, r"GeminiPlugin: precision must be 'fp16', 'bf16' or 'fp32' \(got 'fp8'\)"),
    BadInput("gemini-placement-policy", lambda env: GeminiPlugin(placement_policy="const"), ValueError, r"placement_policy must be 'static' or 'auto'.* \(got 'const'\)"),
    BadInput("gemini-offload-optim-frac", lambda env: GeminiPlugin(offload_optim_frac=2.0), ValueError, r"offload_optim_frac must be in \[0, 1\] \(got 2\.0\)"),
    BadInput("gemini-max-norm-str", lambda env: GeminiPlugin(max_norm="1"), TypeError, r"GeminiPlugin: max_norm must be a number \(got '1'\)", True),
    BadInput("gemini-unknown-keyword", lambda env: GeminiPlugin(offload=True), TypeError, r"unexpected keyword argument 'offload'"),
    BadInput("deepspeed-config-list", lambda env: LowLevelZeroPlugin.from_deepspeed_config([{"zero_optimization": {"stage": 2}}]), TypeError, r"from_deepspeed_config: (the )?config must be a dict.*\(got list\)"),
    BadInput("deepspeed-config-every-problem", lambda env: LowLevelZeroPlugin.from_deepspeed_config({"zero_optimization": {"stage": 3}, "fp16": {"enabled": True, "loss_scale": 128}}), DeepSpeedConfigError, r"2 key\(s\) of the DeepSpeed config cannot be honoured \(got a dict\)(.|\n)*stage 3 (.|\n)*fp16.loss_scale can only be 0 \(got 128\)", True),
    BadInput("deepspeed-config-batch-mismatch", lambda env: LowLevelZeroPlugin.from_deepspeed_config({"zero_optimization": {"stage": 2}, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 3}), DeepSpeedConfigError, r"train_batch_size must equal .*\(got train_batch_size=8, train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=2 \(derived\), world size 1\)", True),
    BadInput("deepspeed-prepare-dataloader-batch-size", lambda env: LowLevelZeroPlugin.from_deepspeed_config({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4}).prepare_dataloader(list(range(8)), batch_size=8), ValueError, r"prepare_dataloader: batch_size differs from the DeepSpeed config's micro batch size per rank \(got batch_size=8, train_batch_size not given, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps not given", True),
    BadInput("deepspeed-boost-second-optimizer", lambda env: Booster(plugin=LowLevelZeroPlugin.from_deepspeed_config({"zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})).boost(env["plain"], env["plain_opt"]), ValueError, r"Booster\.boost: the DeepSpeed config has an optimizer section and boost got an optimizer too \(got HybridAdam\)", True),
    BadInput("torch-ddp-unknown-keyword", lambda env: TorchDDPPlugin(foo=1), TypeError, r"unexpected keyword argument 'foo'"),
    # -- backward, no_sync -----------------------------------------------------------------
    BadInput("backward-loss-float", _b("backward", 1.0, "opt"), TypeError, r"Booster\.backward: loss must be a tensor \(got float\)", True),
    BadInput("backward-optimizer-not-boosted", _b("backward", torch.zeros(()), "plain_opt"), TypeError, r"Booster\.backward: optimizer must be the one boost returned \(got HybridAdam\)"),
    BadInput("no-sync-model-not-boosted", lambda env: env["booster"].no_sync(env["plain"]).__enter__(), ValueError, r"no_sync: pass the boosted model \(got TinyGPT\)"),
    # -- clip_grad_norm_ (between a backward and the step) ---------------------------------
    BadInput("clip-max-norm-zero", _b("clip_grad_norm_", "model", "opt", 0.0), ValueError, r"Booster\.clip_grad_norm_: max_norm must be > 0 \(got 0\.0\); torch's clip_grad_norm_ would zero every gradient"),
    BadInput("clip-max-norm-negative", _b("clip_grad_norm_", "model", "opt", -1.0), ValueError, r"max_norm must be > 0 \(got -1\.0\)"),
    BadInput("clip-max-norm-nan", _b("clip_grad_norm_", "model", "opt", float("nan")), ValueError, r"max_norm must be > 0 \(got nan\)"),
    BadInput("clip-max-norm-str", _b("clip_grad_norm_", "model", "opt", "1.0"), TypeError, r"Booster\.clip_grad_norm_: max_norm must be a number \(got '1\.0'\)"),
    BadInput("clip-max-norm-none", _b("clip_grad_norm_", "model", "opt", None), TypeError, r"max_norm must be a number \(got None\)"),
    BadInput("clip-norm-type-zero", _b("clip_grad_norm_", "model", "opt", 1.0, norm_type=0), ValueError, r"norm_type must be > 0 or inf \(got 0\)"),
    BadInput("clip-norm-type-negative", _b("clip_grad_norm_", "model", "opt", 1.0, norm_type=-2.0), ValueError, r"norm_type must be > 0 or inf \(got -2\.0\)"),
    BadInput("clip-norm-type-str", _b("clip_grad_norm_", "model", "opt", 1.0, norm_type="l2"), TypeError, r"norm_type must be a number or 'inf' \(got 'l2'\)"),
    BadInput("clip-norm-type-bool", _b("clip_grad_norm_", "model", "opt", 1.0, norm_type=True), TypeError, r"norm_type must be a number or 'inf' \(got True\)"),
    BadInput("clip-error-if-nonfinite-str", _b("clip_grad_norm_", "model", "opt", 1.0, error_if_nonfinite="yes"), TypeError, r"error_if_nonfinite must be a bool \(got 'yes'\)"),
    BadInput("clip-model-not-boosted", _b("clip_grad_norm_", "plain", "opt", 1.0), TypeError, r"Booster\.clip_grad_norm_: model must be the one boost returned \(got TinyGPT\)"),
    BadInput("clip-optimizer-not-boosted", _b("clip_grad_norm_", "model", "plain_opt", 1.0), TypeError, r"clip_grad_norm_: optimizer must be the one boost returned \(got HybridAdam\)"),
    # -- checkpoints -----------------------------------------------------------------------
    BadInput("save-model-path-int", _b("save_model", "model", 3), TypeError, r"save_model: checkpoint must be a path \(got 3\)"),
    BadInput("save-model-path-empty", _b("save_model", "model", ""), TypeError, r"save_model: checkpoint must be a path \(got ''\)"),
    BadInput("save-model-not-boosted", _b("save_model", "plain", "/m"), TypeError, r"save_model: model must be a ModelWrapper \(got TinyGPT\)"),
    BadInput("save-model-shard-str", _b("save_model", "model", "/m", shard="yes"), TypeError, r"save_model: shard must be a bool \(got 'yes'\)", True),
    BadInput("save-model-size-0", _b("save_model", "model", "/m", shard=True, size_per_shard=0), ValueError, r"size_per_shard must be a positive int of MB \(got 0\)"),
    BadInput("save-model-prefix-separator", _b("save_model", "model", "/m", shard=True, prefix="a/b"), ValueError, r"prefix must be None or a file-name part without separators \(got 'a/b'\)"),
    BadInput("save-model-shard-over-a-file", _b("save_model", "model", "/a-file", shard=True), ValueError, r"shard=True writes a directory but .*a-file is a file"),
    BadInput("load-model-missing", _b("load_model", "model", "/nothing"), FileNotFoundError, r"load_model: no checkpoint at .*nothing \(got a path that does not exist\)"),
    BadInput("load-model-path-none", _b("load_model", "model", None), TypeError, r"load_model: checkpoint must be a path \(got None\)"),
    BadInput("load-model-strict-str", _b("load_model", "model", "/model.pt", strict="yes"), TypeError, r"load_model: strict must be a bool \(got 'yes'\)", True),
    BadInput("load-model-verify-str", _b("load_model", "model", "/model.pt", verify="no"), TypeError, r"load_model: verify must be a bool \(got 'no'\)", True),
    BadInput("load-model-dir-without-record", _b("load_model", "model", "/model-dir"), CheckpointCorruptError, r"load_model: checkpoint record .*model-dir/zerostack-checkpoint\.json is missing \(got a checkpoint directory", True),
    BadInput("save-optimizer-not-boosted", _b("save_optimizer", "plain_opt", "/o"), TypeError, r"save_optimizer: optimizer must be a OptimizerWrapper \(got HybridAdam\)"),
    BadInput("save-optimizer-shard-str", _b("save_optimizer", "opt", "/o", shard=1), TypeError, r"save_optimizer: shard must be a bool \(got 1\)", True),
    BadInput("load-optimizer-missing", _b("load_optimizer", "opt", "/nothing"), FileNotFoundError, r"load_optimizer: no checkpoint at .*nothing"),
    BadInput("load-optimizer-verify-int", _b("load_optimizer", "opt", "/model.pt", verify=1), TypeError, r"load_optimizer: verify must be a bool \(got 1\)", True),
    BadInput("load-optimizer-from-a-model-file", _b("load_optimizer", "opt", "/model.pt"), ValueError, r"load_optimizer: .*model\.pt does not hold an optimizer state"),
    BadInput("save-lr-scheduler-str", _b("save_lr_scheduler", "sched", "/s"), TypeError, r"save_lr_scheduler: lr_scheduler must have state_dict\(\) \(got str\)"),
    BadInput("load-lr-scheduler-missing", lambda env: env["booster"].load_lr_scheduler(_scheduler(env), env["tmp"] / "nothing"), FileNotFoundError, r"load_lr_scheduler: no checkpoint at .*nothing"),
]
# fmt: on


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case: BadInput, env: dict[str, Any]) -> None:
    with one_torch_thread():
        check_bad_input(case, env, _snapshot, _still_works)


def test_the_table_names_every_case_once() -> None:
    check_unique_ids(CASES)
