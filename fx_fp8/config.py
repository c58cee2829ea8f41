"""FP8Config: what to quantize, where, and how.

Keys follow vLLM-Omni's diffusion options (`diffusion_kv_cache_dtype`,
`diffusion_kv_cache_skip_steps`, `diffusion_kv_cache_skip_layers`,
`quantization`, `quantization_config`) plus two nested mappings of our own
(`attention`, and extra keys of `quantization_config`) and the backend keys
`lowering` / `downstream`.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

from fx_fp8.config_files import (LEGACY_KEYS, PIPELINE_KEYS, config_keys, did_you_mean,  # noqa: F401 (re-exported)
                                 fold_legacy_keys, read_config_file)
from fx_fp8.patterns import validate_pattern
from fx_fp8.selectors import Selector, parse_selector

KV_CACHE_DTYPES = (None, "auto", "fp8")
QUANTIZATION_METHODS = (None, "fp8", "int8")
ATTENTION_GRANULARITIES = ("tensor", "head", "block", "mx")
ATTENTION_KERNELS = ("auto", "triton", "cudnn")
#: older configs wrote "@defaults" in ignored_layers to keep the sensitive layers: now always kept
DEFAULTS_TOKEN = "@defaults"
LOWERINGS = ("auto", "reference", "cuda", "npu")
DOWNSTREAMS = ("auto", "eager", "inductor", "npugraph_ex")
#: what linears run on the steps quantization_config.skip_steps names
SKIP_STEPS_MODES = ("native", "weight_only")
#: how the sensitive linears (embedders, adaLN modulation, final projection) run
SENSITIVE_MODES = ("native", "weight_only", "fp8")
#: weight-only with INT8 weights, one scale per output channel and 32 input columns: on the shipped tiny
#: model and the zoo as good as native sensitive layers, 0.521x weight bytes on a bf16 Flux (0.666x
#: native); benchmarks/sensitive_modes.py, RESULTS.md 2026-12-02
DEFAULT_SENSITIVE = "weight_only"

def _check_choice(name: str, value, choices) -> Any:
    if isinstance(value, str):
        value = value.strip().lower()
        if value in ("none", "null", ""):
            value = None
    if value not in choices:
        shown = ", ".join(repr(c) for c in choices)
        raise ValueError(f"invalid {name} {value!r}: expected one of {shown}")
    return value


def _is_off(value) -> bool:
    """None / "none" / "auto" / "": the value that switches a feature off."""
    return value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "", "auto"))


def _check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"invalid {name} {value!r}: expected an integer >= {minimum}")
    return value


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"invalid {name} {value!r}: expected true or false")
    return value


def _from_mapping(cls, data: Mapping[str, Any] | None, where: str):
    """Build a dataclass from a mapping, refusing unknown keys with a hint."""
    if data is None:
        return cls()
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ValueError(f"invalid {where} {data!r}: expected a mapping")
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ValueError(f"unknown key {key!r} in {where}{did_you_mean(key, names)}; known keys: {sorted(names)}")
    return cls(**dict(data))


@dataclass(frozen=True)
class AttentionQuantConfig:
    """How Q, K, V (and the softmax probabilities P) are quantized.

    granularity: "tensor" (one scale per tensor), "head" (per batch x head),
      "block" (per batch x head x block of rows; Q rows in q_block, K/V rows in kv_block),
      "mx" (MXFP8: power-of-two e8m0 scales per 32 elements; q_block / kv_block are ignored).
    hadamard: rotate Q and K over the head dim by an orthonormal Hadamard matrix
      (QK^T is unchanged, outlier channels are spread out).
    smooth_k: subtract K's mean over tokens before quantizing (softmax is invariant).
    quantize_p: quantize the probabilities to e4m3 before P@V (what the fused
      device kernels do), scale `p_scale`.
    min_kv_ratio: attention whose key length is below min_kv_ratio x its query
      length (cross-attention to a short prompt) stays native; joint attention
      (keys = the image tokens plus a few more) is quantized.
    cross_attention: quantize attention whatever its key length (overrides min_kv_ratio).
    kernel: CUDA attention kernel: "auto", "triton" or "cudnn" (ignored elsewhere).
    """

    granularity: str = "block"
    q_block: int = 128
    kv_block: int = 256
    hadamard: bool = True
    smooth_k: bool = True
    quantize_p: bool = True
    p_scale: float = 448.0
    min_kv_ratio: float = 0.5
    cross_attention: bool = False
    kernel: str = "auto"

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass normalisation
        set_("granularity", _check_choice("attention.granularity", self.granularity, ATTENTION_GRANULARITIES))
        set_("kernel", _check_choice("attention.kernel", self.kernel, ATTENTION_KERNELS))
        _check_int("attention.q_block", self.q_block)
        _check_int("attention.kv_block", self.kv_block)
        for name in ("hadamard", "smooth_k", "quantize_p", "cross_attention"):
            _check_bool(f"attention.{name}", getattr(self, name))
        # P in [0, 1] is multiplied by p_scale before the e4m3 cast: below 1 the small probabilities
        # round to zero (below 2**-10 all of them, and the attention output is 0)
        if not _is_number(self.p_scale) or not 1 <= self.p_scale <= 448:
            raise ValueError(f"invalid attention.p_scale {self.p_scale!r}: expected a number in [1, 448] (the softmax "
                             "probabilities are multiplied by it before the FP8 cast; below 1 small probabilities "
                             "round to zero, and at 1e-3 the attention output is all zeros)")
        if not _is_number(self.min_kv_ratio) or not 0 <= self.min_kv_ratio <= 1:
            raise ValueError(f"invalid attention.min_kv_ratio {self.min_kv_ratio!r}: expected a number in [0, 1]")


@dataclass(frozen=True)
class QuantizationConfig:
    """Linear (W8A8) settings, vLLM's `quantization_config` plus our extras.

    method: "fp8" (float8 e4m3 W8A8) or "int8" (symmetric int8 W8A8).
    ignored_layers: module-name patterns of linears kept native, on top of the
      known-sensitive layers (embedders, adaLN modulation, final projection),
      which stay native unless quantize_sensitive is true. None and [] both
      mean "no extra patterns". The token "@defaults" (older configs) is accepted
      and changes nothing: the sensitive layers are always kept.
    quantize_sensitive: also quantize the sensitive layers (everything eligible
      then runs quantized except `ignored_layers`); a synonym of sensitive="fp8".
    sensitive: how the sensitive layers run: "weight_only" (default: quantized
      weights stored as weight_only_method / weight_only_group_size say,
      activations in the model's precision: W8A16), "native" or "fp8"
      (quantized like every other linear, W8A8 with `method`).
    weight_only_method: storage of weight-only (W8A16) layers, "int8" (default)
      or "fp8" (None: `method`); a device whose weight-only matmul takes one
      storage only (NPU: int8) uses that one.
    weight_only_group_size: scales of weight-only layers: an integer g (a
      multiple of 16; default 32), one per output channel and per g input
      columns (4 bytes per g weights); None, one per output channel.
    skip_steps: denoising steps on which the linears do not run W8A8 (the
      attention selector's grammar: "0-2,47-49"); they run `skip_steps_mode`:
      "weight_only" (the same quantized weights, activations unquantized) or
      "native" (the original weights; a prepared layer has none and runs weight-only).
    activation_scheme: "dynamic" (scales computed per call) or "static"
      (scales from fx_fp8.calibrate, given by `activation_scales`: a dict or a JSON path).
    activation_granularity: "token" (per row) or "tensor" (dynamic only).
    weight_granularity: "tensor", "channel" (per output channel) or "block"
      (`weight_block_size` [rows, cols]; setting it implies "block").
    min_features: linears with in or out features below this stay native
      (quantization only costs time there); features must also be multiples of 16.
    fast_accum: CUDA FP8 GEMMs use the faster accumulation (torch._scaled_mm's
      use_fast_accum, torchao's default); false for the exact one.
    With block weight scales, dynamic activations are quantized per token and per
    group of weight_block_size[1] columns (what blockwise FP8 GEMMs take).
    smoothing_alpha: SmoothQuant-style migration of activation outliers into the
      weights, a number in [0, 1] (None: off). Needs `activation_scales` from
      fx_fp8.calibrate with per-channel statistics ("channel_amax"): per input
      channel s = amax_x^alpha / max|W[:, j]|^(1 - alpha) over the linears sharing
      one activation quantization; the weights are quantized as W * s and the
      activation is multiplied by 1/s before it is quantized. Works with dynamic
      and static activation scales, FP8 and INT8.
    """

    method: str = "fp8"
    ignored_layers: tuple[str, ...] = ()
    quantize_sensitive: bool = False
    activation_scheme: str = "dynamic"
    activation_granularity: str = "token"
    weight_granularity: str = "channel"
    weight_block_size: tuple[int, int] | None = None
    activation_scales: Any = None
    min_features: int = 32
    fast_accum: bool = True
    smoothing_alpha: float | None = None
    sensitive: str | None = None
    skip_steps: Selector = field(default_factory=Selector)
    skip_steps_mode: str = "weight_only"
    weight_only_method: str | None = "int8"
    weight_only_group_size: int | None = 32

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass normalisation
        set_("method", _check_choice("quantization_config.method", self.method, QUANTIZATION_METHODS[1:]))
        set_("ignored_layers", _clean_patterns(self.ignored_layers))
        _check_bool("quantization_config.quantize_sensitive", self.quantize_sensitive)
        sensitive = self.sensitive
        if sensitive is not None:
            sensitive = _check_choice("quantization_config.sensitive", sensitive, SENSITIVE_MODES)
            if sensitive is None:
                raise ValueError(f"invalid quantization_config.sensitive {self.sensitive!r}: expected one of "
                                 + ", ".join(repr(c) for c in SENSITIVE_MODES))
        if self.quantize_sensitive and sensitive not in (None, "fp8"):
            raise ValueError(f"quantization_config.quantize_sensitive: true (a synonym of sensitive: fp8) disagrees "
                             f"with quantization_config.sensitive {sensitive!r}: give one of them")
        sensitive = "fp8" if self.quantize_sensitive else (sensitive or DEFAULT_SENSITIVE)
        set_("sensitive", sensitive)
        set_("quantize_sensitive", sensitive == "fp8")
        set_("skip_steps", parse_selector(self.skip_steps, what="quantization_config.skip_steps", relative=True))
        mode = _check_choice("quantization_config.skip_steps_mode", self.skip_steps_mode, SKIP_STEPS_MODES)
        set_("skip_steps_mode", mode)
        if self.weight_only_method is not None:
            set_("weight_only_method", _check_choice("quantization_config.weight_only_method",
                                                     self.weight_only_method, QUANTIZATION_METHODS))
        group = self.weight_only_group_size
        if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 16 or group % 16):
            raise ValueError(f"invalid quantization_config.weight_only_group_size {group!r}: expected a multiple of "
                             "16 (input columns per weight scale), or None for one scale per output channel")
        set_("activation_scheme", _check_choice("quantization_config.activation_scheme", self.activation_scheme, ("dynamic", "static")))
        set_("activation_granularity", _check_choice("quantization_config.activation_granularity", self.activation_granularity, ("token", "tensor")))
        if self.weight_block_size is not None:
            wbs = self.weight_block_size
            if not isinstance(wbs, (list, tuple)) or len(wbs) != 2:
                raise ValueError(f"invalid weight_block_size {wbs!r}: expected [rows, cols], e.g. [128, 128]")
            set_("weight_block_size", tuple(_check_int("weight_block_size", v) for v in wbs))
            set_("weight_granularity", "block")
        set_("weight_granularity", _check_choice("quantization_config.weight_granularity", self.weight_granularity, ("tensor", "channel", "block")))
        if self.weight_granularity == "block" and self.weight_block_size is None:
            set_("weight_block_size", (128, 128))
        if self.activation_scheme == "static" and self.activation_scales is None:
            raise ValueError("activation_scheme 'static' needs activation_scales: a JSON file written by fx_fp8.calibrate, or its dict")
        if self.activation_scales is not None and not isinstance(self.activation_scales, (str, os.PathLike, Mapping)):
            raise ValueError(f"invalid activation_scales {self.activation_scales!r}: expected a JSON path or a mapping")
        if (self.activation_scales is not None and self.activation_scheme != "static"
                and self.smoothing_alpha is None):
            warnings.warn("quantization_config.activation_scales is given but activation_scheme is "
                          f"{self.activation_scheme!r} and smoothing_alpha is not set: the scales are unused "
                          "(set activation_scheme: static to use them)", stacklevel=5)
        _check_int("quantization_config.min_features", self.min_features, minimum=0)
        _check_bool("quantization_config.fast_accum", self.fast_accum)
        if self.smoothing_alpha is not None:
            if not _is_number(self.smoothing_alpha) or not 0 <= self.smoothing_alpha <= 1:
                raise ValueError(f"invalid quantization_config.smoothing_alpha {self.smoothing_alpha!r}: "
                                 "expected a number in [0, 1] (or None: no smoothing)")
            set_("smoothing_alpha", float(self.smoothing_alpha))
            if self.activation_scales is None:
                raise ValueError("quantization_config.smoothing_alpha needs quantization_config.activation_scales: "
                                 "a calibration with per-channel statistics written by fx_fp8.calibrate "
                                 "(fx_fp8.save_activation_scales), or the object it returns")

    @property
    def act_granularity(self) -> str:
        """The activation quantization that runs: "static", or the dynamic granularity
        ("group" whenever the weights have block scales)."""
        if self.activation_scheme == "static":
            return "static"
        return "group" if self.weight_granularity == "block" else self.activation_granularity


def _clean_patterns(layers) -> tuple[str, ...]:
    """ignored_layers as a tuple of validated patterns; None -> (); "a, b" -> ("a", "b"); "@defaults" dropped."""
    if layers is None:
        return ()
    if isinstance(layers, str):
        layers = layers.split(",")
    if not isinstance(layers, (list, tuple)) or not all(isinstance(p, str) for p in layers):
        raise ValueError(f"invalid ignored_layers {layers!r}: expected a list of module-name patterns")
    cleaned = tuple(p.strip() for p in layers if p.strip() and p.strip() != DEFAULTS_TOKEN)
    for p in cleaned:
        validate_pattern(p)
    return cleaned


_TOP_KEYS = (
    "diffusion_kv_cache_dtype", "diffusion_kv_cache_skip_steps", "diffusion_kv_cache_skip_layers",
    "quantization", "quantization_config", "ignored_layers", "attention", "lowering", "downstream",
    "quantization_skip_steps", "quantization_skip_steps_mode",
)
#: flat spellings of quantization_config keys (CLI flags, compile_pipeline keywords); unlike
#: ignored_layers they are no linear opt-in: like diffusion_kv_cache_skip_steps, they select steps
STEP_SHORTCUTS = {"quantization_skip_steps": "skip_steps", "quantization_skip_steps_mode": "skip_steps_mode"}
#: pipeline-level keys a config may carry next to the FP8 keys (context parallelism, cache hooks:
#: one YAML serves a whole pipeline). They belong to fx_fp8.pipeline.options.PipelineOptions, not to
#: FP8Config: from_mapping drops them.


@dataclass(frozen=True)
class FP8Config:
    """Everything the fp8 backends need. Build it with from_kwargs / from_yaml / load.

    diffusion_kv_cache_dtype: "fp8" -> FP8 attention; None / "auto" -> native attention.
    diffusion_kv_cache_skip_steps: denoising steps whose attention stays native.
    diffusion_kv_cache_skip_layers: transformer layer indices whose attention stays native.
    quantization: "fp8" -> FP8 W8A8 linears; None -> native linears.
    lowering: "auto" (from the tensors' device), "reference" (CPU), "cuda", "npu".
    downstream: compiler after the passes: "auto", "eager", "inductor", "npugraph_ex".
    """

    diffusion_kv_cache_dtype: str | None = "fp8"
    diffusion_kv_cache_skip_steps: Selector = field(default_factory=Selector)
    diffusion_kv_cache_skip_layers: Selector = field(default_factory=Selector)
    quantization: str | None = "fp8"
    quantization_config: QuantizationConfig = field(default_factory=QuantizationConfig)
    attention: AttentionQuantConfig = field(default_factory=AttentionQuantConfig)
    lowering: str = "auto"
    downstream: str = "auto"

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        set_("diffusion_kv_cache_dtype", _check_choice("diffusion_kv_cache_dtype", self.diffusion_kv_cache_dtype, KV_CACHE_DTYPES))
        set_("quantization", _check_choice("quantization", self.quantization, QUANTIZATION_METHODS))
        set_("diffusion_kv_cache_skip_steps", parse_selector(self.diffusion_kv_cache_skip_steps, what="diffusion_kv_cache_skip_steps", relative=True))
        set_("diffusion_kv_cache_skip_layers", parse_selector(self.diffusion_kv_cache_skip_layers, what="diffusion_kv_cache_skip_layers"))
        set_("quantization_config", _from_mapping(QuantizationConfig, self.quantization_config, "quantization_config"))
        set_("attention", _from_mapping(AttentionQuantConfig, self.attention, "attention"))
        set_("lowering", _check_choice("lowering", self.lowering, LOWERINGS))
        set_("downstream", _check_choice("downstream", self.downstream, DOWNSTREAMS))
        method = self.quantization_config.method
        if self.quantization is not None and method != self.quantization:
            if method != "fp8":  # "fp8" is the default: `quantization` decides
                raise ValueError(f"quantization {self.quantization!r} disagrees with quantization_config.method {method!r}")
            set_("quantization_config", dataclasses.replace(self.quantization_config, method=self.quantization))
        self._warn_unused_selectors()

    def _warn_unused_selectors(self) -> None:
        """Selectors of a feature that is off would do nothing: say so instead of ignoring them."""
        unused = []
        if not self.attention_enabled:
            if self.diffusion_kv_cache_skip_steps:
                unused.append("diffusion_kv_cache_skip_steps")
            if self.diffusion_kv_cache_skip_layers:
                unused.append("diffusion_kv_cache_skip_layers")
        if unused:
            warnings.warn(f"{' and '.join(unused)} set but FP8 attention is off "
                          f"(diffusion_kv_cache_dtype={self.diffusion_kv_cache_dtype!r}): they have no effect", stacklevel=4)
        if not self.linear_enabled and self.quantization_config.skip_steps:
            warnings.warn("quantization_config.skip_steps set but quantized linears are off (quantization=None): it "
                          "has no effect", stacklevel=4)
        if not self.linear_enabled and self.quantization_config.ignored_layers:
            warnings.warn("ignored_layers set but quantized linears are off (quantization=None): it has no effect", stacklevel=4)

    # -- what is on --------------------------------------------------------
    @property
    def attention_enabled(self) -> bool:
        return self.diffusion_kv_cache_dtype == "fp8"

    @property
    def linear_enabled(self) -> bool:
        return self.quantization is not None

    @property
    def has_step_skips(self) -> bool:
        """Some step runs another graph variant (attention or linear step selectors in use)."""
        return self.attention_step_skips or self.linear_step_skips

    @property
    def attention_step_skips(self) -> bool:
        return self.attention_enabled and bool(self.diffusion_kv_cache_skip_steps)

    @property
    def linear_step_skips(self) -> bool:
        return self.linear_enabled and bool(self.quantization_config.skip_steps)

    def step_variants(self) -> tuple:
        """The step variants some step can map to (fx_fp8.steps.variant_name), the unskipped one
        first: at most 4, from the two selectors' overlaps (held as ranges, never expanded)."""
        from fx_fp8.steps import variant_name

        if not self.has_step_skips:
            return (None,)
        a = self.diffusion_kv_cache_skip_steps if self.attention_step_skips else Selector()
        lin = self.quantization_config.skip_steps if self.linear_step_skips else Selector()
        mode = self.quantization_config.skip_steps_mode
        combos = [(False, False)]  # steps past both selectors' ends
        if a.needs_total or lin.needs_total:  # "last:k": the pairs some run length shows
            from fx_fp8.selectors import step_patterns

            seen = step_patterns(a, lin)
            combos += [c for c in ((True, False), (True, True), (False, True)) if c in seen]
            return tuple(variant_name(x, y, mode) for x, y in combos)
        if _ranges_differ(a, lin):
            combos.append((True, False))
        if _ranges_intersect(a, lin):
            combos.append((True, True))
        if _ranges_differ(lin, a):
            combos.append((False, True))
        return tuple(variant_name(x, y, mode) for x, y in combos)

    # -- construction ------------------------------------------------------
    @classmethod
    def from_kwargs(cls, **kwargs) -> "FP8Config":
        """Build from flat keyword arguments (vLLM-Omni names, legacy kv_cache_* accepted).

        Which features are on:
        * neither `quantization` nor `diffusion_kv_cache_dtype` (nor legacy
          `kv_cache_dtype`, nor `quantization_config` / `ignored_layers`) given:
          both are on (choosing an fp8 backend is the opt-in);
        * one feature switched on: the other is off unless also given, as in
          vLLM-Omni where each is a separate opt-in. `quantization_config` (a
          mapping, or a method name such as "fp8") or `ignored_layers` given
          without `quantization` switch linears on with that method;
        * one feature switched off (None / "auto"): the other stays on;
        * a linear opt-in next to attention selectors (skip steps / layers) but no
          `diffusion_kv_cache_dtype`: both are on (the selectors say attention is wanted).
        A key whose value is None next to a legacy key with a value counts as
        not given (argparse-built dicts carry None for every flag).
        """
        data = fold_legacy_keys(dict(kwargs))
        for key in data:
            if key in PIPELINE_KEYS:  # a pipeline option, read by fx_fp8.pipeline.options.PipelineOptions
                raise ValueError(f"{key!r} is a pipeline option, not an FP8 option: pass it to "
                                 "fx_fp8.compile_pipeline (or put it in the YAML given to it)")
            if key not in _TOP_KEYS:
                raise ValueError(f"unknown config key {key!r}{did_you_mean(key, _TOP_KEYS + tuple(LEGACY_KEYS))}")
        shortcuts = _pop_step_shortcuts(data)
        if "ignored_layers" in data and not _clean_patterns(data["ignored_layers"]):
            del data["ignored_layers"]  # [] / "" (an empty --ignored-layers) mean "no patterns", not a linear opt-in
        qc_given = data.get("quantization_config") is not None or data.get("ignored_layers") is not None
        if isinstance(data.get("quantization_config"), str):  # vLLM-Omni's tests pass quantization_config="fp8"
            data["quantization_config"] = {"method": data["quantization_config"]}
        _check_method_agrees(data)
        if "ignored_layers" in data:
            _merge_ignored_layers_shortcut(data)
        if "quantization" not in data and qc_given:
            qc = data.get("quantization_config")
            method = qc.method if isinstance(qc, QuantizationConfig) else dict(qc or {}).get("method", "fp8")
            data["quantization"] = _check_choice("quantization_config.method", method, QUANTIZATION_METHODS[1:])
        mentions_attention = "diffusion_kv_cache_dtype" in data
        mentions_linear = "quantization" in data
        if mentions_linear and not mentions_attention and not _is_off(data["quantization"]) and (
                data.get("diffusion_kv_cache_skip_steps") or data.get("diffusion_kv_cache_skip_layers")):
            data["diffusion_kv_cache_dtype"] = "fp8"  # attention selectors next to a linear opt-in: both on
            mentions_attention = True
        given = data.get("diffusion_kv_cache_dtype") if mentions_attention else data.get("quantization")
        # Only an opt-in (a feature switched on) turns the unnamed feature off;
        # switching one feature off (None / "auto") keeps the other at its default.
        if mentions_attention != mentions_linear and not _is_off(given):
            data.setdefault("diffusion_kv_cache_dtype", None)
            data.setdefault("quantization", None)
        _apply_step_shortcuts(data, shortcuts)
        return cls(**data)

    @classmethod
    def from_yaml(cls, path) -> "FP8Config":
        """Read a flat mapping or a vLLM-Omni stage config (stage_args[*].engine_args)."""
        return cls.from_mapping(read_config_file(path), where=os.fspath(path))

    @classmethod
    def from_mapping(cls, data, *, where: str = "config") -> "FP8Config":
        return cls.from_kwargs(**_fp8_keys(data, where))

    @classmethod
    def load(cls, config=None, **overrides) -> "FP8Config":
        """Anything a user may hand us: None, FP8Config, mapping, YAML path; then overrides."""
        if config is None:
            base = cls.from_kwargs(**overrides) if overrides else cls()
            return base
        if isinstance(config, FP8Config):
            base = config
        elif isinstance(config, Mapping):
            if not _fp8_keys(config, "config"):  # {} (or only pipeline keys): as if no config was given
                return cls.load(None, **overrides)
            base = cls.from_mapping(config)
        elif isinstance(config, (str, os.PathLike)):
            data = read_config_file(config)
            if not _fp8_keys(data, os.fspath(config)):
                return cls.load(None, **overrides)
            base = cls.from_mapping(data, where=os.fspath(config))
        else:
            raise ValueError(f"invalid config {config!r}: expected an FP8Config, a mapping or a YAML path")
        return base.replace(**overrides) if overrides else base

    def replace(self, **overrides) -> "FP8Config":
        """A copy with some keys changed (same key rules as from_kwargs, without the opt-in rule)."""
        data = self.to_dict()
        data["quantization_config"]["activation_scales"] = self.quantization_config.activation_scales
        overrides = fold_legacy_keys(dict(overrides))
        shortcuts = _pop_step_shortcuts(overrides)
        if overrides.get("quantization") is not None and "quantization_config" not in overrides:
            data["quantization_config"]["method"] = overrides["quantization"]
        if "ignored_layers" in overrides:
            data["quantization_config"]["ignored_layers"] = _clean_patterns(overrides.pop("ignored_layers"))
        if isinstance(overrides.get("quantization_config"), str):
            overrides["quantization_config"] = {"method": overrides["quantization_config"]}
        _check_method_agrees({"quantization": overrides.get("quantization", data["quantization"]),
                              "quantization_config": overrides.get("quantization_config")})
        for key, value in overrides.items():
            if key not in _TOP_KEYS:
                raise ValueError(f"unknown config key {key!r}{did_you_mean(key, _TOP_KEYS)}")
            if key == "quantization_config" and isinstance(value, Mapping):
                value = dict(value)
                # quantize_sensitive and sensitive are one setting: the one given here replaces the base's
                if value.get("quantize_sensitive") and "sensitive" not in value:
                    value["sensitive"] = "fp8"
                elif "sensitive" in value and "quantize_sensitive" not in value:
                    value["quantize_sensitive"] = False
            if key in ("quantization_config", "attention") and isinstance(value, Mapping):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        if shortcuts:
            given = overrides.get("quantization_config")
            _apply_step_shortcuts({"quantization_config": dict(given) if isinstance(given, Mapping) else {}}, shortcuts)
            data["quantization_config"].update(shortcuts)
        return FP8Config(**data)

    def to_dict(self) -> dict:
        """Plain data (selectors as strings), the inverse of from_kwargs; YAML/JSON-safe."""
        qc = dataclasses.asdict(self.quantization_config)
        qc["ignored_layers"] = list(qc["ignored_layers"])
        qc["weight_block_size"] = list(qc["weight_block_size"]) if qc["weight_block_size"] else None
        qc["skip_steps"] = str(self.quantization_config.skip_steps)
        if isinstance(qc["activation_scales"], os.PathLike):
            qc["activation_scales"] = os.fspath(qc["activation_scales"])
        elif isinstance(qc["activation_scales"], Mapping) and not isinstance(qc["activation_scales"], dict):
            # the object calibrate returns: its JSON form
            from fx_fp8.activation_scales import load_activation_scales

            qc["activation_scales"] = load_activation_scales(qc["activation_scales"]).to_json()
        return {
            "diffusion_kv_cache_dtype": self.diffusion_kv_cache_dtype,
            "diffusion_kv_cache_skip_steps": str(self.diffusion_kv_cache_skip_steps),
            "diffusion_kv_cache_skip_layers": str(self.diffusion_kv_cache_skip_layers),
            "quantization": self.quantization,
            "quantization_config": qc,
            "attention": dataclasses.asdict(self.attention),
            "lowering": self.lowering,
            "downstream": self.downstream,
        }

    def to_yaml(self, path) -> None:
        import yaml

        with open(path, "w") as f:
            yaml.safe_dump(self.to_dict(), f, sort_keys=False)


def _ranges_intersect(a: Selector, b: Selector) -> bool:
    return any(max(lo, lo2) <= min(hi, hi2) for lo, hi in a.ranges for lo2, hi2 in b.ranges)


def _ranges_differ(a: Selector, b: Selector) -> bool:
    """Some value of `a` is not in `b` (checked on range ends: a gap of b inside a range of a
    starts right after one of b's ranges)."""
    for lo, hi in a.ranges:
        if lo not in b:
            return True
        for _, hi2 in b.ranges:
            if lo <= hi2 < hi and hi2 + 1 not in b:
                return True
    return False


def _check_method_agrees(data: dict) -> None:
    """`quantization` and an explicit quantization_config.method must name the same method (the
    dataclass cannot tell an explicit "fp8" from the default)."""
    qc, quantization = data.get("quantization_config"), data.get("quantization")
    if not isinstance(qc, Mapping) or qc.get("method") is None or _is_off(quantization):
        return
    method = _check_choice("quantization_config.method", qc["method"], QUANTIZATION_METHODS[1:])
    if method != _check_choice("quantization", quantization, QUANTIZATION_METHODS):
        raise ValueError(f"quantization {quantization!r} disagrees with quantization_config.method {qc['method']!r}: "
                         "give one of them, or the same method in both")


def _fp8_keys(data, where: str) -> dict:
    """The FP8 keys of a config mapping (a vLLM-Omni stage config's diffusion engine_args);
    parallel_config / cache_backend / cache_config belong to fx_fp8.pipeline.options.PipelineOptions."""
    return {k: v for k, v in config_keys(data, where).items() if k not in PIPELINE_KEYS}


def _pop_step_shortcuts(data: dict) -> dict:
    """{quantization_config key: value} of the flat quantization_skip_steps[_mode] keys, removed
    from `data` (a None value counts as not given). They are merged after the opt-in rules: they
    select steps, they switch no feature on or off."""
    out = {}
    for flat, inner in STEP_SHORTCUTS.items():
        value = data.pop(flat, None)
        if value is not None:
            out[inner] = parse_selector(value, what=flat, relative=True) if inner == "skip_steps" else value
    return out


def _apply_step_shortcuts(data: dict, shortcuts: dict) -> None:
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
            raise ValueError(f"{flat} {str(value)!r} disagrees with quantization_config.{inner} {str(given)!r}: "
                             "give one of them, or the same value in both")
        qc[inner] = value
    data["quantization_config"] = qc


def _merge_ignored_layers_shortcut(data: dict) -> None:
    """Top-level `ignored_layers` goes into quantization_config; given twice it must agree."""
    shortcut = _clean_patterns(data.pop("ignored_layers"))
    qc = data.get("quantization_config") or {}
    qc = dataclasses.asdict(qc) if isinstance(qc, QuantizationConfig) else dict(qc)
    inner = _clean_patterns(qc.get("ignored_layers"))
    if inner and shortcut and inner != shortcut:
        raise ValueError(f"ignored_layers given twice with different values: {list(shortcut)!r} and "
                         f"quantization_config.ignored_layers={list(inner)!r}")
    qc["ignored_layers"] = shortcut or inner
    data["quantization_config"] = qc
