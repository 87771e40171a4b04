"""gradient_accumulation_steps of a DeepSpeed config with DeepSpeed's engine
contract (see [Note: DeepSpeed gradient accumulation]): backward and step on
every micro-batch, against DDP + a torch optimizer accumulating by hand
(no_sync, loss / N), step by step, at 1 and 2 ranks (gloo), stages 1 and 2."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.booster import Booster, LowLevelZeroPlugin
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False, vocab_size=128, dim=32, max_seq_len=32)
TOL32 = dict(rtol=1e-5, atol=5e-6)
WINDOWS = 3
LR = {"adamw": 1e-3, "sgd": 0.5}


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    name: str
    stage: int
    kind: str  # "adamw" or "sgd"
    gas: int
    clip: float = 0.0
    offload: bool = False
    zero_grad_every_micro_step: bool = True  # the booster's loop; DeepSpeed's never calls it
    zero_grad_by_model: bool = False  # model.zero_grad() (torch's DCGAN loop), not the optimizer's


CASES = [
    Case(name="zero1-adamw-gas2", stage=1, kind="adamw", gas=2),
    Case(name="zero1-sgd-gas3-no-zero-grad", stage=1, kind="sgd", gas=3, zero_grad_every_micro_step=False),
    Case(name="zero2-sgd-gas3-clip", stage=2, kind="sgd", gas=3, clip=0.05),
    Case(name="zero2-adamw-gas2-offload-clip", stage=2, kind="adamw", gas=2, clip=0.05, offload=True),
    Case(name="zero2-adamw-gas1", stage=2, kind="adamw", gas=1),
    Case(name="zero2-sgd-gas2-model-zero-grad", stage=2, kind="sgd", gas=2, zero_grad_by_model=True),
]  # fmt: skip


def _optimizer(kind, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=LR[kind], weight_decay=0.1, foreach=False)
    return torch.optim.SGD(params, lr=LR[kind], momentum=0.9, weight_decay=0.01)


def _plugin(case: Case) -> LowLevelZeroPlugin:
    zero = {"stage": case.stage, "reduce_bucket_size": 20_000}
    if case.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config = {"zero_optimization": zero, "gradient_accumulation_steps": case.gas,
              "train_micro_batch_size_per_gpu": 4, "gradient_clipping": case.clip}  # fmt: skip
    return LowLevelZeroPlugin.from_deepspeed_config(config)


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _run_case(rank: int, world: int, case: Case) -> None:
    torch.manual_seed(0)
    ref_model = TinyGPT(CONFIG)
    model = copy.deepcopy(ref_model)
    ref = DDP(ref_model)
    ref_opt = _optimizer(case.kind, ref.parameters())
    booster = Booster(plugin=_plugin(case))
    model, opt, *_ = booster.boost(model, _optimizer(case.kind, model.parameters()))
    zero = opt.optim
    for window in range(WINDOWS):
        for micro in range(case.gas):
            where = f"{case.name} window {window} micro-step {micro}"
            idx, tgt = make_batch(CONFIG, 4, 16, seed=1000 * window + 10 * micro + rank)
            last = micro == case.gas - 1
            ref_loss = _loss(ref(idx), tgt)
            if last:
                (ref_loss / case.gas).backward()
            else:
                with ref.no_sync():
                    (ref_loss / case.gas).backward()
            before = [p.detach().clone() for p in model.unwrap().parameters()]
            loss = _loss(model(idx), tgt)
            booster.backward(loss, opt)
            launched = any(b.launched or b.reduced is not None for b in zero.buckets)
            assert launched == ((last and case.gas > 1) or case.gas == 1), f"{where}: communication"
            stepped = opt.step()
            if case.zero_grad_every_micro_step:
                (model if case.zero_grad_by_model else opt).zero_grad()
            torch.testing.assert_close(loss, ref_loss, **TOL32, msg=lambda m, w=where: f"{w}: {m}")
            if not last:
                assert stepped is None, where
                after = list(model.unwrap().parameters())
                assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), where
                continue
            assert stepped is True, where
            if case.clip:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), case.clip)
            ref_opt.step()
            ref_opt.zero_grad()
            full = model.full_state_dict(only_rank_0=False)
            for name, value in ref.module.state_dict().items():
                torch.testing.assert_close(
                    full[name], value, **TOL32, msg=lambda m, n=name, w=where: f"{w} {n}: {m}"
                )


def _all(rank: int, world: int, cases: list[Case]) -> None:
    torch.set_num_threads(1)
    for case in cases:
        _run_case(rank, world, case)


@pytest.mark.parametrize("world_size", [1, 2])
def test_accumulation_matches_ddp_step_by_step(world_size):
    spawn(_all, world_size, args=(CASES,), backend="gloo", timeout_s=300)


def test_zero_grad_after_a_backward_without_step_drops_the_window():
    """A micro-batch whose backward failed (no step() after it): zero_grad()
    drops the whole window and it starts again, so training goes on as if the
    window's micro-batches had never been seen."""
    torch.manual_seed(0)
    reference = TinyGPT(CONFIG)
    model = copy.deepcopy(reference)
    batches = [make_batch(CONFIG, 4, 16, seed=s) for s in range(6)]

    def boosted(m):
        booster = Booster(plugin=_plugin(Case(name="", stage=2, kind="sgd", gas=2)))
        m, opt, *_ = booster.boost(m, _optimizer("sgd", m.parameters()))
        return booster, m, opt

    booster, model, opt = boosted(model)
    booster.backward(_loss(model(batches[0][0]), batches[0][1]), opt)
    opt.step()
    opt.zero_grad()  # inside the window, after step(): keeps the gradients
    booster.backward(_loss(model(batches[1][0]), batches[1][1]), opt)  # "fails": no step()
    opt.zero_grad()
    assert opt.micro_steps == 0 and opt.is_gradient_accumulation_boundary() is False
    ref_booster, reference, ref_opt = boosted(reference)
    for idx, tgt in batches[2:]:
        for b, m, o in ((booster, model, opt), (ref_booster, reference, ref_opt)):
            b.backward(_loss(m(idx), tgt), o)
            o.step()
    for a, b in zip(model.unwrap().parameters(), reference.unwrap().parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt.micro_steps == 4


def test_a_boundary_step_that_raises_stays_the_boundary():
    """ZeroOptimizer's step() may raise and be called again to finish (a
    failed CPU update): the micro-step count does not move past it."""
    torch.manual_seed(0)
    booster = Booster(plugin=_plugin(Case(name="", stage=2, kind="sgd", gas=2)))
    model = TinyGPT(CONFIG)
    model, opt, *_ = booster.boost(model, _optimizer("sgd", model.parameters()))
    idx, tgt = make_batch(CONFIG, 4, 16, seed=0)
    for _ in range(2):
        booster.backward(_loss(model(idx), tgt), opt)
        if opt.is_gradient_accumulation_boundary():
            break
        assert opt.step() is None
    step, calls = opt.optim.step, []

    def fails_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a CPU update failed")
        return step()

    opt.optim.step = fails_once
    with pytest.raises(RuntimeError, match="a CPU update failed"):
        opt.step()
    assert opt.micro_steps == 1 and opt.is_gradient_accumulation_boundary()
    assert opt.step() is True and opt.micro_steps == 2 and len(calls) == 2


def test_a_scheduler_stepped_by_hand_and_a_backward_without_step_are_said_once():
    """Under a DeepSpeed config optimizer.step() steps the lr scheduler passed
    to boost, as DeepSpeed's engine.step() does: stepping the object one
    built as well steps it twice, and two backwards with no step() between
    put more micro-batches in a window than the config says. Each is said
    once."""
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    booster = Booster(plugin=_plugin(Case(name="", stage=2, kind="sgd", gas=2)))
    user_opt = _optimizer("sgd", model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(user_opt, lambda s: 1.0 / (1 + s))
    model, opt, *_ = booster.boost(model, user_opt, lr_scheduler=scheduler)
    idx, tgt = make_batch(CONFIG, 4, 16, seed=0)
    with pytest.warns(UserWarning) as caught:
        for _ in range(3):  # DeepSpeed's loop, and the user's own scheduler.step()
            for _ in range(2):
                booster.backward(_loss(model(idx), tgt), opt)
                opt.step()
            scheduler.step()
        booster.backward(_loss(model(idx), tgt), opt)
        booster.backward(_loss(model(idx), tgt), opt)  # a torch-style accumulation loop
    said = [str(w.message) for w in caught]
    assert len([m for m in said if "stepped outside optimizer.step()" in m]) == 1, said
    assert len([m for m in said if "a second backward with no step() between" in m]) == 1, said


def test_a_checkpoint_inside_a_window_says_it_does_not_resume_exactly(tmp_path):
    """The window's gradients and position are not in a checkpoint (as
    DeepSpeed's): one taken inside a window resumed with shifted windows,
    silently. Such a save warns; one at a boundary does not."""
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    booster = Booster(plugin=_plugin(Case(name="", stage=2, kind="sgd", gas=2)))
    model, opt, *_ = booster.boost(model, _optimizer("sgd", model.parameters()))
    idx, tgt = make_batch(CONFIG, 4, 16, seed=0)
    booster.backward(_loss(model(idx), tgt), opt)
    opt.step()  # micro-step 1 of 2: inside the window
    for shard in (False, True):
        with pytest.warns(UserWarning, match=r"inside a gradient accumulation window \(micro-step 1 of gradient_accumulation_steps=2\)"):  # fmt: skip
            booster.save_optimizer(opt, str(tmp_path / f"inside-{shard}"), shard=shard)
    booster.backward(_loss(model(idx), tgt), opt)
    opt.step()  # closes the window
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        booster.save_optimizer(opt, str(tmp_path / "boundary"))


def test_rolling_back_with_load_state_is_not_taken_for_a_scheduler_stepped_by_hand(tmp_path):
    """booster.load_state into the objects that trained on (a rollback)
    sets the scheduler's epoch back: the steps after it follow the lrs of
    the first pass with no warning. Before, the first step() took the
    loaded epoch for a scheduler.step() called outside it and warned to
    remove a call the loop does not make."""
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    booster = Booster(plugin=_plugin(Case(name="", stage=2, kind="sgd", gas=2)))
    user_opt = _optimizer("sgd", model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(user_opt, lambda s: 1.0 / (1 + s))
    model, opt, _, _, scheduler = booster.boost(model, user_opt, lr_scheduler=scheduler)
    idx, tgt = make_batch(CONFIG, 4, 16, seed=0)

    def windows(n):
        lrs = []
        for _ in range(n):
            for _ in range(2):
                booster.backward(_loss(model(idx), tgt), opt)
                opt.step()
            lrs.append(opt.param_groups[0]["lr"])
        return lrs

    windows(2)
    booster.save_state(str(tmp_path / "state"), model, opt, scheduler)
    first = windows(2)
    booster.load_state(str(tmp_path / "state"), model, opt, scheduler)
    assert scheduler.last_epoch == 2
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*stepped outside optimizer.step()")
        assert windows(2) == first == [LR["sgd"] / 4, LR["sgd"] / 5]


def test_a_rollback_inside_a_window_trains_as_a_fresh_resume(tmp_path):
    """booster.load_state in the middle of a gradient accumulation window
    (after a micro-step's step(), or after a backward with no step())
    drops that window: training goes on bitwise as a fresh process resuming
    the same state. Before, the loaded run kept the micro-step count and the
    gradients of before the load, and closed its first window early with
    them in it."""

    def boosted(seed):
        torch.manual_seed(seed)
        model = TinyGPT(CONFIG)
        booster = Booster(plugin=_plugin(Case(name="", stage=2, kind="sgd", gas=2)))
        model, opt, *_ = booster.boost(model, _optimizer("sgd", model.parameters()))
        return booster, model, opt

    def micro_steps(booster, model, opt, seeds, step=True):
        for seed in seeds:
            idx, tgt = make_batch(CONFIG, 4, 16, seed=seed)
            booster.backward(_loss(model(idx), tgt), opt)
            if step:
                opt.step()

    state = str(tmp_path / "state")
    booster, model, opt = boosted(0)
    micro_steps(booster, model, opt, range(4))
    booster.save_state(state, model, opt)
    fresh = boosted(1)
    fresh[0].load_state(state, *fresh[1:])
    micro_steps(*fresh, range(4, 8))
    for opened in ({"step": True}, {"step": False}):
        micro_steps(booster, model, opt, [99], **opened)  # a window opened, then rolled back
        booster.load_state(state, model, opt)
        assert opt.micro_steps % 2 == 0, opened  # at a boundary
        micro_steps(booster, model, opt, range(4, 8))
        for a, b in zip(model.unwrap().parameters(), fresh[1].unwrap().parameters(), strict=True):
            assert torch.equal(a, b), opened
        booster.load_state(state, model, opt)
    # The model alone, rolled back: it starts a window too.
    micro_steps(booster, model, opt, [99])
    booster.load_model(model, f"{state}/model")
    assert opt.micro_steps % 2 == 0 and all(p.grad is None for p in model.unwrap().parameters())
