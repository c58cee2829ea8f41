"""The fields of a quantized checkpoint's fx_fp8_quantization.json (fx_fp8/quant/checkpoint.py),
checked one by one before anything is built: a hand-edited or damaged description is a
ValueError naming the file and the field, never a KeyError, an IndexError or diffusers'
error about some other folder."""
from __future__ import annotations

import reprlib

import torch

from fx_fp8.ops.formats import WEIGHT_ONLY
from fx_fp8.quant.recipe import WeightRecipe

#: a layer's activation granularities (WEIGHT_ONLY: unquantized activations)
ACT_GRANULARITIES = ("token", "tensor", "group", WEIGHT_ONLY)
_INT, _BOOL, _STR = "a positive integer", "true or false", "a string"


def _short(value) -> str:
    return reprlib.repr(value)


class _Fields:
    """The checks of one description file: each failure names the file and the field."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, field: str, value, expected: str):
        raise ValueError(f"{self.path!r} is damaged: {field} is {_short(value)}, expected {expected} (the file was "
                         "edited or is not what save_quantized wrote: save the model again)")

    def int(self, field: str, value) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            self.fail(field, value, _INT)

    def bool(self, field: str, value) -> None:
        if not isinstance(value, bool):
            self.fail(field, value, _BOOL)

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

    def entry(self, field: str, value, keys: set, optional: set = frozenset()) -> dict:
        if not isinstance(value, dict):
            self.fail(field, value, f"an object with the keys {sorted(keys)}")
        missing, extra = keys - set(value), set(value) - keys - optional
        if missing or extra:
            self.fail(field, value, f"an object with the keys {sorted(keys)}"
                      + (f" (missing {sorted(missing)})" if missing else "")
                      + (f" (unknown {sorted(extra)})" if extra else ""))
        return value


_LAYER_KEYS = {"in_features", "out_features", "bias", "method", "weight_dtype", "weight_granularity", "weight_block",
               "act_granularity", "orig_dtype", "input_scale", "input_smoothing"}
_BFL_KEYS = {"class", "in_features", "out_features", "bias", "compute_dtype", "reason"}


def _check_layer(f: _Fields, name: str, rec) -> None:
    field = f"layers[{name!r}]"
    f.entry(field, rec, _LAYER_KEYS, optional={"weight_only", "input_step_groups"})
    for key in ("in_features", "out_features"):
        f.int(f"{field}.{key}", rec[key])
    for key in ("bias", "input_scale", "input_smoothing", *(("weight_only",) if "weight_only" in rec else ())):
        f.bool(f"{field}.{key}", rec[key])
    for key in ("weight_dtype", "orig_dtype"):
        f.dtype(f"{field}.{key}", rec[key])
    block = rec["weight_block"]
    if not isinstance(block, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in block):
        f.fail(f"{field}.weight_block", block, "a list of integers ([] unless weight_granularity is \"block\")")
    try:
        WeightRecipe(rec["method"], rec["weight_granularity"], tuple(block) or None)
    except (ValueError, TypeError) as e:
        f.fail(f"{field}.method / weight_granularity / weight_block",
               [rec["method"], rec["weight_granularity"], block], f"a weight recipe fx_fp8 knows ({e})")
    if rec["act_granularity"] not in ACT_GRANULARITIES:
        f.fail(f"{field}.act_granularity", rec["act_granularity"], f"one of {list(ACT_GRANULARITIES)}")
    groups = rec.get("input_step_groups")
    if groups is not None and (not isinstance(groups, list) or not groups or len(groups) % 2 or not all(
            isinstance(g, int) and not isinstance(g, bool) for g in groups)):
        f.fail(f"{field}.input_step_groups", groups, "null or a non-empty list of integers, two per step group")


def _check_bfl(f: _Fields, name: str, rec) -> None:
    field = f"bfl_fp8r_native[{name!r}]"
    f.entry(field, rec, _BFL_KEYS)
    if rec["class"] != "BFLFP8RLinear":
        f.fail(f"{field}.class", rec["class"], "\"BFLFP8RLinear\"")
    for key in ("in_features", "out_features"):
        f.int(f"{field}.{key}", rec[key])
    f.bool(f"{field}.bias", rec["bias"])
    f.dtype(f"{field}.compute_dtype", rec["compute_dtype"], optional=True)
    f.str(f"{field}.reason", rec["reason"], optional=True)


def check_record(record: dict, path: str, config_name: str) -> None:
    """Every field load_quantized reads from a model's description (format and version are
    checked by the caller; the digests where they are verified)."""
    f = _Fields(path)
    f.str("model_class", record.get("model_class"))
    if not record["model_class"].isidentifier():
        f.fail("model_class", record["model_class"], "the name of a model class")
    if record.get("diffusers_config") not in (None, config_name):
        f.fail("diffusers_config", record.get("diffusers_config"), f"{config_name!r} or null")
    for name, rec in f.mapping("layers", record.get("layers")).items():
        _check_layer(f, name, rec)
    for name, reason in f.mapping("native", record.get("native")).items():
        f.str(f"native[{name!r}]", reason, optional=True)
    bfl = f.mapping("bfl_fp8r_native", record.get("bfl_fp8r_native"), optional=True)
    for name, rec in bfl.items():
        _check_bfl(f, name, rec)
    both = sorted(set(bfl) & set(record["layers"]))
    if both:
        f.fail(f"bfl_fp8r_native[{both[0]!r}]", bfl[both[0]], "a layer not also in layers")
    tied = f.mapping("tied", record.get("tied"), optional=True)
    for alias, source in tied.items():
        f.str(f"tied[{alias!r}]", source)
        if source == alias or source in tied:
            f.fail(f"tied[{alias!r}]", source, "the key of a tensor stored in the weights file (not an alias)")
    for name, dtype in f.mapping("nonpersistent_buffer_dtypes", record.get("nonpersistent_buffer_dtypes"),
                                 optional=True).items():
        f.dtype(f"nonpersistent_buffer_dtypes[{name!r}]", dtype)


def check_index(index: dict, path: str, attrs: tuple) -> list:
    """The components of a pipeline's index: a non-empty list of distinct transformer attributes."""
    components = index.get("components")
    if not isinstance(components, list) or not components or not all(
            isinstance(c, str) and c in attrs for c in components) or len(set(components)) != len(components):
        _Fields(path).fail("components", components, f"a non-empty list of distinct names among {list(attrs)}")
    return components
