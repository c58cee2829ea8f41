"""Pipeline options next to FP8, in vLLM-Omni's words: parsed and validated, nothing applied.

    parallel_config: {ulysses_degree: 2, ring_degree: 1}
        -> diffusers.ContextParallelConfig (applied by context_parallel.py)
    cache_backend: first_block_cache | taylorseer | mag_cache,  cache_config: {...}
        -> diffusers.FirstBlockCacheConfig / TaylorSeerCacheConfig / MagCacheConfig (cache_hooks.py)
    cache_backend: cache_dit,  cache_config: {Fn_compute_blocks: 1, ...}
        -> cache_dit.DBCacheConfig (+ TaylorSeerCalibratorConfig) (cache_dit.py)

These are pipeline options (`PipelineOptions`), not FP8 options: a YAML may carry them next to
the FP8 keys (flat, or in a vLLM-Omni stage config's engine_args), `FP8Config` ignores them and
`PipelineOptions.load` reads them.

Not supported (a ValueError naming the value, never silently ignored): vLLM-Omni's `tea_cache`
(diffusers has no TeaCache hook), `step_cache`, `ref_hint`, and parallel options other than the
two degrees.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

from fx_fp8.config.files import config_keys, read_config_file
from fx_fp8.config.values import check_known_key, did_you_mean, short_repr
from fx_fp8.pipeline.cache_dit_config import CACHE_DIT_KEYS, cache_dit_config

# -- cache backends -------------------------------------------------------------------------------
#: canonical name -> the diffusers config class (in diffusers.hooks)
CACHE_BACKENDS: dict[str, str] = {
    "first_block_cache": "FirstBlockCacheConfig",
    "taylorseer": "TaylorSeerCacheConfig",
    "mag_cache": "MagCacheConfig",
    "cache_dit": "DBCacheConfig",  # the cache-dit library (cache_dit.py), not a diffusers hook
}

CACHE_ALIASES = {
    "fbc": "first_block_cache",
    "first_block": "first_block_cache",
    "firstblockcache": "first_block_cache",
    "first_block_cache": "first_block_cache",
    "taylorseer": "taylorseer",
    "taylorseer_cache": "taylorseer",
    "taylor_seer": "taylorseer",
    "mag_cache": "mag_cache",
    "magcache": "mag_cache",
    "cache_dit": "cache_dit",
    "cachedit": "cache_dit",
}


#: vLLM-Omni backends (and diffusers ones) fx_fp8 does not map, with the reason
UNSUPPORTED_CACHE_BACKENDS = {
    "tea_cache": (
        "diffusers has no TeaCache hook (vLLM-Omni implements TeaCache itself); diffusers' "
        "first_block_cache is the closest (skip the remaining blocks while the first block's residual "
        "barely changes)"
    ),
    "step_cache": "vLLM-Omni's DreamZero velocity step cache has no diffusers counterpart",
    "ref_hint": "vLLM-Omni's reference-hint cache has no diffusers counterpart",
    "sea_cache": "diffusers' SeaCache needs per-step sigma in the cache context; not tested with fx_fp8",
    "faster_cache": "diffusers' FasterCache needs a timestep callback and batched CFG; not tested with fx_fp8",
    "pyramid_attention_broadcast": "diffusers' PyramidAttentionBroadcast needs a timestep callback; not tested with fx_fp8",
}


#: cache_config keys per backend: our key -> diffusers field. vLLM-Omni's spellings are accepted
#: (mag_threshold, taylorseer_order, ...) next to diffusers' own.
CACHE_KEYS = {
    "first_block_cache": {"threshold": "threshold", "residual_diff_threshold": "threshold"},
    "taylorseer": {
        "cache_interval": "cache_interval",
        "disable_cache_before_step": "disable_cache_before_step",
        "disable_cache_after_step": "disable_cache_after_step",
        "max_order": "max_order",
        "taylorseer_order": "max_order",
        "taylor_factors_dtype": "taylor_factors_dtype",
        "skip_predict_identifiers": "skip_predict_identifiers",
        "cache_identifiers": "cache_identifiers",
        "use_lite_mode": "use_lite_mode",
    },
    "mag_cache": {
        "threshold": "threshold",
        "mag_threshold": "threshold",
        "max_skip_steps": "max_skip_steps",
        "mag_max_skip_steps": "max_skip_steps",
        "retention_ratio": "retention_ratio",
        "mag_retention_ratio": "retention_ratio",
        "num_inference_steps": "num_inference_steps",
        "mag_ratios": "mag_ratios",
        "calibrate": "calibrate",
        "mag_calibrate": "calibrate",
    },
    "cache_dit": {k: k for k in CACHE_DIT_KEYS},
}

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


# -- parallel options -----------------------------------------------------------------------------
PARALLEL_KEYS = ("ulysses_degree", "ring_degree")


#: vLLM-Omni parallel keys with no implementation under fx_fp8, and why (1 / None, "off", is accepted)
UNSUPPORTED_PARALLEL_KEYS = {
    "cfg_parallel_size": "CFG parallelism (the conditional and unconditional branches on two devices) is "
    "vLLM-Omni's own runner feature; diffusers 0.42 and cache-dit 1.5 have no option for it "
    "(searched: no cfg-parallel setting in either), so fx_fp8 has nothing to map it onto; "
    "run both branches on each device, or split the devices with ulysses_degree / ring_degree",
}


def _degree(name: str, value) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"invalid parallel_config.{name} {short_repr(value)}: expected an integer >= 1")
    return value


@dataclass(frozen=True)
class ParallelOptions:
    """vLLM-Omni's sequence-parallel degrees; the processes needed are their product."""

    ulysses_degree: int = 1
    ring_degree: int = 1

    def __post_init__(self):
        object.__setattr__(self, "ulysses_degree", _degree("ulysses_degree", self.ulysses_degree))
        object.__setattr__(self, "ring_degree", _degree("ring_degree", self.ring_degree))

    @property
    def world_size(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_value(cls, value) -> "ParallelOptions":
        """None, a ParallelOptions, or a mapping {ulysses_degree, ring_degree}."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(
                f"invalid parallel_config {short_repr(value)}: expected a mapping such as "
                "{ulysses_degree: 2, ring_degree: 1}"
            )
        for key in value:
            if key in UNSUPPORTED_PARALLEL_KEYS and value[key] not in (None, 1):
                raise ValueError(
                    f"parallel_config {short_repr(key)}={short_repr(value[key])} is not supported: "
                    f"{UNSUPPORTED_PARALLEL_KEYS[key]}"
                )
            if key in UNSUPPORTED_PARALLEL_KEYS:
                continue  # the value that means "off"
            if key not in PARALLEL_KEYS:
                raise ValueError(
                    f"unsupported parallel_config key {short_repr(key)}{did_you_mean(key, PARALLEL_KEYS)}: fx_fp8 "
                    f"maps only {list(PARALLEL_KEYS)} onto diffusers' ContextParallelConfig"
                )
        return cls(**{k: v for k, v in value.items() if v is not None and k in PARALLEL_KEYS})

    def to_dict(self) -> dict:
        return {"ulysses_degree": self.ulysses_degree, "ring_degree": self.ring_degree}


def canonical_cache_backend(name) -> Optional[str]:
    """'first_block_cache' / 'taylorseer' / 'mag_cache', or None for no cache; a ValueError naming
    the value for anything else (tea_cache and the other vLLM-Omni backends diffusers lacks included)."""
    if name is None:
        return None
    if not isinstance(name, str):
        raise ValueError(f"invalid cache_backend {short_repr(name)}: expected a name such as 'first_block_cache'")
    key = name.strip().lower().replace("-", "_")
    if key in ("", "none", "null"):
        return None
    if key in CACHE_ALIASES:
        return CACHE_ALIASES[key]
    supported = ", ".join(CACHE_BACKENDS)
    if key in UNSUPPORTED_CACHE_BACKENDS:
        raise ValueError(
            f"cache_backend {short_repr(name)} is not supported: {UNSUPPORTED_CACHE_BACKENDS[key]}. "
            f"Supported: {supported}"
        )
    raise ValueError(
        f"unknown cache_backend {short_repr(name)}{did_you_mean(key, list(CACHE_ALIASES))}: expected one of "
        f"{supported} (or none)"
    )


def cache_config_mapping(value) -> dict:
    """cache_config as a dict: a mapping, or its JSON text (--cache-config '{\"threshold\": 0.1}')."""
    if value is None:
        return {}
    if isinstance(value, str):  # --cache-config '{"threshold": 0.1}'
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"invalid cache_config {short_repr(value)}: not JSON ({e.msg} at character {e.pos})"
            ) from None
    if not isinstance(value, Mapping):
        raise ValueError(f"invalid cache_config {short_repr(value)}: expected a mapping (JSON object)")
    return dict(value)


def _check_cache_value(backend: str, key: str, value) -> Any:
    where = f"cache_config.{key} for cache_backend {short_repr(backend)}"
    if key in ("threshold", "residual_diff_threshold", "mag_threshold", "retention_ratio", "mag_retention_ratio"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"invalid {where}: {short_repr(value)} (expected a finite number >= 0)")
        if key in ("retention_ratio", "mag_retention_ratio") and value > 1:
            raise ValueError(f"invalid {where}: {short_repr(value)} (expected a number in [0, 1])")
        return float(value)
    if key in ("cache_interval", "max_order", "taylorseer_order", "num_inference_steps"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"invalid {where}: {short_repr(value)} (expected an integer >= 1)")
        return value
    if key in ("disable_cache_before_step", "max_skip_steps", "mag_max_skip_steps"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"invalid {where}: {short_repr(value)} (expected an integer >= 0)")
        return value
    if key == "disable_cache_after_step":
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"invalid {where}: {short_repr(value)} (expected an integer >= 0 or null)")
        return value
    if key in ("use_lite_mode", "calibrate", "mag_calibrate"):
        if not isinstance(value, bool):
            raise ValueError(f"invalid {where}: {short_repr(value)} (expected true or false)")
        return value
    if key == "taylor_factors_dtype":
        if isinstance(value, torch.dtype):
            return value
        dtype = _DTYPES.get(str(value).strip().lower().replace("torch.", ""))
        if dtype is None:
            raise ValueError(f"invalid {where}: {short_repr(value)} (expected one of {sorted(_DTYPES)})")
        return dtype
    if key in ("skip_predict_identifiers", "cache_identifiers"):
        if value is not None and (not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value)):
            raise ValueError(f"invalid {where}: {short_repr(value)} (expected a list of regular expressions)")
        return list(value) if value is not None else None
    if key == "mag_ratios":
        if isinstance(value, str) and value.strip().lower() == "flux":
            from diffusers.hooks import mag_cache

            return list(map(float, mag_cache.FLUX_MAG_RATIOS))
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        if value is not None and (
            not isinstance(value, (list, tuple))
            or not value
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
        ):
            raise ValueError(
                f"invalid {where}: {short_repr(value)} (expected a list of finite numbers, or 'flux' for "
                "diffusers' FLUX_MAG_RATIOS)"
            )
        return [float(v) for v in value] if value is not None else None
    return value


def diffusers_cache_config(backend: Optional[str], cache_config=None):
    """The diffusers cache config object for a (canonical or vLLM-Omni) backend name and its
    cache_config mapping; None for no cache. Unset keys take diffusers' defaults."""
    backend = canonical_cache_backend(backend)
    mapping = cache_config_mapping(cache_config)
    if backend is None:
        if mapping:
            raise ValueError(
                f"cache_config {short_repr(mapping)} given without a cache_backend: set cache_backend to one of "
                f"{', '.join(CACHE_BACKENDS)}"
            )
        return None
    if backend == "cache_dit":
        return cache_dit_config(mapping)
    known = CACHE_KEYS[backend]
    kwargs: dict = {}
    for key, value in mapping.items():
        check_known_key(key, known, "cache_config", f" for cache_backend {short_repr(backend)}")
        target = known[key]
        value = _check_cache_value(backend, key, value)
        if target in kwargs and kwargs[target][1] != value:
            raise ValueError(
                f"cache_config sets {short_repr(target)} twice with different values ({short_repr(kwargs[target][0])}: "
                f"{short_repr(kwargs[target][1])}, {short_repr(key)}: {short_repr(value)})"
            )
        kwargs[target] = (key, value)
    kwargs = {k: v for k, (_, v) in kwargs.items()}
    if backend == "mag_cache":
        if kwargs.get("mag_ratios") is None and not kwargs.get("calibrate"):
            raise ValueError(
                "cache_backend 'mag_cache' needs cache_config.mag_ratios (model-dependent: run once with "
                "mag_calibrate: true to print them, or 'flux' for diffusers' FLUX_MAG_RATIOS)"
            )
        if "num_inference_steps" not in kwargs:
            raise ValueError(
                "cache_backend 'mag_cache' needs cache_config.num_inference_steps (diffusers interpolates "
                "mag_ratios to it and keeps the first retention_ratio x steps uncached)"
            )
    import diffusers.hooks as hooks

    cls = getattr(hooks, CACHE_BACKENDS[backend])
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise ValueError(f"diffusers' {cls.__name__} rejected cache_config {short_repr(mapping)}: {e}") from None


# -- the pipeline options -------------------------------------------------------------------------
@dataclass(frozen=True)
class PipelineOptions:
    """Pipeline-level options next to FP8: context parallelism and a cache backend."""

    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    cache_backend: Optional[str] = None
    cache_config: dict = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "parallel", ParallelOptions.from_value(self.parallel))
        object.__setattr__(self, "cache_backend", canonical_cache_backend(self.cache_backend))
        object.__setattr__(self, "cache_config", cache_config_mapping(self.cache_config))
        # validate now (a ValueError naming the value), before anything is changed
        diffusers_cache_config(self.cache_backend, self.cache_config)

    @property
    def enabled(self) -> bool:
        return self.parallel.enabled or self.cache_backend is not None

    def diffusers_cache_config(self):
        return diffusers_cache_config(self.cache_backend, self.cache_config)

    def to_dict(self) -> dict:
        return {
            "parallel_config": self.parallel.to_dict(),
            "cache_backend": self.cache_backend,
            "cache_config": dict(self.cache_config),
        }

    @classmethod
    def from_mapping(cls, data: Optional[Mapping], *, where: str = "config") -> "PipelineOptions":
        """The pipeline keys of a flat config mapping or of a vLLM-Omni stage config (engine_args of
        the diffusion stage); the FP8 keys next to them are FP8Config's business."""
        data = config_keys(data, where, warn=False)  # FP8Config.load warns about the keys neither uses
        return cls(
            parallel=data.get("parallel_config"),
            cache_backend=data.get("cache_backend"),
            cache_config=data.get("cache_config"),
        )

    @classmethod
    def load(
        cls,
        config=None,
        *,
        parallel_config=None,
        cache_backend=None,
        cache_config=None,
        cache_defaults: Optional[Mapping] = None,
    ) -> "PipelineOptions":
        """From what compile_pipeline was given as `config` (None, FP8Config, mapping, YAML path),
        then the explicit arguments on top (each one given replaces the config's value).
        cache_defaults: cache_config keys filled in when the backend takes them and they are unset
        (the command line gives mag_cache its num_inference_steps from the run)."""
        base = cls()
        if isinstance(config, Mapping):
            base = cls.from_mapping(config)
        elif isinstance(config, (str, os.PathLike)):
            base = cls.from_mapping(read_config_file(config), where=os.fspath(config))
        parallel = base.parallel if parallel_config is None else parallel_config
        backend = base.cache_backend if cache_backend is None else cache_backend
        if cache_config is None:
            cache_cfg = (
                base.cache_config
                if (cache_backend is None or canonical_cache_backend(cache_backend) == base.cache_backend)
                else {}
            )
        else:
            cache_cfg = cache_config
        canonical = canonical_cache_backend(backend)
        if cache_defaults and canonical is not None:
            cache_cfg = cache_config_mapping(cache_cfg)
            known = CACHE_KEYS[canonical]
            for key, value in cache_defaults.items():
                if key in known and all(known.get(k) != known[key] for k in cache_cfg):
                    cache_cfg[key] = value
        return cls(parallel=parallel, cache_backend=backend, cache_config=cache_cfg)
