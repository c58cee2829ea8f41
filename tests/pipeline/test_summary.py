"""fx_fp8.summary(pipe_or_model) and `fx-fp8 inspect --summary`: one row per component with FP8
attention and W8A8 linears n/m, weight-only linears, the native nodes' top reasons, weight bytes
before / after and the kernels."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fx_fp8

from cli_runs import cli, strict_json


class _Block(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.to_qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.odd = nn.Linear(width, 12)  # 12 features: no FP8 tile, native

    def forward(self, x):
        q, k, v = self.to_qkv(x).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2)
        return self.out(a) + self.odd(x).sum(-1, keepdim=True)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _run(model, options=None):
    compiled = torch.compile(model, backend="fp8", options=options)
    with torch.no_grad():
        compiled(torch.randn(1, 32, 64))
    return compiled


def _fp32_bytes(model) -> int:
    return sum(p.numel() * 4 for p in model.parameters())


def test_plain_compile_counts_and_the_fp8_copies_it_keeps():
    model = _Model()
    before = _fp32_bytes(model)
    compiled = _run(model)
    (row,) = fx_fp8.summary(compiled)
    assert (row.component, row.cls, row.compiled) == ("model", "_Model", True)
    assert (row.attention_fp8, row.attention_total) == (2, 2)
    assert (row.linear_w8a8, row.linear_total, row.linear_weight_only) == (4, 6, 0)
    ((reason, count),) = row.native_reasons
    assert count == 2 and "12" in reason
    assert row.bytes_before == before and row.bytes_after > before  # the plain path keeps both copies
    assert row.kernels == "reference/eager"
    text = str(fx_fp8.summary(compiled))
    assert "2/2" in text and "4/6" in text and "2x " in text and "reference/eager" in text


def test_a_prepared_model_holds_fewer_bytes_and_a_config_reason_leads():
    model = _Model()
    before = _fp32_bytes(model)
    fx_fp8.prepare_model(model, ignored_layers=["blocks.0.out"])
    (row,) = fx_fp8.summary(model)  # before any compile: the prepared layers
    assert (row.compiled, row.linear_w8a8, row.linear_total, row.kernels) == (False, 3, 6, "")
    assert row.bytes_before == before and row.bytes_after < before
    (row,) = fx_fp8.summary(_run(model, {"ignored_layers": ["blocks.0.out"]}))
    assert (row.linear_w8a8, row.linear_total, row.attention_fp8, row.attention_total) == (3, 6, 0, 2)
    # a config naming only linear keys leaves attention native, and the summary says what to set
    assert [n for _, n in row.native_reasons] == [2, 2, 1]
    assert row.native_reasons[0][0].startswith("attention not requested: set diffusion_kv_cache_dtype: fp8")
    assert row.native_reasons[2][0].startswith(
        "ignored_layers pattern 'blocks.0.out' (remove it from quantization_config.ignored_layers"
    )


def test_summary_refuses_what_is_neither_a_pipeline_nor_a_model():
    with pytest.raises(TypeError, match="got str"):
        fx_fp8.summary("transformer")


@pytest.mark.slow
def test_a_compiled_pipeline_has_one_row_per_component():
    from fx_fp8.tools.tiny_model import load_tiny_pipeline

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = load_tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    fx_fp8.compile_pipeline(pipe)
    with torch.no_grad():
        pipe("a red circle", num_inference_steps=2)
    rows = {r.component: r for r in fx_fp8.summary(pipe)}
    assert set(rows) == {"transformer", "prompt_encoder"}
    t = rows["transformer"]
    assert t.compiled and t.attention_fp8 == t.attention_total == 4 and t.linear_w8a8 == 34
    assert t.linear_weight_only == 12 and t.bytes_after < t.bytes_before / 3
    assert not rows["prompt_encoder"].compiled


@pytest.mark.slow
def test_inspect_summary(capsys):
    code, out, err = cli(capsys, "inspect", "--model", "flux", "--summary", "--format", "json")
    assert code == 0, err
    (row,) = strict_json(out)["component_summary"]
    assert row["component"] == "transformer" and row["attention_fp8"] == row["attention_total"] > 0
    assert row["bytes_after"] > row["bytes_before"]
    code, out, err = cli(capsys, "inspect", "--model", "flux", "--summary")
    assert code == 0, err
    assert "FP8 attention" in out and "weights before -> after" in out and "module" not in out
