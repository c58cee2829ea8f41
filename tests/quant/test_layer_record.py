"""The record of a quantized layer (fx_fp8/quant/layer_record.py) in its two layouts: the files
save_quantized (flat, fx_fp8_quantization.json) and a diffusers save_pretrained (grouped, config.json
quantization_config.quantized_layers) wrote before the schema was shared still load unchanged (the
literals below were captured from those writers); both layouts write and check the recipe fields of
one tuple, so the two cannot drift; a damaged recipe field names the file, the field and the value."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn

import fx_fp8
from fx_fp8.quant.checkpoint import QUANT_NAME
from fx_fp8.quant.linear_plan import LinearPlan
from fx_fp8.quant.quantized_linear import QuantizedLinear
from fx_fp8.quant.recipe import recipe

SHAPE = dict(in_features=32, out_features=64)


def quantized(
    method, granularity, block, act, *, bias=True, dtype=torch.bfloat16, static=False, steps=None, seed=0
) -> QuantizedLinear:
    """A QuantizedLinear of this recipe, its weight quantized from a seeded random one."""
    g = torch.Generator().manual_seed(seed)
    r = recipe(method, granularity, block)
    wq, ws = r.quantize(torch.randn(SHAPE["out_features"], SHAPE["in_features"], generator=g))
    b = torch.randn(SHAPE["out_features"], generator=g).to(dtype) if bias else None
    kw = {}
    if static:  # a calibrated, smoothed layer with per-step scales
        kw = dict(
            input_scale=torch.tensor(0.5),
            input_smoothing=torch.rand(SHAPE["in_features"], generator=g) + 0.5,
            input_step_scales=torch.tensor([0.25, 0.75]),
        )
    return QuantizedLinear.from_plan(LinearPlan.stored(r, act, steps), wq, ws, b, orig_dtype=dtype, **kw)


def model(static: bool = True) -> nn.Module:
    """Four recipes (one twice): fp8 channel, int8 block, int8 weight-only; a static fp8 tensor layer."""
    m = nn.Module()
    m.a = quantized("fp8", "channel", None, "token")
    m.b = quantized("int8", "block", (32, 32), "tensor", bias=False, dtype=torch.float32)
    m.c = quantized("int8", "channel", None, "weight_only")
    m.d = quantized("fp8", "channel", None, "token", seed=1)
    if static:
        m.e = quantized("fp8", "tensor", None, "tensor", static=True, steps=(0, 9, 10, 49))
    return m


def unprepared_like(m: nn.Module) -> nn.Module:
    out = nn.Module()
    for name, layer in m.named_children():
        setattr(out, name, nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None))
    return out


def _flat(
    method,
    granularity,
    block,
    act,
    *,
    bias=True,
    weight_dtype="float8_e4m3fn",
    orig="bfloat16",
    static=False,
    weight_only=False,
    steps=None,
) -> dict:
    # the key order save_quantized wrote before the shared schema (a JSON reader ignores it)
    return {
        "in_features": 32,
        "out_features": 64,
        "bias": bias,
        "method": method,
        "weight_dtype": weight_dtype,
        "weight_granularity": granularity,
        "weight_block": block,
        "act_granularity": act,
        "orig_dtype": orig,
        "input_scale": static,
        "input_smoothing": static,
        "weight_only": weight_only,
        "input_step_groups": steps,
    }


#: fx_fp8_quantization.json `layers` of model(), as save_quantized wrote it before the shared schema
FLAT_RECORD = {
    "a": _flat("fp8", "channel", [], "token"),
    "b": _flat("int8", "block", [32, 32], "tensor", bias=False, weight_dtype="int8", orig="float32"),
    "c": _flat("int8", "channel", [], "weight_only", weight_dtype="int8", weight_only=True),
    "d": _flat("fp8", "channel", [], "token"),
    "e": _flat("fp8", "tensor", [], "tensor", static=True, steps=[0, 9, 10, 49]),
}
#: config.json quantized_layers of model(static=False), as a diffusers save_pretrained wrote it
GROUPED_RECORD = [
    {
        "method": "fp8",
        "weight_granularity": "channel",
        "weight_block": None,
        "act_granularity": "token",
        "layers": ["a", "d"],
    },
    {
        "method": "int8",
        "weight_granularity": "block",
        "weight_block": [32, 32],
        "act_granularity": "tensor",
        "layers": ["b"],
    },
    {
        "method": "int8",
        "weight_granularity": "channel",
        "weight_block": None,
        "act_granularity": "weight_only",
        "layers": ["c"],
    },
]


def layers_of(m: nn.Module) -> dict:
    return {
        n: (
            q.method,
            q.weight_granularity,
            list(q.weight_block),
            q.act_granularity,
            q.orig_dtype,
            q.input_step_groups,
            q.input_scale is not None,
            q.input_smoothing is not None,
        )
        for n, q in m.named_modules()
        if isinstance(q, QuantizedLinear)
    }


def same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa, "a state to compare"
    return sa.keys() == sb.keys() and all(
        sa[k].dtype == sb[k].dtype
        and torch.equal(sa[k].reshape(-1).view(torch.uint8), sb[k].reshape(-1).view(torch.uint8))
        for k in sa
    )


# -- files written before the shared schema load unchanged -----------------------------------------
def test_a_checkpoint_description_of_the_earlier_writer_loads_unchanged(tmp_path):
    m = model()
    fx_fp8.save_quantized(m, tmp_path)
    record = json.loads((tmp_path / QUANT_NAME).read_text())
    assert record["layers"] == FLAT_RECORD  # the writer's fields and values are the earlier ones
    old = json.loads(json.dumps(FLAT_RECORD))
    del old["d"]["weight_only"], old["d"]["input_step_groups"]  # as an older save_quantized wrote them
    (tmp_path / QUANT_NAME).write_text(json.dumps({**record, "layers": old}, indent=2))
    loaded = fx_fp8.load_quantized(tmp_path, model=unprepared_like(m))
    assert layers_of(loaded) == layers_of(m) and same_state(loaded, m)
    x = torch.randn(3, SHAPE["in_features"])
    with torch.no_grad():
        assert torch.equal(loaded.a(x.bfloat16()), m.a(x.bfloat16())) and torch.equal(loaded.b(x), m.b(x))


def test_a_config_json_record_of_the_earlier_writer_reads_unchanged():
    from fx_fp8.pipeline.diffusers_quantizer import record_of

    m = model(static=False)
    assert record_of(m) == GROUPED_RECORD
    cfg = fx_fp8.DiffusersConfig(quantized_layers=json.loads(json.dumps(GROUPED_RECORD)))
    assert cfg.to_dict()["quantized_layers"] == GROUPED_RECORD
    # [] for a blockless recipe was read as null: still is
    legacy = [{**GROUPED_RECORD[0], "weight_block": []}]
    assert fx_fp8.DiffusersConfig(quantized_layers=legacy).quantized_layers == legacy
    with pytest.raises(ValueError, match="e holds .*covers dynamic activation scales only"):
        record_of(model())


#: config.json quantized_layers of the tiny Flux (1 layer) loaded with DiffusersConfig(sensitive: fp8)
FLUX_RECORD = [
    {
        "act_granularity": "token",
        "method": "fp8",
        "weight_block": None,
        "weight_granularity": "channel",
        "layers": [
            "time_text_embed.timestep_embedder.linear_1",
            "time_text_embed.timestep_embedder.linear_2",
            "time_text_embed.text_embedder.linear_1",
            "time_text_embed.text_embedder.linear_2",
            "context_embedder",
            "x_embedder",
            "transformer_blocks.0.norm1.linear",
            "transformer_blocks.0.norm1_context.linear",
            "transformer_blocks.0.attn.to_q",
            "transformer_blocks.0.attn.to_k",
            "transformer_blocks.0.attn.to_v",
            "transformer_blocks.0.attn.to_out.0",
            "transformer_blocks.0.attn.add_q_proj",
            "transformer_blocks.0.attn.add_k_proj",
            "transformer_blocks.0.attn.add_v_proj",
            "transformer_blocks.0.attn.to_add_out",
            "transformer_blocks.0.ff.net.0.proj",
            "transformer_blocks.0.ff.net.2",
            "transformer_blocks.0.ff_context.net.0.proj",
            "transformer_blocks.0.ff_context.net.2",
            "single_transformer_blocks.0.norm.linear",
            "single_transformer_blocks.0.proj_mlp",
            "single_transformer_blocks.0.proj_out",
            "single_transformer_blocks.0.attn.to_q",
            "single_transformer_blocks.0.attn.to_k",
            "single_transformer_blocks.0.attn.to_v",
            "norm_out.linear",
            "proj_out",
        ],
    }
]


def test_a_diffusers_folder_of_the_earlier_writer_loads_unchanged(tmp_path):
    from diffusers import FluxTransformer2DModel
    from fx_fp8.tools.model_zoo.registry import build_tiny_transformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_tiny_transformer("flux", layers=1, dtype=torch.bfloat16).save_pretrained(tmp_path / "full")
        loaded = FluxTransformer2DModel.from_pretrained(
            tmp_path / "full",
            torch_dtype=torch.bfloat16,
            quantization_config=fx_fp8.DiffusersConfig(quantization_config={"sensitive": "fp8"}),
        )
        loaded.save_pretrained(tmp_path / "q")
        path = tmp_path / "q" / "config.json"
        config = json.loads(path.read_text())
        assert config["quantization_config"]["quantized_layers"] == FLUX_RECORD
        config["quantization_config"]["quantized_layers"] = FLUX_RECORD  # the earlier writer's file
        path.write_text(json.dumps(config, indent=2, sort_keys=True))
        again = FluxTransformer2DModel.from_pretrained(tmp_path / "q", torch_dtype=torch.bfloat16)
    assert layers_of(again) == layers_of(loaded) and same_state(again, loaded)


# -- one vocabulary: both layouts write and check the recipe fields of one tuple -------------------
def test_both_layouts_write_the_recipe_fields_of_one_tuple():
    from fx_fp8.pipeline.diffusers_quantizer import record_of
    from fx_fp8.quant import layer_record as lr
    from fx_fp8.quant.checkpoint import _describe

    assert set(lr.FLAT_FIELDS) & set(lr.GROUPED_FIELDS) == set(lr.RECIPE_FIELDS)
    m = model(static=False)
    flat = _describe(m, "test")[0]["layers"]
    grouped = record_of(m)
    assert flat and grouped
    assert all(set(rec) == {*lr.FLAT_FIELDS, *lr.FLAT_OPTIONAL_FIELDS} for rec in flat.values())
    assert all(set(entry) == set(lr.GROUPED_FIELDS) for entry in grouped)
    for entry in grouped:  # the same recipe values for each layer, [] / null aside
        for name in entry["layers"]:
            for key in lr.RECIPE_FIELDS:
                assert (flat[name][key] or None) == (entry[key] or None), (name, key)
    # each recipe field is a QuantizedLinear attribute of that name: what both writers read
    assert all(hasattr(m.a, key) for key in lr.RECIPE_FIELDS)


#: a bad value of each recipe field, and what the message says is expected
BAD_RECIPE_VALUES = {
    "method": ("fp4", r"a weight recipe fx_fp8 knows \(unknown weight quantization method 'fp4'"),
    "weight_granularity": ("row", r"a weight recipe fx_fp8 knows \(unknown weight granularity 'row'"),
    "weight_block": ("128x128", r"weight_block is '128x128', expected a list of integers"),
    "act_granularity": ("row", r"act_granularity is 'row', expected one of \['token', 'tensor', 'group', "),
}


def test_every_recipe_field_has_a_bad_value_checked():
    from fx_fp8.quant.layer_record import RECIPE_FIELDS

    assert set(BAD_RECIPE_VALUES) == set(RECIPE_FIELDS)


def _flat_damaged(path, field, value):
    from fx_fp8.quant.checkpoint_record import check_record

    rec = json.loads(json.dumps(FLAT_RECORD["a"]))
    if value is KeyError:
        del rec[field]
    else:
        rec[field] = value
    check_record({"model_class": "Model", "layers": {"a": rec}, "native": {}}, str(path), "config.json")


def _grouped_damaged(field, value):
    entry = json.loads(json.dumps(GROUPED_RECORD[0]))
    if value is KeyError:
        del entry[field]
    else:
        entry[field] = value
    fx_fp8.DiffusersConfig(quantized_layers=[entry])


@pytest.mark.parametrize("field", list(BAD_RECIPE_VALUES))
def test_a_bad_recipe_field_names_the_file_field_and_value_in_both_layouts(field, tmp_path):
    value, says = BAD_RECIPE_VALUES[field]
    path = tmp_path / QUANT_NAME
    with pytest.raises(ValueError, match=rf"{str(path)!r} is damaged: layers\['a'\]\..*{says}"):
        _flat_damaged(path, field, value)
    with pytest.raises(
        ValueError,
        match=rf"quantization_config \(config.json\) is damaged: quantized_layers\[0\]\..*"
        rf"{says}",
    ):
        _grouped_damaged(field, value)
    with pytest.raises(ValueError, match=rf"layers\['a'\] is .*missing \['{field}'\]"):
        _flat_damaged(path, field, KeyError)
    with pytest.raises(ValueError, match=rf"quantized_layers\[0\] is .*missing \['{field}'\]"):
        _grouped_damaged(field, KeyError)


def test_a_grouped_record_that_names_a_layer_twice_or_is_no_list_is_refused():
    twice = json.loads(json.dumps(GROUPED_RECORD))
    twice[1]["layers"].append("a")
    with pytest.raises(ValueError, match=r"quantized_layers\[1\]\.layers is \['b', 'a'\], .*\['a'\] named twice"):
        fx_fp8.DiffusersConfig(quantized_layers=twice)
    with pytest.raises(ValueError, match=r"quantized_layers is \{\}, expected a list of recipe entries"):
        fx_fp8.DiffusersConfig(quantized_layers={})
    with pytest.raises(ValueError, match=r"quantized_layers\[0\]\.layers is \[''\], expected a list of module names"):
        fx_fp8.DiffusersConfig(quantized_layers=[{**GROUPED_RECORD[0], "layers": [""]}])
