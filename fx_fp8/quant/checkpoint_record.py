"""The fields of a quantized checkpoint's fx_fp8_quantization.json (fx_fp8/quant/checkpoint.py),
checked one by one before anything is built (a quantized layer's record: fx_fp8/quant/layer_record.py):
a hand-edited or damaged description is a ValueError naming the file and the field, never a
KeyError, an IndexError or diffusers' error about some other folder."""

from __future__ import annotations

from fx_fp8.quant.layer_record import Fields, check_flat

_BFL_KEYS = {"class", "in_features", "out_features", "bias", "compute_dtype", "reason"}


def _check_bfl(f: Fields, name: str, rec) -> None:
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
    f = Fields(repr(path))
    f.str("model_class", record.get("model_class"))
    if not record["model_class"].isidentifier():
        f.fail("model_class", record["model_class"], "the name of a model class")
    if record.get("diffusers_config") not in (None, config_name):
        f.fail("diffusers_config", record.get("diffusers_config"), f"{config_name!r} or null")
    for name, rec in f.mapping("layers", record.get("layers")).items():
        check_flat(f, name, rec)
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
    for name, dtype in f.mapping(
        "nonpersistent_buffer_dtypes", record.get("nonpersistent_buffer_dtypes"), optional=True
    ).items():
        f.dtype(f"nonpersistent_buffer_dtypes[{name!r}]", dtype)


def check_index(index: dict, path: str, attrs: tuple) -> list:
    """The components of a pipeline's index: a non-empty list of distinct transformer attributes."""
    components = index.get("components")
    if (
        not isinstance(components, list)
        or not components
        or not all(isinstance(c, str) and c in attrs for c in components)
        or len(set(components)) != len(components)
    ):
        Fields(repr(path)).fail("components", components, f"a non-empty list of distinct names among {list(attrs)}")
    return components
