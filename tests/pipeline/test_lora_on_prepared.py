"""A PEFT adapter (LoRA through diffusers, LoHa through PEFT itself) on a prepared model ends in
fx_fp8's PreparedModelAdapterError naming what works (load it before preparing, or prepare=False),
raised before PEFT changes the model; a model that was not prepared takes adapters as before."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch.nn as nn

import fx_fp8
from fx_fp8.quant.peft_guard import PreparedModelAdapterError
from fx_fp8.quant.quantized_linear import QuantizedLinear

import peft  # the test extra installs it: a missing one is an error, not a skip


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = nn.Linear(64, 64)
        self.to_k = nn.Linear(64, 64)
        self.proj = nn.Linear(64, 64)

    def forward(self, x):
        return self.proj(self.to_q(x) + self.to_k(x))


def _types(model) -> dict:
    return {name: type(m).__name__ for name, m in model.named_modules()}


@pytest.mark.parametrize(
    "config",
    [
        lambda: peft.LoraConfig(r=4, target_modules=["to_q", "to_k"]),
        lambda: peft.LoHaConfig(r=4, target_modules=["to_q"]),
        lambda: peft.IA3Config(target_modules=["to_k", "proj"], feedforward_modules=["proj"]),
    ],
    ids=["lora", "loha", "ia3"],
)
def test_an_adapter_on_a_prepared_model_is_fx_fp8s_error_and_changes_nothing(config):
    model = _Tiny()
    fx_fp8.prepare_model(model)
    assert isinstance(model.to_q, QuantizedLinear)
    before = _types(model)
    with pytest.raises(PreparedModelAdapterError, match=r"prepare=False.*restore_pipeline") as e:
        peft.inject_adapter_in_model(config(), model, adapter_name="style")
    assert "before fx_fp8.prepare_model" in str(e.value) and "'style'" in str(e.value)
    assert _types(model) == before


def test_an_adapter_on_a_model_not_prepared_still_loads():
    model = _Tiny()
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["to_q"]), model, adapter_name="style")
    assert type(model.to_q).__module__.startswith("peft.")


def test_an_adapter_that_targets_no_quantized_layer_still_loads():
    model = _Tiny()
    fx_fp8.prepare_model(model, ignored_layers=["to_q"])
    assert not isinstance(model.to_q, QuantizedLinear)
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["to_q"]), model, adapter_name="style")
    assert type(model.to_q).__module__.startswith("peft.")


@pytest.mark.slow
def test_diffusers_lora_on_a_prepared_transformer_and_peft_imported_first():
    """PEFT imported before fx_fp8 (the guard goes in at once) and diffusers' load_lora_adapter."""
    code = """
import json, torch, peft.tuners.tuners_utils
import fx_fp8
from fx_fp8.tools.model_zoo.registry import build_tiny_transformer
t = build_tiny_transformer("flux")
fx_fp8.prepare_model(t)
sd = {}
for name, m in t.named_modules():
    if name.endswith("attn.to_q"):
        sd[f"transformer.{name}.lora_A.weight"] = torch.randn(4, m.in_features)
        sd[f"transformer.{name}.lora_B.weight"] = torch.randn(m.out_features, 4)
try:
    t.load_lora_adapter(sd, prefix="transformer", adapter_name="style")
    print(json.dumps(None))
except Exception as e:
    print(json.dumps([type(e).__name__, str(e)]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got is not None and got[0] == "PreparedModelAdapterError", out.stderr[-2000:]
    assert "prepare=False" in got[1] and "transformer_blocks.0.attn.to_q" in got[1]
