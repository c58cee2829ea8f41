"""cache_backend 'cache_dit''s cache_config: vLLM-Omni's keys checked one by one (no cache-dit import
needed to refuse a bad one) and turned into cache-dit's DBCacheConfig / TaylorSeerCalibratorConfig.
Enabling it on a transformer is fx_fp8/pipeline/cache_dit.py's."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from fx_fp8.config.values import check_known_key
from fx_fp8.install_hint import install_hint

#: the tested cache-dit range (pyproject's `cache-dit` extra)
CACHE_DIT_REQUIREMENT = "cache-dit>=1.5.3,<1.6"
MISSING = (
    f"cache_backend 'cache_dit' needs the cache-dit package: {install_hint('cache-dit')} "
    f"(or pip install '{CACHE_DIT_REQUIREMENT}')"
)


#: vLLM-Omni's cache_config keys -> (cache-dit config, its field). "scm_*" and "enable_taylorseer" /
#: "taylorseer_order" are vLLM-Omni's spellings of the step mask and the TaylorSeer calibrator.
CACHE_DIT_KEYS: dict[str, tuple[str, str]] = {
    "Fn_compute_blocks": ("db", "Fn_compute_blocks"),
    "Bn_compute_blocks": ("db", "Bn_compute_blocks"),
    "max_warmup_steps": ("db", "max_warmup_steps"),
    "warmup_interval": ("db", "warmup_interval"),
    "max_cached_steps": ("db", "max_cached_steps"),
    "max_continuous_cached_steps": ("db", "max_continuous_cached_steps"),
    "residual_diff_threshold": ("db", "residual_diff_threshold"),
    "max_accumulated_residual_diff_threshold": ("db", "max_accumulated_residual_diff_threshold"),
    "enable_separate_cfg": ("db", "enable_separate_cfg"),
    "cfg_compute_first": ("db", "cfg_compute_first"),
    "cfg_diff_compute_separate": ("db", "cfg_diff_compute_separate"),
    "num_inference_steps": ("db", "num_inference_steps"),
    "force_refresh_step_hint": ("db", "force_refresh_step_hint"),
    "force_refresh_step_policy": ("db", "force_refresh_step_policy"),
    "steps_computation_mask": ("db", "steps_computation_mask"),
    "scm_steps_mask_policy": ("scm", "mask_policy"),
    "scm_steps_policy": ("db", "steps_computation_policy"),
    "enable_taylorseer": ("calibrator", "enable_calibrator"),
    "enable_encoder_taylorseer": ("calibrator", "enable_encoder_calibrator"),
    "taylorseer_order": ("calibrator", "taylorseer_order"),
}
_INT_MIN = {
    "Fn_compute_blocks": 0,
    "Bn_compute_blocks": 0,
    "max_warmup_steps": 0,
    "warmup_interval": 1,
    "max_cached_steps": -1,
    "max_continuous_cached_steps": -1,
    "num_inference_steps": 1,
    "force_refresh_step_hint": 1,
    "taylorseer_order": 1,
}
_BOOLS = (
    "enable_separate_cfg",
    "cfg_compute_first",
    "cfg_diff_compute_separate",
    "enable_taylorseer",
    "enable_encoder_taylorseer",
)
_CHOICES = {
    "force_refresh_step_policy": ("once", "repeat"),
    "scm_steps_policy": ("dynamic", "static"),
    "scm_steps_mask_policy": ("slow", "medium", "fast", "ultra"),
}
_NULLABLE = (
    "max_accumulated_residual_diff_threshold",
    "enable_separate_cfg",
    "num_inference_steps",
    "force_refresh_step_hint",
    "steps_computation_mask",
    "scm_steps_mask_policy",
)


def _check(key: str, value) -> Any:
    where = f"cache_config.{key} for cache_backend 'cache_dit'"
    if value is None and key in _NULLABLE:
        return None
    if key in _INT_MIN:
        if isinstance(value, bool) or not isinstance(value, int) or value < _INT_MIN[key]:
            raise ValueError(f"invalid {where}: {value!r} (expected an integer >= {_INT_MIN[key]})")
        return value
    if key in ("residual_diff_threshold", "max_accumulated_residual_diff_threshold"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"invalid {where}: {value!r} (expected a finite number >= 0)")
        return float(value)
    if key in _BOOLS:
        if not isinstance(value, bool):
            raise ValueError(f"invalid {where}: {value!r} (expected true or false)")
        return value
    if key in _CHOICES:
        if value not in _CHOICES[key]:
            raise ValueError(f"invalid {where}: {value!r} (expected one of {list(_CHOICES[key])})")
        return value
    if key == "steps_computation_mask":
        if (
            not isinstance(value, (list, tuple))
            or not value
            or any(v not in (0, 1) or isinstance(v, bool) for v in value)
        ):
            raise ValueError(f"invalid {where}: {value!r} (expected a list of 0 / 1, one per step)")
        return [int(v) for v in value]
    return value


@dataclass
class CacheDitConfig:
    """The validated cache_config of cache_backend 'cache_dit' and cache-dit's config objects for it."""

    mapping: dict  # the keys as given (vLLM-Omni spellings)
    cache_config: Any  # cache_dit.DBCacheConfig
    calibrator_config: Any = None  # cache_dit.TaylorSeerCalibratorConfig or None

    def describe(self) -> str:
        text = self.cache_config.strify()
        return text + (
            ", TaylorSeer order " + str(self.calibrator_config.taylorseer_order)
            if self.calibrator_config is not None
            else ""
        )


def check_keys(mapping: Mapping) -> dict:
    """The cache-dit fields cache_config sets, by config ('db' / 'calibrator' / 'scm'); every key and
    value checked (no cache-dit import needed), the first bad one named in a ValueError."""
    out: dict = {"db": {}, "calibrator": {}, "scm": {}}
    for key, value in mapping.items():
        check_known_key(key, CACHE_DIT_KEYS, "cache_config", " for cache_backend 'cache_dit'")
        target, name = CACHE_DIT_KEYS[key]
        out[target][name] = _check(key, value)
    db, cal, scm = out["db"], out["calibrator"], out["scm"]
    # settings that would otherwise be dropped without a word
    if not cal.get("enable_calibrator"):
        for key, name, default in (
            ("taylorseer_order", "taylorseer_order", 1),
            ("enable_encoder_taylorseer", "enable_encoder_calibrator", False),
        ):
            if cal.get(name, default) != default:
                raise ValueError(
                    f"cache_config.{key} {cal[name]!r} needs enable_taylorseer: true (cache_backend "
                    "'cache_dit' runs the TaylorSeer calibrator only when it is enabled)"
                )
    if scm.get("mask_policy") is None and db.get("steps_computation_policy", "dynamic") != "dynamic":
        raise ValueError(
            f"cache_config.scm_steps_policy {db['steps_computation_policy']!r} needs "
            "scm_steps_mask_policy (or steps_computation_mask): without a step mask there is "
            "nothing for it to apply to"
        )
    if scm.get("mask_policy") is not None:
        if db.get("steps_computation_mask") is not None:
            raise ValueError("cache_config sets both scm_steps_mask_policy and steps_computation_mask: give one")
        steps = db.get("num_inference_steps")
        if steps is None or not (steps >= 8 or steps in (4, 6)):
            raise ValueError(
                f"cache_config.scm_steps_mask_policy {scm['mask_policy']!r} needs "
                f"cache_config.num_inference_steps (4, 6 or >= 8; got {steps!r}): cache-dit's "
                "predefined masks are laid out for the run's step count (the command line fills "
                "it in from --num-inference-steps / --steps)"
            )
    steps, mask = db.get("num_inference_steps"), db.get("steps_computation_mask")
    if mask is not None and steps is not None and len(mask) != steps:
        raise ValueError(f"cache_config.steps_computation_mask has {len(mask)} entries for num_inference_steps {steps}")
    return out


def import_cache_dit():
    try:
        import cache_dit
    except ImportError:
        raise ValueError(MISSING) from None
    _warnings_only()
    return cache_dit


def _warnings_only() -> None:
    """cache-dit logs each patch and context on stdout (one handler shared by its loggers),
    which would break the command line's JSON output: that handler writes to stderr, and passes
    warnings only unless the user chose a level (CACHE_DIT_LOG_LEVEL)."""
    import importlib
    import logging
    import os
    import sys

    handler = getattr(importlib.import_module("cache_dit.logger"), "_default_handler", None)
    if not isinstance(handler, logging.StreamHandler):
        return
    if handler.stream is sys.stdout or handler.stream is sys.__stdout__:
        handler.setStream(sys.stderr)
    if "CACHE_DIT_LOG_LEVEL" not in os.environ and handler.level < logging.WARNING:
        handler.setLevel(logging.WARNING)


def cache_dit_config(cache_config=None) -> CacheDitConfig:
    """cache_config (vLLM-Omni's keys) -> CacheDitConfig; unset keys take cache-dit's defaults."""
    mapping = dict(cache_config or {})
    fields = check_keys(mapping)
    cache_dit = import_cache_dit()
    db = dict(fields["db"])
    policy = fields["scm"].get("mask_policy")
    if policy is not None:
        db["steps_computation_mask"] = cache_dit.steps_mask(mask_policy=policy, total_steps=db["num_inference_steps"])
    try:
        config = cache_dit.DBCacheConfig(**db)
        calibrator = (
            cache_dit.TaylorSeerCalibratorConfig(**fields["calibrator"])
            if fields["calibrator"].get("enable_calibrator")
            else None
        )
    except (TypeError, ValueError, AssertionError) as e:
        raise ValueError(f"cache-dit rejected cache_config {mapping!r}: {e}") from None
    return CacheDitConfig(mapping=mapping, cache_config=config, calibrator_config=calibrator)
