"""Every native attention decision in the report says what the user can set to change it, or that
no setting can: a config naming only linear keys leaves attention native, and its
reason names diffusion_kv_cache_dtype: fp8 rather than an option the user never set."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fx_fp8

#: how a native attention reason ends: a key or action to change it, or that none exists
SAYS_WHAT_TO_SET = re.compile(
    r"set diffusion_kv_cache_dtype: fp8|set attention\.cross_attention: true|"
    r"drop \d+ from it|drop the step from diffusion_kv_cache_skip_steps|"
    r"run the model in eval mode|load the model in|nothing to set"
)


class _Block(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.kw = kw

    def forward(self, q, kv):
        return self.proj(F.scaled_dot_product_attention(q, kv, kv, **self.kw))


class _Model(nn.Module):
    """blocks.0-3: plain, cross-attention (8 keys), dropout, plain; causal and 3-D calls at the top."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block(), _Block(dropout_p=0.1), _Block()])

    def forward(self, q, short):
        a = self.blocks[0](q, q) + self.blocks[1](q, short) + self.blocks[2](q, q) + self.blocks[3](q, q)
        causal = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        flat = F.scaled_dot_product_attention(q[0], q[0], q[0])
        return a + causal + flat


def _native_reasons(options) -> list:
    """[(step variant, module, reason)] of every native attention node."""
    fx_fp8.clear_reports()
    torch._dynamo.reset()
    q, short = torch.randn(1, 2, 64, 32), torch.randn(1, 2, 8, 32)
    compiled = torch.compile(_Model(), backend="fp8", options=options)
    with torch.no_grad(), fx_fp8.denoising_step(0, total=4):
        compiled(q, short)
    return [
        (r.step_variant, e.module, e.reason)
        for r in fx_fp8.get_reports()
        for e in r.entries
        if e.op == "attention" and e.action == "native"
    ]


@pytest.mark.parametrize(
    "options", [{"ignored_layers": ["blocks.0.proj"]}, {"quantization": "int8"}, {"quantization": "fp8"}]
)
def test_a_config_naming_only_linears_says_how_to_ask_for_attention(options):
    reasons = _native_reasons(options)
    assert len(reasons) == 6
    for _, _, reason in reasons:
        assert reason.startswith("attention not requested: set diffusion_kv_cache_dtype: fp8"), reason
        assert "diffusion_kv_cache_dtype=None" not in reason


def test_auto_says_what_auto_means():
    (_, _, reason), *_ = _native_reasons({"diffusion_kv_cache_dtype": "auto"})
    assert "auto means the model's own attention" in reason and "set diffusion_kv_cache_dtype: fp8" in reason


def test_every_native_attention_reason_says_what_to_set():
    reasons = _native_reasons(
        {"diffusion_kv_cache_dtype": "fp8", "diffusion_kv_cache_skip_layers": "0", "diffusion_kv_cache_skip_steps": "0"}
    )
    by_module = {}
    for variant, module, reason in reasons:
        assert SAYS_WHAT_TO_SET.search(reason), (variant, module, reason)
        by_module.setdefault(module, set()).add(reason)
    assert any("drop 0 from it" in r for r in by_module["blocks.0"])
    assert any("set attention.cross_attention: true" in r for r in by_module["blocks.1"])
    assert any("run the model in eval mode" in r for r in by_module["blocks.2"])
    assert by_module["blocks.3"] == {
        "skipped step variant (diffusion_kv_cache_skip_steps); drop the step from "
        "diffusion_kv_cache_skip_steps to quantize this attention there"
    }
    assert all("nothing to set" in r for r in by_module[""])  # causal and 3-D calls


def test_a_reason_that_names_its_setting_gets_no_second_one():
    from fx_fp8.passes.attention_remedies import lowering_remedy, with_remedy

    own = "attention.kernel auto: native attention is faster here (measured); attention.kernel: triton runs FP8 anyway"
    assert with_remedy(own, lowering_remedy("cuda")) == own
    bare = "head dim 72 (value 72) not supported by the Triton FP8 kernel (needs 64 or 128)"
    assert with_remedy(bare, lowering_remedy("cuda")).startswith(bare + "; nothing to set on the cuda lowering")
