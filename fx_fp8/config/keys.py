"""The flat keys FP8Config.from_kwargs and replace take, and how the flat shortcuts
(`ignored_layers`, `quantization_skip_steps[_mode]`) and `quantization` merge into
quantization_config. Reading the keys out of a file is fx_fp8.config.files."""
from __future__ import annotations

import dataclasses
from typing import Mapping

from fx_fp8.config.quantization import QUANTIZATION_METHODS, QuantizationConfig, clean_patterns
from fx_fp8.config.selectors import parse_selector
from fx_fp8.config.values import check_choice, is_off, short_repr

#: the keys of a flat FP8 config (legacy kv_cache_* spellings aside: fx_fp8.config.files folds them)
TOP_KEYS = (
    "diffusion_kv_cache_dtype", "diffusion_kv_cache_skip_steps", "diffusion_kv_cache_skip_layers",
    "quantization", "quantization_config", "ignored_layers", "attention", "lowering", "downstream",
    "quantization_skip_steps", "quantization_skip_steps_mode",
)
#: flat spellings of quantization_config keys (CLI flags, compile_pipeline keywords); unlike
#: ignored_layers they are no linear opt-in: like diffusion_kv_cache_skip_steps, they select steps
STEP_SHORTCUTS = {"quantization_skip_steps": "skip_steps", "quantization_skip_steps_mode": "skip_steps_mode"}


def check_method_agrees(data: dict) -> None:
    """`quantization` and an explicit quantization_config.method must name the same method (the
    dataclass cannot tell an explicit "fp8" from the default)."""
    qc, quantization = data.get("quantization_config"), data.get("quantization")
    if not isinstance(qc, Mapping) or qc.get("method") is None or is_off(quantization):
        return
    method = check_choice("quantization_config.method", qc["method"], QUANTIZATION_METHODS[1:])
    if method != check_choice("quantization", quantization, QUANTIZATION_METHODS):
        raise ValueError(f"quantization {short_repr(quantization)} disagrees with quantization_config.method {short_repr(qc['method'])}: "
                         "give one of them, or the same method in both")


def pop_step_shortcuts(data: dict) -> dict:
    """{quantization_config key: value} of the flat quantization_skip_steps[_mode] keys, removed
    from `data` (a None value counts as not given). They are merged after the opt-in rules: they
    select steps, they switch no feature on or off."""
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
    qc = data.get("quantization_config")
    qc = dataclasses.asdict(qc) if isinstance(qc, QuantizationConfig) else dict(qc or {})
    for inner, value in shortcuts.items():
        flat = next(k for k, v in STEP_SHORTCUTS.items() if v == inner)
        given = qc.get(inner)
        if inner == "skip_steps" and given is not None:
            given = parse_selector(given, what="quantization_config.skip_steps", relative=True)
            if not given:
                given = None
        if given is not None and given != value:
            raise ValueError(f"{flat} {short_repr(str(value))} disagrees with quantization_config.{inner} {short_repr(str(given))}: "
                             "give one of them, or the same value in both")
        qc[inner] = value
    data["quantization_config"] = qc


def merge_ignored_layers_shortcut(data: dict) -> None:
    """Top-level `ignored_layers` goes into quantization_config; given twice it must agree."""
    shortcut = clean_patterns(data.pop("ignored_layers"))
    qc = data.get("quantization_config") or {}
    qc = dataclasses.asdict(qc) if isinstance(qc, QuantizationConfig) else dict(qc)
    inner = clean_patterns(qc.get("ignored_layers"))
    if inner and shortcut and inner != shortcut:
        raise ValueError(f"ignored_layers given twice with different values: {short_repr(list(shortcut))} and "
                         f"quantization_config.ignored_layers={short_repr(list(inner))}")
    qc["ignored_layers"] = shortcut or inner
    data["quantization_config"] = qc
