"""The record of a quantized linear, in both files that describe one:

  flat     fx_fp8_quantization.json `layers` (save_quantized, fx_fp8/quant/checkpoint.py): one
           record per layer, its recipe with its shape, dtypes and activation buffers;
  grouped  config.json `quantization_config.quantized_layers` (fx_fp8/pipeline/diffusers_quantizer.py):
           one entry per recipe, naming its layers.

Both layouts carry the same recipe (RECIPE_FIELDS, a QuantizedLinear's attributes of the same
names): its vocabulary, allowed values and checks are written here once, as is how a
QuantizedLinear becomes a record and a record the plan QuantizedLinear.from_plan builds from.
The layouts differ only where files already written differ: a recipe without a block writes
weight_block [] (flat) or null (grouped). A damaged or hand-edited record is a ValueError naming
the file, the field and the bad value (Fields), never a KeyError.
"""

from __future__ import annotations

import copy
import reprlib
from typing import Optional

import torch

from fx_fp8.ops.formats import WEIGHT_ONLY
from fx_fp8.quant.layer_quantize import scale_shape
from fx_fp8.quant.linear_plan import LinearPlan
from fx_fp8.quant.quantized_linear import QuantizedLinear
from fx_fp8.quant.recipe import WeightRecipe, recipe

#: how a layer was quantized: the fields both layouts write (each a QuantizedLinear attribute)
RECIPE_FIELDS = ("method", "weight_granularity", "weight_block", "act_granularity")
#: a layer's activation granularities (WEIGHT_ONLY: unquantized activations)
ACT_GRANULARITIES = ("token", "tensor", "group", WEIGHT_ONLY)
#: a flat record's fields: the layer's shape, its recipe, its dtypes, which activation buffers it holds
FLAT_FIELDS = (
    "in_features",
    "out_features",
    "bias",
    *RECIPE_FIELDS,
    "weight_dtype",
    "orig_dtype",
    "input_scale",
    "input_smoothing",
)
#: flat fields older records lack (weight_only: act_granularity says it; input_step_groups: no per-step scales)
FLAT_OPTIONAL_FIELDS = ("weight_only", "input_step_groups")
#: a grouped entry's fields: one recipe and the names of its layers
GROUPED_FIELDS = (*RECIPE_FIELDS, "layers")
#: a quantized layer's tensors a checkpoint holds (its bias aside, which loads like any parameter)
QUANTIZED_TENSORS = QuantizedLinear._FROZEN_DTYPE
#: the ones a grouped record implies: it covers dynamic activation scales only
GROUPED_TENSORS = ("weight", "weight_scale")
#: what a flat record's failures tell the user
SAVE_QUANTIZED_AGAIN = "the file was edited or is not what save_quantized wrote: save the model again"


def _short(value) -> str:
    return reprlib.repr(value)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Fields:
    """The checks of one description: each failure names `where` (the file), the field and its value."""

    def __init__(self, where: str, remedy: str = SAVE_QUANTIZED_AGAIN):
        self.where, self.remedy = where, remedy

    def fail(self, field: str, value, expected: str):
        raise ValueError(f"{self.where} is damaged: {field} is {_short(value)}, expected {expected} ({self.remedy})")

    def int(self, field: str, value) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            self.fail(field, value, "a positive integer")

    def bool(self, field: str, value) -> None:
        if not isinstance(value, bool):
            self.fail(field, value, "true or false")

    def str(self, field: str, value, *, optional: bool = False) -> None:
        if not (isinstance(value, str) and value) and not (optional and value is None):
            self.fail(field, value, "a non-empty string" + (" or null" if optional else ""))

    def dtype(self, field: str, value, *, optional: bool = False) -> None:
        if optional and value is None:
            return
        if not isinstance(value, str) or not isinstance(getattr(torch, value, None), torch.dtype):
            self.fail(field, value, "the name of a torch dtype (e.g. \"bfloat16\")" + (" or null" if optional else ""))

    def mapping(self, field: str, value, *, optional: bool = False) -> dict:
        if optional and value is None:
            return {}
        if not isinstance(value, dict) or not all(isinstance(k, str) and k for k in value):
            self.fail(field, value, "an object keyed by module or tensor names")
        return value

    def entry(self, field: str, value, keys, optional=()) -> dict:
        keys, optional = set(keys), set(optional)
        if not isinstance(value, dict):
            self.fail(field, value, f"an object with the keys {sorted(keys)}")
        missing, extra = keys - set(value), set(value) - keys - optional
        if missing or extra:
            self.fail(
                field,
                value,
                f"an object with the keys {sorted(keys)}"
                + (f" (missing {sorted(missing)})" if missing else "")
                + (f" (unknown {sorted(extra)})" if extra else ""),
            )
        return value


def _ints(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


# -- the recipe, in either layout -----------------------------------------------------------------------
def recipe_record(layer: QuantizedLinear, *, null_block: bool) -> dict:
    """The RECIPE_FIELDS of a layer as JSON values; `null_block`: a recipe without a block writes
    weight_block null (grouped) instead of [] (flat)."""
    rec = {key: copy.copy(getattr(layer, key)) for key in RECIPE_FIELDS}
    rec["weight_block"] = list(layer.weight_block) or (None if null_block else [])
    return rec


def check_recipe(f: Fields, field: str, rec: dict, *, null_block: bool) -> None:
    """The RECIPE_FIELDS of the record `rec` (at `field`): a recipe fx_fp8 knows."""
    block = rec["weight_block"]
    if not (_ints(block) or (null_block and block is None)):
        f.fail(
            f"{field}.weight_block",
            block,
            f"a list of integers ({'null' if null_block else '[]'} unless weight_granularity is \"block\")",
        )
    try:
        WeightRecipe(rec["method"], rec["weight_granularity"], tuple(block or ()) or None)
    except (ValueError, TypeError) as e:
        f.fail(
            f"{field}.method / weight_granularity / weight_block",
            [rec["method"], rec["weight_granularity"], block],
            f"a weight recipe fx_fp8 knows ({e})",
        )
    if rec["act_granularity"] not in ACT_GRANULARITIES:
        f.fail(f"{field}.act_granularity", rec["act_granularity"], f"one of {list(ACT_GRANULARITIES)}")


def weight_recipe(rec: dict) -> WeightRecipe:
    """The WeightRecipe of a checked record (either layout)."""
    return recipe(rec["method"], rec["weight_granularity"], tuple(rec["weight_block"] or ()) or None)


def stored_plan(rec: dict) -> LinearPlan:
    """The plan the recorded layer was quantized with (QuantizedLinear.from_plan builds it back)."""
    return LinearPlan.stored(weight_recipe(rec), rec["act_granularity"], rec.get("input_step_groups"))


# -- flat: one record per layer (save_quantized) ----------------------------------------------------------
def flat_record(layer: QuantizedLinear) -> dict:
    rec = {
        "in_features": layer.in_features,
        "out_features": layer.out_features,
        "bias": layer.bias is not None,
        **recipe_record(layer, null_block=False),
        "weight_dtype": dtype_name(layer.weight.dtype),
        "orig_dtype": dtype_name(layer.orig_dtype),
        "input_scale": layer.input_scale is not None,
        "input_smoothing": layer.input_smoothing is not None,
        "weight_only": layer.weight_only,
        "input_step_groups": list(layer.input_step_groups) if layer.input_step_groups is not None else None,
    }
    return {key: rec[key] for key in (*FLAT_FIELDS, *FLAT_OPTIONAL_FIELDS)}


def check_flat(f: Fields, name: str, rec) -> None:
    field = f"layers[{name!r}]"
    f.entry(field, rec, FLAT_FIELDS, optional=FLAT_OPTIONAL_FIELDS)
    for key in ("in_features", "out_features"):
        f.int(f"{field}.{key}", rec[key])
    for key in ("bias", "input_scale", "input_smoothing", *(("weight_only",) if "weight_only" in rec else ())):
        f.bool(f"{field}.{key}", rec[key])
    for key in ("weight_dtype", "orig_dtype"):
        f.dtype(f"{field}.{key}", rec[key])
    check_recipe(f, field, rec, null_block=False)
    groups = rec.get("input_step_groups")
    if groups is not None and (not _ints(groups) or not groups or len(groups) % 2):
        f.fail(f"{field}.input_step_groups", groups, "null or a non-empty list of integers, two per step group")


def flat_tensor_shapes(name: str, rec: dict) -> dict:
    """{key: expected shape} of the entries a checked flat record says its layer holds."""
    n, k = rec["out_features"], rec["in_features"]
    keys = {f"{name}.weight": (n, k), f"{name}.weight_scale": scale_shape(weight_recipe(rec), n, k)}
    if rec["bias"]:
        keys[f"{name}.bias"] = (n,)
    if rec["input_scale"]:
        keys[f"{name}.input_scale"] = ()
    if rec["input_smoothing"]:
        keys[f"{name}.input_smoothing"] = (k,)
    if rec.get("input_step_groups"):  # per-step static scales: one per step group
        keys[f"{name}.input_step_scales"] = (len(rec["input_step_groups"]) // 2,)
    return keys


# -- grouped: one entry per recipe (config.json) -----------------------------------------------------------
def grouped_records(layers: dict) -> list[dict]:
    """[{RECIPE_FIELDS..., layers: [names]}] of {name: QuantizedLinear}, one entry per recipe."""
    groups: dict[tuple, tuple] = {}
    for name, m in layers.items():
        extra = [k for k in QUANTIZED_TENSORS if k not in GROUPED_TENSORS and getattr(m, k) is not None]
        if extra:
            raise ValueError(
                f"{name} holds {extra}: a config.json record of quantized layers covers dynamic "
                "activation scales only; save such a model with fx_fp8.save_quantized"
            )
        rec = recipe_record(m, null_block=True)
        key = tuple(tuple(v) if isinstance(v, list) else v for v in rec.values())
        groups.setdefault(key, (rec, []))[1].append(name)
    return [{**rec, "layers": names} for rec, names in groups.values()]


def check_grouped(f: Fields, record) -> Optional[list]:
    """A grouped record, checked (None stays None): a copy."""
    if record is None:
        return None
    if not isinstance(record, list):
        f.fail("quantized_layers", record, "a list of recipe entries")
    seen: set = set()
    for i, entry in enumerate(record):
        field = f"quantized_layers[{i}]"
        f.entry(field, entry, GROUPED_FIELDS)
        check_recipe(f, field, entry, null_block=True)
        names = entry["layers"]
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            f.fail(f"{field}.layers", names, "a list of module names")
        twice = sorted(seen.intersection(names))
        if twice:
            f.fail(f"{field}.layers", names, f"names no earlier entry holds ({twice} named twice)")
        seen.update(names)
    return copy.deepcopy(record)


def grouped_plans(record: list) -> dict:
    """{layer name: the LinearPlan it was quantized with} of a checked grouped record."""
    return {name: stored_plan(entry) for entry in record for name in entry["layers"]}
