"""Context parallelism (Ulysses, ring) and cache acceleration next to FP8, in vLLM-Omni's words.

vLLM-Omni runs its FP8 attention under sequence parallelism (`--ulysses-degree`,
`--ring-degree`) and its FP8 linears under cache acceleration (`--cache-backend`,
`--cache-config`). This module maps those options onto what diffusers ships, so
`fx_fp8.compile_pipeline` composes with them:

    parallel_config: {ulysses_degree: 2, ring_degree: 1}
        -> diffusers.ContextParallelConfig + transformer.enable_parallelism(config=...)
    cache_backend: first_block_cache | taylorseer | mag_cache,  cache_config: {...}
        -> diffusers.FirstBlockCacheConfig / TaylorSeerCacheConfig / MagCacheConfig + transformer.enable_cache(...)
    cache_backend: cache_dit,  cache_config: {Fn_compute_blocks: 1, ...}
        -> cache_dit.DBCacheConfig (+ TaylorSeerCalibratorConfig) + cache_dit.enable_cache (fx_fp8/cache_dit.py)

These are pipeline options (`PipelineOptions`), not FP8 options: a YAML may carry
them next to the FP8 keys (flat, or in a vLLM-Omni stage config's engine_args),
`FP8Config` ignores them and `PipelineOptions.load` reads them.

What fx_fp8 does so that FP8 survives both:
* Context parallelism: the transformer is prepared (FP8 weights) first, then
  parallelised, then compiled, so diffusers' split/gather hooks sit on the final
  modules. Ulysses uses diffusers' `native` attention backend (plain SDPA between
  two all-to-alls: the FP8 pass rewrites it). Ring attention needs each partial
  attention's log-sum-exp: fx_fp8 selects diffusers' `_native_flash` backend
  (aten._scaled_dot_product_flash_attention, which the FP8 pass rewrites into
  fx_fp8::fp8_attention_lse), so each ring step is FP8 and the steps merge exactly
  as diffusers merges native ones.
* Cache hooks decide in Python, on tensor values, whether a block runs
  (diffusers marks those decisions torch.compiler.disable; MagCache marks whole
  blocks so). compile_pipeline therefore runs each cache hook's decision eagerly
  and compiles what the hook wraps (a block, or an attention module for
  TaylorSeer) with the FP8 backend, one compiled region per module: blocks are
  still skipped, layer selectors see each block's real name, and a second run
  compiles nothing.
* First-block cache under context parallelism: each rank sees only its shard
  of the first block's residual, so ranks could disagree on skipping and then
  deadlock in the next all-to-all. fx_fp8 all-reduces the residual statistics
  over the context-parallel group, so every rank takes the single-process decision.

Not supported (a ValueError naming the value, never silently ignored): vLLM-Omni's
`tea_cache` (diffusers has no TeaCache hook),
`step_cache`, `ref_hint`, and parallel options other than the two degrees.
"""
from __future__ import annotations

import contextlib
import copy
import difflib
import json
import math
import os
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
import torch.nn as nn

from fx_fp8 import cache_dit as _cache_dit
from fx_fp8.rules import linear_native_reason, is_plain_linear
from fx_fp8.config import PIPELINE_KEYS  # noqa: E402,F401  keys a YAML may carry for the pipeline (FP8Config drops them)

# -- cache backends -------------------------------------------------------------------------------
#: canonical name -> the diffusers config class (in diffusers.hooks)
CACHE_BACKENDS: dict[str, str] = {
    "first_block_cache": "FirstBlockCacheConfig",
    "taylorseer": "TaylorSeerCacheConfig",
    "mag_cache": "MagCacheConfig",
    "cache_dit": "DBCacheConfig",   # the cache-dit library (fx_fp8/cache_dit.py), not a diffusers hook
}
CACHE_ALIASES = {
    "fbc": "first_block_cache", "first_block": "first_block_cache", "firstblockcache": "first_block_cache",
    "first_block_cache": "first_block_cache",
    "taylorseer": "taylorseer", "taylorseer_cache": "taylorseer", "taylor_seer": "taylorseer",
    "mag_cache": "mag_cache", "magcache": "mag_cache",
    "cache_dit": "cache_dit", "cachedit": "cache_dit",
}
#: vLLM-Omni backends (and diffusers ones) fx_fp8 does not map, with the reason
UNSUPPORTED_CACHE_BACKENDS = {
    "tea_cache": ("diffusers has no TeaCache hook (vLLM-Omni implements TeaCache itself); diffusers' "
                  "first_block_cache is the closest (skip the remaining blocks while the first block's residual "
                  "barely changes)"),
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
        "cache_interval": "cache_interval", "disable_cache_before_step": "disable_cache_before_step",
        "disable_cache_after_step": "disable_cache_after_step", "max_order": "max_order",
        "taylorseer_order": "max_order", "taylor_factors_dtype": "taylor_factors_dtype",
        "skip_predict_identifiers": "skip_predict_identifiers", "cache_identifiers": "cache_identifiers",
        "use_lite_mode": "use_lite_mode",
    },
    "mag_cache": {
        "threshold": "threshold", "mag_threshold": "threshold", "max_skip_steps": "max_skip_steps",
        "mag_max_skip_steps": "max_skip_steps", "retention_ratio": "retention_ratio",
        "mag_retention_ratio": "retention_ratio", "num_inference_steps": "num_inference_steps",
        "mag_ratios": "mag_ratios", "calibrate": "calibrate", "mag_calibrate": "calibrate",
    },
    "cache_dit": {k: k for k in _cache_dit.CACHE_DIT_KEYS},
}
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}

# -- parallel options -----------------------------------------------------------------------------
PARALLEL_KEYS = ("ulysses_degree", "ring_degree")
#: vLLM-Omni parallel keys with no implementation under fx_fp8, and why (1 / None, "off", is accepted)
UNSUPPORTED_PARALLEL_KEYS = {
    "cfg_parallel_size": "CFG parallelism (the conditional and unconditional branches on two devices) is "
                         "vLLM-Omni's own runner feature; diffusers 0.42 and cache-dit 1.5 have no option for it "
                         "(searched: no cfg-parallel setting in either), so fx_fp8 has nothing to map it onto; "
                         "run both branches on each device, or split the devices with ulysses_degree / ring_degree",
}
#: diffusers attention backends whose attention the FP8 pass can rewrite (aten SDPA forms)
FP8_ATTENTION_BACKENDS = ("native", "_native_flash", "_native_cudnn", "_native_efficient", "_native_math")


def _did_you_mean(key, known) -> str:
    close = difflib.get_close_matches(str(key), list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _degree(name: str, value) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"invalid parallel_config.{name} {value!r}: expected an integer >= 1")
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
            raise ValueError(f"invalid parallel_config {value!r}: expected a mapping such as "
                             "{ulysses_degree: 2, ring_degree: 1}")
        for key in value:
            if key in UNSUPPORTED_PARALLEL_KEYS and value[key] not in (None, 1):
                raise ValueError(f"parallel_config {key!r}={value[key]!r} is not supported: "
                                 f"{UNSUPPORTED_PARALLEL_KEYS[key]}")
            if key in UNSUPPORTED_PARALLEL_KEYS:
                continue  # the value that means "off"
            if key not in PARALLEL_KEYS:
                raise ValueError(f"unsupported parallel_config key {key!r}{_did_you_mean(key, PARALLEL_KEYS)}: fx_fp8 "
                                 f"maps only {list(PARALLEL_KEYS)} onto diffusers' ContextParallelConfig")
        return cls(**{k: v for k, v in value.items() if v is not None and k in PARALLEL_KEYS})

    def to_dict(self) -> dict:
        return {"ulysses_degree": self.ulysses_degree, "ring_degree": self.ring_degree}


def canonical_cache_backend(name) -> Optional[str]:
    """'first_block_cache' / 'taylorseer' / 'mag_cache', or None for no cache; a ValueError naming
    the value for anything else (tea_cache and the other vLLM-Omni backends diffusers lacks included)."""
    if name is None:
        return None
    if not isinstance(name, str):
        raise ValueError(f"invalid cache_backend {name!r}: expected a name such as 'first_block_cache'")
    key = name.strip().lower().replace("-", "_")
    if key in ("", "none", "null"):
        return None
    if key in CACHE_ALIASES:
        return CACHE_ALIASES[key]
    supported = ", ".join(CACHE_BACKENDS)
    if key in UNSUPPORTED_CACHE_BACKENDS:
        raise ValueError(f"cache_backend {name!r} is not supported: {UNSUPPORTED_CACHE_BACKENDS[key]}. "
                         f"Supported: {supported}")
    raise ValueError(f"unknown cache_backend {name!r}{_did_you_mean(key, list(CACHE_ALIASES))}: expected one of "
                     f"{supported} (or none)")


def cache_config_mapping(value) -> dict:
    """cache_config as a dict: a mapping, or its JSON text (--cache-config '{\"threshold\": 0.1}')."""
    if value is None:
        return {}
    if isinstance(value, str):  # --cache-config '{"threshold": 0.1}'
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid cache_config {value!r}: not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"invalid cache_config {value!r}: expected a mapping (JSON object)")
    return dict(value)


def _check_cache_value(backend: str, key: str, value) -> Any:
    where = f"cache_config.{key} for cache_backend {backend!r}"
    if key in ("threshold", "residual_diff_threshold", "mag_threshold", "retention_ratio", "mag_retention_ratio"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"invalid {where}: {value!r} (expected a finite number >= 0)")
        if key in ("retention_ratio", "mag_retention_ratio") and value > 1:
            raise ValueError(f"invalid {where}: {value!r} (expected a number in [0, 1])")
        return float(value)
    if key in ("cache_interval", "max_order", "taylorseer_order", "num_inference_steps"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"invalid {where}: {value!r} (expected an integer >= 1)")
        return value
    if key in ("disable_cache_before_step", "max_skip_steps", "mag_max_skip_steps"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"invalid {where}: {value!r} (expected an integer >= 0)")
        return value
    if key == "disable_cache_after_step":
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"invalid {where}: {value!r} (expected an integer >= 0 or null)")
        return value
    if key in ("use_lite_mode", "calibrate", "mag_calibrate"):
        if not isinstance(value, bool):
            raise ValueError(f"invalid {where}: {value!r} (expected true or false)")
        return value
    if key == "taylor_factors_dtype":
        if isinstance(value, torch.dtype):
            return value
        dtype = _DTYPES.get(str(value).strip().lower().replace("torch.", ""))
        if dtype is None:
            raise ValueError(f"invalid {where}: {value!r} (expected one of {sorted(_DTYPES)})")
        return dtype
    if key in ("skip_predict_identifiers", "cache_identifiers"):
        if value is not None and (not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value)):
            raise ValueError(f"invalid {where}: {value!r} (expected a list of regular expressions)")
        return list(value) if value is not None else None
    if key == "mag_ratios":
        if isinstance(value, str) and value.strip().lower() == "flux":
            from diffusers.hooks import mag_cache

            return list(map(float, mag_cache.FLUX_MAG_RATIOS))
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        if value is not None and (not isinstance(value, (list, tuple)) or not value
                                  or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                             and math.isfinite(v) for v in value)):
            raise ValueError(f"invalid {where}: {value!r} (expected a list of finite numbers, or 'flux' for "
                             "diffusers' FLUX_MAG_RATIOS)")
        return [float(v) for v in value] if value is not None else None
    return value


def diffusers_cache_config(backend: Optional[str], cache_config=None):
    """The diffusers cache config object for a (canonical or vLLM-Omni) backend name and its
    cache_config mapping; None for no cache. Unset keys take diffusers' defaults."""
    backend = canonical_cache_backend(backend)
    mapping = cache_config_mapping(cache_config)
    if backend is None:
        if mapping:
            raise ValueError(f"cache_config {mapping!r} given without a cache_backend: set cache_backend to one of "
                             f"{', '.join(CACHE_BACKENDS)}")
        return None
    if backend == "cache_dit":
        return _cache_dit.cache_dit_config(mapping)
    known = CACHE_KEYS[backend]
    kwargs: dict = {}
    for key, value in mapping.items():
        if key not in known:
            raise ValueError(f"unknown cache_config key {key!r} for cache_backend {backend!r}"
                             f"{_did_you_mean(key, known)}; known keys: {sorted(known)}")
        target = known[key]
        value = _check_cache_value(backend, key, value)
        if target in kwargs and kwargs[target][1] != value:
            raise ValueError(f"cache_config sets {target!r} twice with different values ({kwargs[target][0]!r}: "
                             f"{kwargs[target][1]!r}, {key!r}: {value!r})")
        kwargs[target] = (key, value)
    kwargs = {k: v for k, (_, v) in kwargs.items()}
    if backend == "mag_cache":
        if kwargs.get("mag_ratios") is None and not kwargs.get("calibrate"):
            raise ValueError("cache_backend 'mag_cache' needs cache_config.mag_ratios (model-dependent: run once with "
                             "mag_calibrate: true to print them, or 'flux' for diffusers' FLUX_MAG_RATIOS)")
        if "num_inference_steps" not in kwargs:
            raise ValueError("cache_backend 'mag_cache' needs cache_config.num_inference_steps (diffusers interpolates "
                             "mag_ratios to it and keeps the first retention_ratio x steps uncached)")
    import diffusers.hooks as hooks

    cls = getattr(hooks, CACHE_BACKENDS[backend])
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise ValueError(f"diffusers' {cls.__name__} rejected cache_config {mapping!r}: {e}") from None


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
        return {"parallel_config": self.parallel.to_dict(), "cache_backend": self.cache_backend,
                "cache_config": dict(self.cache_config)}

    @classmethod
    def from_mapping(cls, data: Optional[Mapping], *, where: str = "config") -> "PipelineOptions":
        """The pipeline keys of a flat config mapping or of a vLLM-Omni stage config (engine_args of
        the diffusion stage); the FP8 keys next to them are FP8Config's business."""
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: expected a mapping at the top level, got {type(data).__name__}")
        if "stage_args" in data:
            stages = data.get("stage_args")
            diffusion = [s for s in stages if isinstance(s, Mapping) and s.get("stage_type") == "diffusion"] \
                if isinstance(stages, list) else []
            data = (diffusion[0].get("engine_args") or {}) if diffusion else {}
            if not isinstance(data, Mapping):
                return cls()  # FP8Config reports the malformed stage config
        return cls(parallel=data.get("parallel_config"), cache_backend=data.get("cache_backend"),
                   cache_config=data.get("cache_config"))

    @classmethod
    def load(cls, config=None, *, parallel_config=None, cache_backend=None, cache_config=None,
             cache_defaults: Optional[Mapping] = None) -> "PipelineOptions":
        """From what compile_pipeline was given as `config` (None, FP8Config, mapping, YAML path),
        then the explicit arguments on top (each one given replaces the config's value).
        cache_defaults: cache_config keys filled in when the backend takes them and they are unset
        (the command line gives mag_cache its num_inference_steps from the run)."""
        base = cls()
        if isinstance(config, Mapping):
            base = cls.from_mapping(config)
        elif isinstance(config, (str, os.PathLike)):
            base = cls.from_mapping(_read_yaml(config), where=os.fspath(config))
        parallel = base.parallel if parallel_config is None else parallel_config
        backend = base.cache_backend if cache_backend is None else cache_backend
        if cache_config is None:
            cache_cfg = base.cache_config if (cache_backend is None or
                                              canonical_cache_backend(cache_backend) == base.cache_backend) else {}
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


def _read_yaml(path):
    from fx_fp8.config import read_config_file

    return read_config_file(path)


# -- torch.distributed ----------------------------------------------------------------------------
def torchrun_command(nprocs: int, argv=None) -> str:
    """The torchrun line that relaunches this command (sys.argv) on `nprocs` processes."""
    import shlex
    import sys

    argv = list(sys.argv if argv is None else argv)
    if not argv or not argv[0] or argv[0] == "-c":
        return f"torchrun --nproc-per-node {nprocs} your_script.py"
    head = argv[0]
    if os.path.basename(head) in ("fx-fp8", "__main__.py"):
        head = "-m fx_fp8"
    return f"torchrun --nproc-per-node {nprocs} {head} " + " ".join(shlex.quote(a) for a in argv[1:])


def init_distributed(opts: ParallelOptions) -> None:
    """Join the torch.distributed job this process was launched in (torchrun sets RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, LOCAL_RANK), or check the one already initialised: its world size
    must equal ulysses_degree x ring_degree."""
    import torch.distributed as dist

    need = opts.world_size
    if not dist.is_available():
        raise RuntimeError("context parallelism needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != need:
            raise ValueError(
                f"ulysses_degree {opts.ulysses_degree} x ring_degree {opts.ring_degree} needs {need} processes, but "
                f"this process was started as {world} (WORLD_SIZE={os.environ.get('WORLD_SIZE', 'unset')}): launch "
                f"with `{torchrun_command(need)}`")
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
        if torch.accelerator.is_available():
            torch.accelerator.set_device_index(local_rank % max(torch.accelerator.device_count(), 1))
        dist.init_process_group()   # the default backends: gloo for CPU tensors, nccl / hccl for devices
        return
    world = dist.get_world_size()
    if world != need:
        raise ValueError(f"ulysses_degree {opts.ulysses_degree} x ring_degree {opts.ring_degree} = {need} does not "
                         f"match the torch.distributed world size {world}")


def _check_accelerator() -> None:
    """diffusers' enable_parallelism places each rank on `rank % torch.accelerator.device_count()`,
    which divides by zero where no accelerator is present (diffusers <= 0.42.1)."""
    if torch.accelerator.device_count() == 0:
        raise RuntimeError("diffusers' context parallelism needs an accelerator (CUDA GPU, Ascend NPU, ...): "
                           "enable_parallelism computes rank % torch.accelerator.device_count(), and this machine "
                           "has no accelerator (device count 0)")


# -- attention backend ----------------------------------------------------------------------------
def _processors(model: nn.Module) -> list:
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention, MochiAttention

    out = []
    for m in model.modules():
        if isinstance(m, (Attention, MochiAttention, AttentionModuleMixin)):
            p = getattr(m, "processor", None)
            if p is not None and hasattr(p, "_attention_backend"):
                out.append(p)
    return out


def current_attention_backend(model: nn.Module) -> str:
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    names = {p._attention_backend for p in _processors(model)}
    names.discard(None)
    if len(names) > 1:
        raise ValueError(f"{type(model).__name__} mixes attention backends {sorted(map(str, names))}")
    name = names.pop() if names else _AttentionBackendRegistry.get_active_backend()[0]
    return getattr(name, "value", str(name))


def _has_kernel(op: str, device_type: str) -> bool:
    key = {"cpu": "CPU", "cuda": "CUDA", "npu": "PrivateUse1", "xpu": "XPU"}.get(device_type, "PrivateUse1")
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, key)


def choose_attention_backend(model: nn.Module, opts: ParallelOptions, warn=None) -> str:
    """The diffusers attention backend context parallelism runs with, set on the model's processors.

    Ulysses keeps the model's backend (`native` by default). Ring needs each partial attention's
    log-sum-exp: `native` cannot give it, so `native` becomes `_native_flash`
    (aten._scaled_dot_product_flash_attention, which the FP8 pass rewrites into fp8_attention_lse)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    warn = warn or (lambda m: warnings.warn(m, stacklevel=3))
    name = current_attention_backend(model)
    if opts.ring_degree > 1 and name in ("native", "_native_math", "_native_efficient"):
        device_type = torch._C._get_accelerator().type
        if not _has_kernel("aten::_scaled_dot_product_flash_attention", device_type):
            raise RuntimeError(
                f"ring attention (ring_degree {opts.ring_degree}) needs each partial attention's log-sum-exp; fx_fp8 "
                "uses diffusers' _native_flash backend (aten._scaled_dot_product_flash_attention) for it, which has no "
                f"{device_type} kernel in this torch build: use ulysses_degree instead")
        name = "_native_flash"
        for p in _processors(model):
            p._attention_backend = AttentionBackendName(name)
    if not _AttentionBackendRegistry._is_context_parallel_available(AttentionBackendName(name)):
        raise ValueError(f"attention backend {name!r} does not support diffusers' context parallelism; use one of "
                         f"{sorted(_AttentionBackendRegistry._supports_context_parallel)}")
    if name not in FP8_ATTENTION_BACKENDS:
        warn(f"fx_fp8: attention backend {name!r} computes attention outside aten's SDPA ops, so fx_fp8 cannot make "
             "it FP8 (the report shows no attention rows); use 'native' (Ulysses) or '_native_flash' (ring)")
    return name


# -- context parallelism --------------------------------------------------------------------------
def enable_context_parallel(model: nn.Module, opts, *, warn=None) -> Optional[dict]:
    """Apply diffusers' context parallelism to a transformer (after prepare_model, before
    torch.compile). Returns {"attention_backend", "mesh", "config"}, or None when opts ask for none."""
    opts = ParallelOptions.from_value(opts)
    if not opts.enabled:
        return None
    from diffusers import ContextParallelConfig

    model = getattr(model, "_orig_mod", model)
    if getattr(model, "_parallel_config", None) is not None:
        raise ValueError(f"{type(model).__name__} already has parallelism enabled (enable_parallelism was called); "
                         "pass parallel_config to fx_fp8 only, or enable it yourself and pass none")
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    if isinstance(heads, int) and heads % opts.ulysses_degree:
        raise ValueError(f"ulysses_degree {opts.ulysses_degree} does not divide {type(model).__name__}'s "
                         f"{heads} attention heads (Ulysses gives each rank heads / ulysses_degree heads)")
    init_distributed(opts)
    _check_accelerator()
    backend = choose_attention_backend(model, opts, warn)
    cp = ContextParallelConfig(ulysses_degree=opts.ulysses_degree, ring_degree=opts.ring_degree)
    try:
        model.enable_parallelism(config=cp)
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"diffusers' enable_parallelism refused ulysses_degree {opts.ulysses_degree}, ring_degree "
                         f"{opts.ring_degree} for {type(model).__name__}: {e}") from None
    return {"attention_backend": backend, "config": cp, "mesh": cp._flattened_mesh}


# -- cache hooks ----------------------------------------------------------------------------------
def _cache_hook_names() -> dict:
    """diffusers' cache hook names -> the cache they belong to (the three fx_fp8 compiles regionally)."""
    from diffusers.hooks import first_block_cache, mag_cache, taylorseer_cache

    return {first_block_cache._FBC_LEADER_BLOCK_HOOK: "first_block_cache",
            first_block_cache._FBC_BLOCK_HOOK: "first_block_cache",
            mag_cache._MAG_CACHE_LEADER_BLOCK_HOOK: "mag_cache", mag_cache._MAG_CACHE_BLOCK_HOOK: "mag_cache",
            taylorseer_cache._TAYLORSEER_CACHE_HOOK: "taylorseer"}


def cache_hooks(model: nn.Module) -> list[tuple[str, str, Any]]:
    """[(module name, hook name, hook)] of diffusers' cache hooks on `model` that replace a forward."""
    names = _cache_hook_names()
    out = []
    for mod_name, m in getattr(model, "_orig_mod", model).named_modules():
        registry = getattr(m, "_diffusers_hook", None)
        if registry is None:
            continue
        for hook_name in registry._hook_order:
            hook = registry.hooks[hook_name]
            if hook_name in names and hasattr(hook, "new_forward"):
                out.append((mod_name, hook_name, hook))
    return out


def enable_cache(model: nn.Module, backend, cache_config=None) -> Optional[Any]:
    """transformer.enable_cache(<diffusers config for backend>); returns the config (None: no cache)."""
    backend = canonical_cache_backend(backend)
    cfg = diffusers_cache_config(backend, cache_config)
    if cfg is None:
        return None
    model = getattr(model, "_orig_mod", model)
    if _cache_dit.is_cache_dit_enabled(model):
        raise ValueError(f"{type(model).__name__} already has cache-dit enabled; pass cache_backend to fx_fp8 only")
    if backend == "cache_dit":
        if getattr(model, "_cache_config", None) is not None:
            raise ValueError(f"{type(model).__name__} already has a diffusers cache enabled "
                             f"({type(model._cache_config).__name__}); cache-dit cannot be added on top of it")
        return _cache_dit.enable(model, cfg)
    if getattr(model, "_cache_config", None) is not None:
        raise ValueError(f"{type(model).__name__} already has a cache enabled ({type(model._cache_config).__name__}); "
                         "pass cache_backend to fx_fp8 only, or enable it yourself and pass none")
    try:
        model.enable_cache(cfg)
    except (ValueError, TypeError, IndexError) as e:
        raise ValueError(f"diffusers could not apply {type(cfg).__name__} to {type(model).__name__}: {e}") from None
    if not cache_hooks(model):  # e.g. TaylorSeer's default patterns (`...attn`) miss Wan's attn1 / attn2
        model.disable_cache()
        raise ValueError(f"cache_backend {backend!r} hooked no module of {type(model).__name__} (diffusers' "
                         f"{type(cfg).__name__} found nothing to cache with these settings)"
                         + ("; name the modules with cache_config.cache_identifiers, e.g. "
                            "[\"^blocks\\\\.\\\\d+\\\\.attn1$\"]" if backend == "taylorseer" else ""))
    model._fx_fp8_default_context = model.register_forward_pre_hook(_default_cache_context)
    return cfg


@torch.compiler.disable
def _default_cache_context(module, args):
    """diffusers' pipelines wrap each denoiser call in `transformer.cache_context("cond")`; a pipeline
    that does not (fx_fp8's tiny model, custom loops) would make the cache hooks raise "No cache
    context is set". For those calls, one default context: every call shares one cache state."""
    from diffusers.hooks.hooks import CacheContext, StateManager, _set_cache_context

    for _, _, hook in cache_hooks(module):
        for attr in vars(hook).values():
            if isinstance(attr, StateManager) and attr._context is None:
                _set_cache_context(module, CacheContext("fx_fp8_default"))
                return None
    return None


def _method_copy(bound) -> Any:
    """A copy of a bound method whose function has its own code object: Dynamo keeps compiled code
    per code object and would otherwise reuse one block's graph (its layer decisions baked in) for
    every block of the same class."""
    func = getattr(bound, "__func__", None)
    if func is None or not isinstance(func, types.FunctionType):
        return bound
    code = func.__code__.replace(co_name=func.__code__.co_name)
    new = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    new.__kwdefaults__ = copy.copy(func.__kwdefaults__)
    new.__qualname__ = func.__qualname__
    new.__dict__.update(func.__dict__)
    return types.MethodType(new, bound.__self__)


@dataclass
class CacheRegions:
    """What compile_cache_regions changed, to undo it."""

    hooks: list = field(default_factory=list)   # (hook, its registry fn_ref, the fn_ref.forward before)
    modules: list = field(default_factory=list)  # module names compiled as regions

    def undo(self) -> None:
        for hook, fn_ref, forward in self.hooks:
            hook.fn_ref = fn_ref
            fn_ref.forward = forward
            vars(hook).pop("_fx_fp8_region", None)
        self.hooks.clear()
        self.modules.clear()


def compile_cache_regions(model: nn.Module, compile_fn) -> CacheRegions:
    """Run each diffusers cache hook's decision eagerly and compile what it wraps with `compile_fn`.

    For every cache hook (FirstBlockCache / MagCache on blocks, TaylorSeer on attention modules):
    the hook's forward (its Python decision: compute, or reuse / predict) is marked
    torch.compiler.disable, and the original forward it calls is replaced, for this hook only, by
    `compile_fn(copy of the original forward)`, one compiled region per module. diffusers' own
    registry keeps the true original, so disable_cache() still restores the plain module.
    """
    regions = CacheRegions()
    for mod_name, _hook_name, hook in cache_hooks(model):
        fn_ref = hook.fn_ref
        if getattr(hook, "_fx_fp8_region", False):
            continue
        proxy = copy.copy(fn_ref)
        proxy.original_forward = compile_fn(_method_copy(fn_ref.original_forward))
        previous = fn_ref.forward
        fn_ref.forward = torch.compiler.disable(previous)
        hook.fn_ref = proxy
        hook._fx_fp8_region = True
        regions.hooks.append((hook, fn_ref, previous))
        regions.modules.append(mod_name)
    return regions


def sync_first_block_cache(model: nn.Module, group) -> int:
    """Make FirstBlockCache decide on the whole sequence under context parallelism: the head
    block's residual statistics (mean |r - r_prev| and mean |r_prev| over this rank's shard) are
    summed over `group` before the threshold test, so every rank takes the single-process
    decision and the ranks never disagree on skipping (which would deadlock the next all-to-all).
    Returns the number of hooks changed."""
    import torch.distributed as dist
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook

    changed = 0
    for _, _, hook in cache_hooks(model):
        if not isinstance(hook, FBCHeadBlockHook):
            continue

        @torch.compiler.disable
        def should_compute(hidden_states_residual, _hook=hook):
            state = _hook.state_manager.get_state()
            if state.head_block_residual is None:
                return True
            prev = state.head_block_residual
            stats = torch.stack([(hidden_states_residual - prev).abs().mean(), prev.abs().mean()]).float()
            dist.all_reduce(stats, group=group)   # equal shards: the sum of means is the whole mean x ranks
            return (stats[0] / stats[1]).item() > _hook.threshold

        hook._should_compute_remaining_blocks = should_compute
        changed += 1
    return changed


def unsync_first_block_cache(model: nn.Module) -> None:
    for _, _, hook in cache_hooks(model):
        vars(hook).pop("_should_compute_remaining_blocks", None)


# -- what compile_pipeline calls ------------------------------------------------------------------
@dataclass
class TransformerExtras:
    """What apply_pipeline_options did to one transformer (kept in PipelineFP8State.extras)."""

    parallel: Optional[dict] = None     # enable_context_parallel's result
    cache: Any = None                   # the diffusers cache config fx_fp8 enabled (None: none, or the user's)
    regions: CacheRegions = field(default_factory=CacheRegions)
    fbc_synced: int = 0
    compile_fn: Any = None              # how cache regions are compiled (torch.compile with the pipeline's backend)
    warned_unknown: bool = False


#: diffusers hooks compile_pipeline rebuilds after preparing (group offloading re-applied over the new linears)
_REBUILT_HOOKS = ("group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading")


def check_before_prepare(model: nn.Module, prepare: bool, cfg) -> None:
    """prepare_model replaces nn.Linear modules: a diffusers hook on one of them (a context-parallel
    gather on proj_out, TaylorSeer's lite mode) would be lost silently. Refuse instead."""
    if not prepare or not cfg.linear_enabled:
        return

    qcfg = cfg.quantization_config
    for name, m in getattr(model, "_orig_mod", model).named_modules():
        hooks = [h for h in getattr(getattr(m, "_diffusers_hook", None), "hooks", {}) if h not in _REBUILT_HOOKS]
        if is_plain_linear(m) and hooks \
                and linear_native_reason(name, m.in_features, m.out_features, m.weight.dtype, qcfg) is None:
            raise ValueError(f"linear {name!r} carries diffusers hooks {hooks} and prepare_model "
                             "would replace it, losing them: pass parallel_config / cache_backend to compile_pipeline "
                             "instead of enabling them yourself (fx_fp8 applies them after preparing), or prepare=False")


def check_pipeline_options(opts: PipelineOptions, models: list, cfg, *, prepare: bool, compile_kwargs: Mapping) -> None:
    """Everything compile_pipeline can find wrong with the pipeline options before it changes anything;
    with context parallelism it also joins the torchrun job (torch.distributed.init_process_group)."""
    for model in models:
        model = getattr(model, "_orig_mod", model)
        cached = opts.cache_backend is not None or getattr(model, "_cache_config", None) is not None
        if cached and compile_kwargs.get("fullgraph"):
            raise ValueError("fullgraph=True cannot be combined with a cache backend: diffusers' cache hooks decide on "
                             "tensor values in Python (torch.compiler.disable), so the transformer cannot be one "
                             "graph; fx_fp8 compiles each cached block or attention module as its own graph instead")
        if _cache_dit.is_cache_dit_enabled(model):
            raise ValueError(f"{type(model).__name__} already has cache-dit enabled (cache_dit.enable_cache): pass "
                             "cache_backend='cache_dit' with its cache_config to compile_pipeline instead, so that "
                             "fx_fp8 compiles cache-dit's blocks with their real names")
        if opts.cache_backend == "cache_dit":
            _cache_dit.block_adapter(model)   # a ValueError naming the class cache-dit has no adapter for
            if opts.parallel.enabled:
                raise ValueError("cache_backend 'cache_dit' with parallel_config is not supported: cache-dit's block "
                                 "wrapper under diffusers' context parallelism is untested with fx_fp8 (use "
                                 "first_block_cache, taylorseer or mag_cache with ulysses_degree / ring_degree)")
        if opts.cache_backend is not None and getattr(model, "_cache_config", None) is not None:
            raise ValueError(f"{type(model).__name__} already has a cache enabled ({type(model._cache_config).__name__}) "
                             f"and cache_backend {opts.cache_backend!r} was given: pass one of them")
        if opts.parallel.enabled:
            if getattr(model, "_parallel_config", None) is not None:
                raise ValueError(f"{type(model).__name__} already has parallelism enabled and parallel_config was "
                                 "given: pass one of them")
            heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
            if isinstance(heads, int) and heads % opts.parallel.ulysses_degree:
                raise ValueError(f"ulysses_degree {opts.parallel.ulysses_degree} does not divide "
                                 f"{type(model).__name__}'s {heads} attention heads (each rank computes "
                                 "heads / ulysses_degree of them)")
        check_before_prepare(model, prepare, cfg)
    if opts.parallel.enabled:
        init_distributed(opts.parallel)
        _check_accelerator()


def apply_pipeline_options(model: nn.Module, opts: PipelineOptions, *, warn=None) -> TransformerExtras:
    """Cache hooks first (so that, under context parallelism, they see each rank's shard), then
    context parallelism; the model must already be prepared (FP8 weights) and not yet compiled."""
    extras = TransformerExtras()
    extras.cache = enable_cache(model, opts.cache_backend, opts.cache_config) if opts.cache_backend else None
    try:
        extras.parallel = enable_context_parallel(model, opts.parallel, warn=warn)
    except BaseException:
        if extras.cache is not None:
            undo_pipeline_options(model, extras)
        raise
    if extras.parallel is not None:
        extras.fbc_synced = sync_first_block_cache(model, extras.parallel["mesh"].get_group())
    return extras


def compile_regions(extras: TransformerExtras, model: nn.Module, backend: str, options: dict,
                    compile_kwargs: Mapping) -> None:
    """After torch.compile(model): compile the cache hooks' wrapped modules as regions (see
    compile_cache_regions) with the same backend and options; kept for caches enabled later."""
    kwargs = dict(compile_kwargs)
    extras.compile_fn = lambda fn: torch.compile(fn, backend=backend, options=options, **kwargs)
    _update_regions(extras, model)


def _update_regions(extras: TransformerExtras, model: nn.Module) -> None:
    if isinstance(extras.cache, _cache_dit.CacheDitState):
        extras.regions.modules += _cache_dit.compile_regions(model, extras.cache, extras.compile_fn)
        return
    new = compile_cache_regions(model, extras.compile_fn)
    extras.regions.hooks += new.hooks
    extras.regions.modules += new.modules
    if new.hooks and extras.parallel is not None:
        extras.fbc_synced += sync_first_block_cache(model, extras.parallel["mesh"].get_group())
    unknown = getattr(getattr(model, "_orig_mod", model), "_cache_config", None)
    if unknown is not None and type(unknown).__name__ not in CACHE_BACKENDS.values() and not extras.warned_unknown:
        extras.warned_unknown = True
        warnings.warn(f"fx_fp8: {type(unknown).__name__} has not been tested with fx_fp8; its hooks are traced by "
                      "torch.compile as they are (tested: " + ", ".join(CACHE_BACKENDS.values()) + ")", stacklevel=4)


def on_pipeline_run(state) -> None:
    """At each compile_pipeline'd run: cache hooks enabled on the transformers since compile_pipeline
    get the same treatment as those enabled through it."""
    for attr, extras in state.extras.items():
        if extras is not None and isinstance(extras.cache, _cache_dit.CacheDitState):
            extras.cache.reset()   # cache-dit's context persists across calls: each run starts afresh
            continue
        if extras is None or extras.compile_fn is None:
            continue
        model = state.originals.get(attr)
        if model is not None and getattr(model, "_cache_config", None) is not None:
            _update_regions(extras, model)


def undo_pipeline_options(model: nn.Module, extras: Optional[TransformerExtras]) -> None:
    """restore_pipeline: the compiled regions go, a cache fx_fp8 enabled is disabled. Context
    parallelism stays (diffusers cannot undo enable_parallelism)."""
    if extras is None:
        return
    extras.regions.undo()
    model = getattr(model, "_orig_mod", model)
    if isinstance(extras.cache, _cache_dit.CacheDitState):
        _cache_dit.disable(model, extras.cache)
        return
    if extras.fbc_synced:
        unsync_first_block_cache(model)
    if extras.cache is not None and getattr(model, "_cache_config", None) is not None:
        model.disable_cache()
    handle = vars(model).pop("_fx_fp8_default_context", None)
    if handle is not None:
        handle.remove()


def hand_over_cache(applied: list, opts: PipelineOptions) -> dict:
    """A native run had `opts` applied to its transformers ([(model, extras)], from
    apply_pipeline_options); compile_pipeline is next. Diffusers' cache hooks stay (compile_pipeline
    compiles them as they are); cache-dit is disabled and handed over as compile_pipeline keywords,
    since compile_pipeline must enable it itself to compile cache-dit's blocks with their real names."""
    if opts.cache_backend != "cache_dit":
        return {}
    for model, extras in applied:
        undo_pipeline_options(model, extras)
    return {"cache_backend": opts.cache_backend, "cache_config": opts.cache_config}


@contextlib.contextmanager
def rank_zero_first():
    """Rank 0 runs the body first (e.g. writing a file), the others after it."""
    import torch.distributed as dist

    on = dist.is_available() and dist.is_initialized()
    if on and dist.get_rank() != 0:
        dist.barrier()
    yield
    if on and dist.get_rank() == 0:
        dist.barrier()


def is_main_process() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
