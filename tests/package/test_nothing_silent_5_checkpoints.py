"""Round five of hostile use, checkpoints and pre-quantized weights (issue 41 items 4, 6, 9, 12,
14, 15, 16, 18): what adopt_prequantized keeps survives save_quantized, config.json is digested
and written last, bad dtypes and hand-edited records are refused by name, tied parameters round
trip, suspicious pre-quantized scales warn, and single-file / dtype-move limits of the diffusers
backend are said up front."""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.nn as nn

import fx_fp8
from fx_fp8.quant.checkpoint import CONFIG_NAME, QUANT_NAME, WEIGHTS_NAME
from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs, output_tensor
from prequantized_layouts import bfl_checkpoint, bfl_stack, float_stack

DIMS = (64, 96, 64)


def same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        sa[k].dtype == sb[k].dtype and torch.equal(sa[k].reshape(-1).view(torch.uint8), sb[k].reshape(-1).view(torch.uint8))
        for k in sa)


def flux(seed=0, dtype=torch.float32):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_tiny_transformer("flux", layers=1, seed=seed, dtype=dtype)


def prepared_flux(seed=0, dtype=torch.float32):
    model = flux(seed, dtype)
    fx_fp8.prepare_model(model)
    return model


def run(model, kw):
    with torch.no_grad():
        return output_tensor(model(**kw))


# -- item 4: BFL layers adopt_prequantized keeps are saved with a record and rebuilt -----------
def test_bfl_layers_kept_by_adopt_prequantized_round_trip_bit_exact(tmp_path):
    from diffusers.quantizers.bfl.utils import BFLFP8RLinear

    model = bfl_stack(bfl_checkpoint(float_stack(DIMS)), 2, DIMS)
    result = fx_fp8.adopt_prequantized(model, ignored_layers=["layers.1"])
    assert list(result["kept"]) == ["layers.1"] and isinstance(model.layers[1], BFLFP8RLinear)
    x = torch.randn(3, 5, DIMS[0], dtype=torch.bfloat16)
    with torch.no_grad():
        ref = model(x)
    fx_fp8.save_quantized(model, tmp_path)
    loaded = fx_fp8.load_quantized(tmp_path, model=float_stack(DIMS))
    kept = loaded.layers[1]
    assert type(kept) is BFLFP8RLinear and kept.compute_dtype == torch.bfloat16
    assert same_state(loaded, model)
    with torch.no_grad():
        assert torch.equal(loaded(x), ref)
    # saved again from the loaded model: the same record (the kept layer's reason travels)
    fx_fp8.save_quantized(loaded, tmp_path / "again")
    first, second = (json.loads((p / QUANT_NAME).read_text()) for p in (tmp_path, tmp_path / "again"))
    assert first["bfl_fp8r_native"] == second["bfl_fp8r_native"]
    assert first["bfl_fp8r_native"]["layers.1"]["reason"] == result["kept"]["layers.1"]
    # dtype= casts the bias and the compute dtype, never the fp8r weight or its scale
    cast = fx_fp8.load_quantized(tmp_path, model=float_stack(DIMS), dtype=torch.float32).layers[1]
    assert cast.weight.dtype == torch.float8_e4m3fn and cast.weight_scale.dtype == torch.float32
    assert cast.bias.dtype == torch.float32 and cast.compute_dtype == torch.float32
