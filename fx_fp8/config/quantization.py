"""QuantizationConfig: how FP8Config's linears are quantized (the `quantization_config` key,
vLLM's plus our extras), and the ignored_layers patterns."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

from fx_fp8.config.patterns import split_patterns, validate_pattern
from fx_fp8.config.selectors import Selector, parse_selector
from fx_fp8.config.values import check_bool, check_choice, check_int, is_number, short_repr

QUANTIZATION_METHODS = (None, "fp8", "int8")
#: older configs wrote "@defaults" in ignored_layers to keep the sensitive layers: now always kept
DEFAULTS_TOKEN = "@defaults"
#: what linears run on the steps quantization_config.skip_steps names
SKIP_STEPS_MODES = ("native", "weight_only")
#: how the sensitive linears (embedders, adaLN modulation, final projection) run
SENSITIVE_MODES = ("native", "weight_only", "fp8")
#: weight-only with INT8 weights, one scale per output channel and 32 input columns: on the shipped tiny
#: model and the zoo as good as native sensitive layers, 0.521x weight bytes on a bf16 Flux (0.666x
#: native); benchmarks/sensitive_modes.py, RESULTS.md 2026-12-02
DEFAULT_SENSITIVE = "weight_only"
#: quantization_config.kernel: follow the measured tune table ("auto") or the fixed rules alone
LINEAR_KERNELS = ("auto", "rules")


@dataclass(frozen=True)
class QuantizationConfig:
    """Linear (W8A8) settings, vLLM's `quantization_config` plus our extras.

    method: "fp8" (float8 e4m3 W8A8) or "int8" (symmetric int8 W8A8).
    ignored_layers: module-name patterns of linears kept native, on top of the
      known-sensitive layers (embedders, adaLN modulation, final projection),
      which run as `sensitive` says. None and [] both mean "no extra patterns".
      The token "@defaults" (older configs) is accepted and changes nothing:
      the sensitive layers are always kept.
    sensitive: how the sensitive layers run: "weight_only" (default: quantized
      weights stored as weight_only_method / weight_only_group_size say,
      activations in the model's precision: W8A16), "native" or "fp8"
      (quantized like every other linear, W8A8 with `method`: everything eligible
      then runs quantized except `ignored_layers`). A config's
      `quantize_sensitive: true` (vLLM-Omni's key) is read as sensitive "fp8"
      (fx_fp8.config.keys.fold_quantize_sensitive); the property
      `quantize_sensitive` says whether sensitive is "fp8".
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
    kernel: "auto" (default) follows the tune table measured on this GPU (`fx-fp8 tune`,
      fx_fp8.ops.tune_table) per linear: native where no candidate this config emits is
      measurably faster, weight-only where that form is the fastest; on CUDA only, unless
      tune_table names a file. "rules": the fixed rules alone, never a table.
    tune_table: a tune table JSON to follow instead of the cache's / the shipped one (its key
      must match the device; a CPU table from `fx-fp8 tune --dry-run` applies to CPU compiles).
    """

    method: str = "fp8"
    ignored_layers: tuple[str, ...] = ()
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
    kernel: str = "auto"
    tune_table: Any = None

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass normalisation
        set_("method", check_choice("quantization_config.method", self.method, QUANTIZATION_METHODS[1:]))
        set_("ignored_layers", clean_patterns(self.ignored_layers))
        if self.sensitive is None:
            set_("sensitive", DEFAULT_SENSITIVE)
        set_("sensitive", check_choice("quantization_config.sensitive", self.sensitive, SENSITIVE_MODES))
        set_("skip_steps", parse_selector(self.skip_steps, what="quantization_config.skip_steps", relative=True))
        mode = check_choice("quantization_config.skip_steps_mode", self.skip_steps_mode, SKIP_STEPS_MODES)
        set_("skip_steps_mode", mode)
        if self.weight_only_method is not None:
            set_(
                "weight_only_method",
                check_choice("quantization_config.weight_only_method", self.weight_only_method, QUANTIZATION_METHODS),
            )
        group = self.weight_only_group_size
        if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 16 or group % 16):
            raise ValueError(
                f"invalid quantization_config.weight_only_group_size {short_repr(group)}: expected a multiple of "
                "16 (input columns per weight scale), or None for one scale per output channel"
            )
        set_(
            "activation_scheme",
            check_choice("quantization_config.activation_scheme", self.activation_scheme, ("dynamic", "static")),
        )
        set_(
            "activation_granularity",
            check_choice(
                "quantization_config.activation_granularity", self.activation_granularity, ("token", "tensor")
            ),
        )
        if self.weight_block_size is not None:
            wbs = self.weight_block_size
            if not isinstance(wbs, (list, tuple)) or len(wbs) != 2:
                raise ValueError(f"invalid weight_block_size {short_repr(wbs)}: expected [rows, cols], e.g. [128, 128]")
            set_("weight_block_size", tuple(check_int("weight_block_size", v) for v in wbs))
            set_("weight_granularity", "block")
        set_(
            "weight_granularity",
            check_choice(
                "quantization_config.weight_granularity", self.weight_granularity, ("tensor", "channel", "block")
            ),
        )
        if self.weight_granularity == "block" and self.weight_block_size is None:
            set_("weight_block_size", (128, 128))
        if self.activation_scheme == "static" and self.activation_scales is None:
            raise ValueError(
                "activation_scheme 'static' needs activation_scales: a JSON file written by fx_fp8.calibrate, or its dict"
            )
        if self.activation_scales is not None and not isinstance(self.activation_scales, (str, os.PathLike, Mapping)):
            raise ValueError(
                f"invalid activation_scales {short_repr(self.activation_scales)}: expected a JSON path or a mapping"
            )
        if self.activation_scales is not None and self.activation_scheme != "static" and self.smoothing_alpha is None:
            warnings.warn(
                "quantization_config.activation_scales is given but activation_scheme is "
                f"{short_repr(self.activation_scheme)} and smoothing_alpha is not set: the scales are unused "
                "(set activation_scheme: static to use them)",
                stacklevel=5,
            )
        set_("kernel", check_choice("quantization_config.kernel", self.kernel, LINEAR_KERNELS))
        if self.tune_table is not None and not isinstance(self.tune_table, (str, os.PathLike)):
            raise ValueError(
                f"invalid quantization_config.tune_table {self.tune_table!r}: expected the path of a "
                "table written by `fx-fp8 tune`, or None"
            )
        if self.tune_table is not None:
            set_("tune_table", os.fspath(self.tune_table))
        check_int("quantization_config.min_features", self.min_features, minimum=0)
        check_bool("quantization_config.fast_accum", self.fast_accum)
        if self.smoothing_alpha is not None:
            if not is_number(self.smoothing_alpha) or not 0 <= self.smoothing_alpha <= 1:
                raise ValueError(
                    f"invalid quantization_config.smoothing_alpha {short_repr(self.smoothing_alpha)}: "
                    "expected a number in [0, 1] (or None: no smoothing)"
                )
            set_("smoothing_alpha", float(self.smoothing_alpha))
            if self.activation_scales is None:
                raise ValueError(
                    "quantization_config.smoothing_alpha needs quantization_config.activation_scales: "
                    "a calibration with per-channel statistics written by fx_fp8.calibrate "
                    "(fx_fp8.save_activation_scales), or the object it returns"
                )

    @property
    def quantize_sensitive(self) -> bool:
        """The sensitive layers run W8A8 (sensitive "fp8"; vLLM-Omni's quantize_sensitive: true)."""
        return self.sensitive == "fp8"

    @property
    def act_granularity(self) -> str:
        """The activation quantization that runs: "static", or the dynamic granularity
        ("group" whenever the weights have block scales)."""
        if self.activation_scheme == "static":
            return "static"
        return "group" if self.weight_granularity == "block" else self.activation_granularity


def clean_patterns(layers) -> tuple[str, ...]:
    """ignored_layers as a tuple of validated patterns; None -> (); "a, re:b{1,2}" -> ("a", "re:b{1,2}")
    (commas inside brackets stay in their pattern); "@defaults" dropped."""
    if layers is None:
        return ()
    if isinstance(layers, str):
        layers = split_patterns(layers)
    if not isinstance(layers, (list, tuple)) or not all(isinstance(p, str) for p in layers):
        raise ValueError(f"invalid ignored_layers {short_repr(layers)}: expected a list of module-name patterns")
    cleaned = tuple(p.strip() for p in layers if p.strip() and p.strip() != DEFAULTS_TOKEN)
    for p in cleaned:
        validate_pattern(p)
    return cleaned


def fold_quantize_sensitive(qc: Mapping) -> dict:
    """quantization_config's `quantize_sensitive` (vLLM-Omni's key) as `sensitive`: true is
    sensitive "fp8", false says nothing; true next to another `sensitive` is an error naming both."""
    qc = dict(qc)
    if "quantize_sensitive" not in qc:
        return qc
    if check_bool("quantization_config.quantize_sensitive", qc.pop("quantize_sensitive")):
        sensitive = qc.get("sensitive")
        if sensitive is not None and check_choice("quantization_config.sensitive", sensitive, SENSITIVE_MODES) != "fp8":
            raise ValueError(
                f"quantization_config.quantize_sensitive: true (a synonym of sensitive: fp8) disagrees "
                f"with quantization_config.sensitive {short_repr(sensitive)}: give one of them"
            )
        qc["sensitive"] = "fp8"
    return qc


def _taking_quantize_sensitive(init):
    """QuantizationConfig(..., quantize_sensitive=True) keeps working (the keyword was a field
    until the synonym was folded into `sensitive` at the door): folded as the keys are."""

    def __init__(self, *args, quantize_sensitive=None, **kwargs):
        if quantize_sensitive is not None:
            kwargs = fold_quantize_sensitive({**kwargs, "quantize_sensitive": quantize_sensitive})
        init(self, *args, **kwargs)

    __init__.__doc__, __init__.__wrapped__ = init.__doc__, init
    return __init__


QuantizationConfig.__init__ = _taking_quantize_sensitive(QuantizationConfig.__init__)
