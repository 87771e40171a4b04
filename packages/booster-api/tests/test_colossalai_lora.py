"""ColossalAI's LoRA entry points (``Booster.enable_lora``,
``Booster.save_lora_as_pretrained``, ``Plugin.support_lora`` and
``Plugin.enable_lora``, colossalai/booster/booster.py and plugin_base.py)
are not implemented: they raise saying what to do instead, and what they
say works. They were an ``AttributeError``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerostack.booster import Booster, GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin

PLUGINS = {
    "none": lambda: None,
    "zero2": lambda: LowLevelZeroPlugin(stage=2, precision="fp32"),
    "gemini": lambda: GeminiPlugin(precision="fp32", chunk_config_dict={1: {"chunk_size": 4096}}),
}


class Adapted(nn.Module):
    """A frozen base layer with a trainable low-rank adapter beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 8)
        self.lora_a = nn.Linear(8, 2, bias=False)
        self.lora_b = nn.Linear(2, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


@pytest.mark.parametrize("name", list(PLUGINS))
def test_lora_entry_points_refuse_and_their_advice_trains(tmp_path, name):
    plugin = PLUGINS[name]()
    booster = Booster(plugin=plugin, device="cpu" if plugin is None else None)
    assert booster.plugin.support_lora() is False
    torch.manual_seed(0)
    model = Adapted()
    with pytest.raises(NotImplementedError, match=r"Booster.enable_lora: LoRA is not implemented"):
        booster.enable_lora(model, lora_config={"r": 2})
    with pytest.raises(NotImplementedError, match=r"\.enable_lora: LoRA is not implemented"):
        booster.plugin.enable_lora(model, None, {"r": 2})
    # What the message says: freeze the base weights, boost, train, save_model.
    model.base.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    model, opt, *_ = booster.boost(model, torch.optim.SGD(trainable, lr=0.1))
    opt.backward(model(torch.randn(4, 8)).pow(2).mean())
    opt.step()
    after = model.full_state_dict()
    assert torch.equal(after["base.weight"], before["base.weight"])
    assert not torch.equal(after["lora_a.weight"], before["lora_a.weight"])
    booster.save_model(model, str(tmp_path / "model.pt"))
    with pytest.raises(NotImplementedError, match=r"save_lora_as_pretrained: LoRA is not"):
        booster.save_lora_as_pretrained(model, str(tmp_path / "lora"))


def test_torch_ddp_plugin_does_not_support_lora():
    assert TorchDDPPlugin().support_lora() is False
