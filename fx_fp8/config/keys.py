"""The flat keys FP8Config.from_kwargs and replace take, and normalise_keys: the one place
their spellings become canonical (legacy kv_cache_* keys, the flat shortcuts `ignored_layers` /
`quantization_skip_steps[_mode]`, `quantization_config` given as a method name, vLLM-Omni's
`quantize_sensitive`) and unknown keys are refused. Reading the keys out of a file is
fx_fp8.config.files."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Mapping

from fx_fp8.config.quantization import QUANTIZATION_METHODS, QuantizationConfig, clean_patterns, fold_quantize_sensitive
from fx_fp8.config.selectors import parse_selector
from fx_fp8.config.values import check_choice, did_you_mean, is_off, short_repr

#: the keys of a flat FP8 config (legacy kv_cache_* spellings aside: normalise_keys folds them)
TOP_KEYS = (
    "diffusion_kv_cache_dtype",
    "diffusion_kv_cache_skip_steps",
    "diffusion_kv_cache_skip_layers",
    "quantization",
    "quantization_config",
    "ignored_layers",
    "attention",
    "lowering",
    "downstream",
    "quantization_skip_steps",
    "quantization_skip_steps_mode",
)
#: flat spellings of quantization_config keys (CLI flags, compile_pipeline keywords); unlike
#: ignored_layers they are no linear opt-in: like diffusion_kv_cache_skip_steps, they select steps
STEP_SHORTCUTS = {"quantization_skip_steps": "skip_steps", "quantization_skip_steps_mode": "skip_steps_mode"}
#: vLLM-Omni's older spellings of the diffusion_kv_cache_* keys
LEGACY_KEYS = {
    "kv_cache_dtype": "diffusion_kv_cache_dtype",
    "kv_cache_skip_steps": "diffusion_kv_cache_skip_steps",
    "kv_cache_skip_layers": "diffusion_kv_cache_skip_layers",
}
#: keys of a config that belong to fx_fp8.pipeline.options.PipelineOptions, not to FP8Config
PIPELINE_KEYS = ("parallel_config", "cache_backend", "cache_config")


@dataclass(frozen=True)
class NormalisedKeys:
    """Flat config keys in one spelling: `data` holds only TOP_KEYS but the shortcuts (which are
    merged into its quantization_config, then a dict), no legacy key, no `quantize_sensitive`."""

    data: dict
    #: quantization_config or a non-empty ignored_layers was given: from_kwargs' linear opt-in
    linear_opt_in: bool


def normalise_keys(raw: Mapping, *, quantization=None) -> NormalisedKeys:
    """The key rules FP8Config.from_kwargs and replace share. `quantization`: the method in force
    when `raw` names none (replace's base), which an explicit quantization_config.method must match."""
    data = fold_legacy_keys(dict(raw))
    check_keys(data)
    shortcuts = pop_step_shortcuts(data)
    # [] / "" / None (an empty --ignored-layers) mean "no patterns", not a linear opt-in
    ignored = clean_patterns(data.pop("ignored_layers")) if "ignored_layers" in data else None
    linear_opt_in = data.get("quantization_config") is not None or bool(ignored)
    qc = data.get("quantization_config")
    if isinstance(qc, str):  # vLLM-Omni's tests pass quantization_config="fp8"
        qc = {"method": qc}
    if isinstance(qc, Mapping):
        data["quantization_config"] = fold_quantize_sensitive(qc)
    elif qc is not None and not isinstance(qc, QuantizationConfig):
        raise ValueError(f"invalid quantization_config {short_repr(qc)}: expected a mapping")
    check_method_agrees(data.get("quantization", quantization), data.get("quantization_config"))
    if ignored is not None:
        merge_ignored_layers_shortcut(data, ignored)
    apply_step_shortcuts(data, shortcuts)
    return NormalisedKeys(data, linear_opt_in)


def check_keys(data: Mapping) -> None:
    """Refuse what is no flat FP8 key, saying what it is where we know (a pipeline option, a
    component map) and the closest key otherwise."""
    for key in data:
        if key in PIPELINE_KEYS:  # a pipeline option, read by fx_fp8.pipeline.options.PipelineOptions
            raise ValueError(
                f"{short_repr(key)} is a pipeline option, not an FP8 option: pass it to "
                "fx_fp8.compile_pipeline (or put it in the YAML given to it)"
            )
        if key not in TOP_KEYS:
            raise ValueError(f"unknown config key {short_repr(key)}{did_you_mean(key, TOP_KEYS + tuple(LEGACY_KEYS))}")
    quantization = data.get("quantization")
    if isinstance(quantization, Mapping) and not {"method", "quant_method"} & set(quantization):
        raise ValueError(
            f"quantization {short_repr(dict(quantization))} maps pipeline components (vLLM-Omni's "
            "component map): fx_fp8.compile_pipeline reads it; one model takes a method ('fp8', "
            "'int8') or None"
        )


def fold_legacy_keys(data: dict) -> dict:
    """kv_cache_* -> diffusion_kv_cache_*. The new key wins when both have a value (with a
    warning if they differ); a new key whose value is None counts as not given."""
    for old, new in LEGACY_KEYS.items():
        if old in data:
            old_value = data.pop(old)
            if data.get(new) is not None and old_value is not None and data[new] != old_value:
                # stacklevel: the caller of FP8Config.from_kwargs / replace
                warnings.warn(
                    f"both {new!r} and legacy {old!r} given; using {new}={short_repr(data[new])}", stacklevel=4
                )
            elif data.get(new) is None and (old_value is not None or new not in data):
                data[new] = old_value
    return data


def check_method_agrees(quantization, qc) -> None:
    """`quantization` and an explicit quantization_config.method must name the same method (the
    dataclass cannot tell an explicit "fp8" from the default)."""
    if not isinstance(qc, Mapping) or qc.get("method") is None or is_off(quantization):
        return
    method = check_choice("quantization_config.method", qc["method"], QUANTIZATION_METHODS[1:])
    if method != check_choice("quantization", quantization, QUANTIZATION_METHODS):
        raise ValueError(
            f"quantization {short_repr(quantization)} disagrees with quantization_config.method {short_repr(qc['method'])}: "
            "give one of them, or the same method in both"
        )


def pop_step_shortcuts(data: dict) -> dict:
    """{quantization_config key: value} of the flat quantization_skip_steps[_mode] keys, removed
    from `data` (a None value counts as not given)."""
    out = {}
    for flat, inner in STEP_SHORTCUTS.items():
        value = data.pop(flat, None)
        if value is not None:
            out[inner] = parse_selector(value, what=flat, relative=True) if inner == "skip_steps" else value
    return out


def apply_step_shortcuts(data: dict, shortcuts: dict) -> None:
    """Merge the popped shortcuts into data["quantization_config"]; a key given both ways must agree."""
    if not shortcuts:
        return
    qc = _as_dict(data.get("quantization_config"))
    for inner, value in shortcuts.items():
        flat = next(k for k, v in STEP_SHORTCUTS.items() if v == inner)
        given = qc.get(inner)
        if inner == "skip_steps" and given is not None:
            given = parse_selector(given, what="quantization_config.skip_steps", relative=True)
            if not given:
                given = None
        if given is not None and given != value:
            raise ValueError(
                f"{flat} {short_repr(str(value))} disagrees with quantization_config.{inner} {short_repr(str(given))}: "
                "give one of them, or the same value in both"
            )
        qc[inner] = value
    data["quantization_config"] = qc


def merge_ignored_layers_shortcut(data: dict, shortcut: tuple) -> None:
    """Top-level `ignored_layers` (cleaned patterns) goes into quantization_config; given twice it must agree."""
    qc = _as_dict(data.get("quantization_config"))
    inner = clean_patterns(qc.get("ignored_layers"))
    if inner and shortcut and inner != shortcut:
        raise ValueError(
            f"ignored_layers given twice with different values: {short_repr(list(shortcut))} and "
            f"quantization_config.ignored_layers={short_repr(list(inner))}"
        )
    qc["ignored_layers"] = shortcut or inner
    data["quantization_config"] = qc


def _as_dict(qc) -> dict:
    if qc is None:
        return {}
    if isinstance(qc, QuantizationConfig):
        return dataclasses.asdict(qc)
    if not isinstance(qc, Mapping):
        raise ValueError(f"invalid quantization_config {short_repr(qc)}: expected a mapping")
    return dict(qc)
