"""One layer at a time (fx_fp8/quant/layer_quantize.py): a weight quantized in slices of rows is byte for
byte WeightRecipe.quantize of the whole weight; the layers and recipes are prepare_model's."""

from __future__ import annotations

import pytest
import torch

from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.quant.layer_quantize import (
    check_load_time_config,
    empty_quantized_linear,
    layer_kind,
    layer_plan,
    quantize_by_rows,
    quantized_linear,
    scale_shape,
    slice_rows,
)
from fx_fp8.quant.linear_plan import LinearPlan
from fx_fp8.quant.recipe import recipe
from fx_fp8.ops.formats import WEIGHT_ONLY

RECIPES = [
    recipe("fp8", "channel"),
    recipe("int8", "channel"),
    recipe("fp8", "block", (128, 128)),
    recipe("int8", "block", (1, 32)),
    recipe("fp8", "block", (32, 48)),
    recipe("fp8", "tensor"),
]


def same_bytes(a, b) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.mark.parametrize("r", RECIPES, ids=lambda r: f"{r.method}-{r.granularity}-{r.block}")
@pytest.mark.parametrize("dtype,cap", [(torch.bfloat16, None), (torch.float32, 640)], ids=["bf16", "fp32-5-rows"])
def test_slices_of_rows_give_the_bytes_of_the_whole_weight(r, dtype, cap, monkeypatch):
    from fx_fp8.quant import layer_quantize

    if cap is not None:  # slices bounded by SLICE_ELEMENTS (5 rows of 128) rather than by ROW_SLICES
        monkeypatch.setattr(layer_quantize, "SLICE_ELEMENTS", cap)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(150, 128, generator=g) * torch.logspace(-2, 1, 150)[:, None]).to(dtype)  # rows of all sizes
    whole_q, whole_s = r.quantize(w)
    q, s = quantize_by_rows(r, w)
    assert same_bytes(q, whole_q) and same_bytes(s, whole_s)
    assert tuple(s.shape) == scale_shape(r, 150, 128)


def test_slices_are_whole_blocks_of_rows_and_bounded():
    assert slice_rows(recipe("fp8", "channel"), 3072, 256) == 192  # 1/16 of the rows
    assert slice_rows(recipe("fp8", "channel"), 18432, 3072) == 341  # at most 2**20 weights
    assert slice_rows(recipe("fp8", "block", (128, 128)), 3072, 256) == 256  # 192 rounded up to whole blocks
    assert slice_rows(recipe("fp8", "block", (128, 128)), 100, 64) == 128
    assert slice_rows(recipe("fp8", "block", (128, 128)), 4096, 12288) == 128  # 85 rows: one block at least
    assert slice_rows(recipe("fp8", "tensor"), 3072, 256) == 3072  # one scale: the whole weight at once
    assert slice_rows(recipe("int8", "block", (1, 32)), 20, 64) == 2


def test_layer_decisions_and_recipes_are_prepare_models():
    cfg = FP8Config.load(None, ignored_layers=["re:blocks\\.0\\.ff"])
    assert layer_kind("blocks.0.attn.to_q", 256, 256, torch.bfloat16, cfg) == ("quantized", None)
    assert layer_kind("blocks.0.ff", 256, 256, torch.bfloat16, cfg)[0] == "native"  # ignored_layers
    kind, why = layer_kind("time_text_embed.timestep_embedder.linear_1", 256, 256, torch.bfloat16, cfg)
    assert kind == "weight_only" and "known sensitive layer" in why  # by name, as prepare_model
    assert layer_kind("blocks.0.attn.to_k", 16, 256, torch.bfloat16, cfg)[0] == "native"  # below min_features
    w8a8 = layer_plan("blocks.0.attn.to_q", 256, 256, torch.bfloat16, cfg, "cpu")
    assert (w8a8.recipe, w8a8.act) == (recipe("fp8", "channel"), "token")
    wo = layer_plan("time_text_embed.timestep_embedder.linear_1", 256, 256, torch.bfloat16, cfg, "cpu")
    assert (wo.recipe, wo.act) == (recipe("int8", "block", (1, 32)), WEIGHT_ONLY)
    with pytest.raises(ValueError, match="a 'native' linear plan has no quantization recipe \\(ignored_layers pattern"):
        quantized_linear(torch.randn(256, 256), None, layer_plan("blocks.0.ff", 256, 256, torch.float32, cfg))
    with pytest.raises(ValueError, match="quantization is None"):
        check_load_time_config(FP8Config.load(None, quantization=None))


def test_an_empty_layer_has_the_shapes_a_quantized_checkpoint_holds():
    w = torch.randn(96, 64, dtype=torch.bfloat16)
    bias = torch.randn(96, dtype=torch.bfloat16)
    for r, act in ((recipe("fp8", "channel"), "token"), (recipe("int8", "block", (1, 32)), WEIGHT_ONLY)):
        full = quantized_linear(w, bias, LinearPlan.stored(r, act))
        empty = empty_quantized_linear(64, 96, True, torch.bfloat16, r, act)
        assert empty.weight.is_meta and empty.recipe == full.recipe == r
        for name, t in full.state_dict().items():
            e = empty.state_dict()[name]
            assert (e.dtype, e.shape) == (t.dtype, t.shape), name
        assert full.orig_dtype == torch.bfloat16 and full.act_granularity == act
