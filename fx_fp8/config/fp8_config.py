"""FP8Config: what to quantize, where, and how; built from keywords, a mapping or a YAML file.

Keys follow vLLM-Omni's diffusion options (`diffusion_kv_cache_dtype`,
`diffusion_kv_cache_skip_steps`, `diffusion_kv_cache_skip_layers`,
`quantization`, `quantization_config`) plus two nested mappings of our own
(`attention`, and extra keys of `quantization_config`) and the backend keys
`lowering` / `downstream`. The nested settings are fx_fp8.config.attention and
fx_fp8.config.quantization, the keys' spellings and merge rules (one normaliser that
from_kwargs and replace share) fx_fp8.config.keys, the value checks fx_fp8.config.values,
reading files fx_fp8.config.files.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass, field
from typing import Mapping

from fx_fp8.config.attention import AttentionQuantConfig
from fx_fp8.config.files import config_keys, read_config_file
from fx_fp8.config.keys import PIPELINE_KEYS, normalise_keys
from fx_fp8.config.quantization import QUANTIZATION_METHODS, QuantizationConfig
from fx_fp8.config.selectors import Selector, parse_selector
from fx_fp8.config.step_variants import variant_name
from fx_fp8.config.values import check_choice, dataclass_from_mapping, is_off, short_repr

KV_CACHE_DTYPES = (None, "auto", "fp8")
LOWERINGS = ("auto", "reference", "cuda", "npu")
DOWNSTREAMS = ("auto", "eager", "inductor", "npugraph_ex")


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
        set_(
            "diffusion_kv_cache_dtype",
            check_choice("diffusion_kv_cache_dtype", self.diffusion_kv_cache_dtype, KV_CACHE_DTYPES),
        )
        set_("quantization", check_choice("quantization", self.quantization, QUANTIZATION_METHODS))
        set_(
            "diffusion_kv_cache_skip_steps",
            parse_selector(self.diffusion_kv_cache_skip_steps, what="diffusion_kv_cache_skip_steps", relative=True),
        )
        set_(
            "diffusion_kv_cache_skip_layers",
            parse_selector(self.diffusion_kv_cache_skip_layers, what="diffusion_kv_cache_skip_layers"),
        )
        set_(  # QuantizationConfig folds its synonym quantize_sensitive itself
            "quantization_config",
            dataclass_from_mapping(
                QuantizationConfig, self.quantization_config, "quantization_config", synonyms=("quantize_sensitive",)
            ),
        )
        set_("attention", dataclass_from_mapping(AttentionQuantConfig, self.attention, "attention"))
        set_("lowering", check_choice("lowering", self.lowering, LOWERINGS))
        set_("downstream", check_choice("downstream", self.downstream, DOWNSTREAMS))
        method = self.quantization_config.method
        if self.quantization is not None and method != self.quantization:
            if method != "fp8":  # "fp8" is the default: `quantization` decides
                raise ValueError(
                    f"quantization {short_repr(self.quantization)} disagrees with quantization_config.method {short_repr(method)}"
                )
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
            warnings.warn(
                f"{' and '.join(unused)} set but FP8 attention is off "
                f"(diffusion_kv_cache_dtype={short_repr(self.diffusion_kv_cache_dtype)}): they have no effect",
                stacklevel=4,
            )
        if not self.linear_enabled and self.quantization_config.skip_steps:
            warnings.warn(
                "quantization_config.skip_steps set but quantized linears are off (quantization=None): it "
                "has no effect",
                stacklevel=4,
            )
        if not self.linear_enabled and self.quantization_config.ignored_layers:
            warnings.warn(
                "ignored_layers set but quantized linears are off (quantization=None): it has no effect", stacklevel=4
            )

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
        """The step variants some step can map to (step_variants.variant_name), the unskipped one
        first: at most 4, from the two selectors' overlaps (held as ranges, never expanded)."""
        if not self.has_step_skips:
            return (None,)
        a = self.diffusion_kv_cache_skip_steps if self.attention_step_skips else Selector()
        lin = self.quantization_config.skip_steps if self.linear_step_skips else Selector()
        mode = self.quantization_config.skip_steps_mode
        combos = [(False, False)]  # steps past both selectors' ends
        if a.needs_total or lin.needs_total:  # "last:k": the pairs some run length shows
            from fx_fp8.config.selectors import step_patterns

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
        keys = normalise_keys(kwargs)
        data = keys.data
        if "quantization" not in data and keys.linear_opt_in:
            qc = data["quantization_config"]
            method = qc.method if isinstance(qc, QuantizationConfig) else qc.get("method", "fp8")
            data["quantization"] = check_choice("quantization_config.method", method, QUANTIZATION_METHODS[1:])
        mentions_attention = "diffusion_kv_cache_dtype" in data
        mentions_linear = "quantization" in data
        if (
            mentions_linear
            and not mentions_attention
            and not is_off(data["quantization"])
            and (data.get("diffusion_kv_cache_skip_steps") or data.get("diffusion_kv_cache_skip_layers"))
        ):
            data["diffusion_kv_cache_dtype"] = "fp8"  # attention selectors next to a linear opt-in: both on
            mentions_attention = True
        given = data.get("diffusion_kv_cache_dtype") if mentions_attention else data.get("quantization")
        # Only an opt-in (a feature switched on) turns the unnamed feature off;
        # switching one feature off (None / "auto") keeps the other at its default.
        if mentions_attention != mentions_linear and not is_off(given):
            data.setdefault("diffusion_kv_cache_dtype", None)
            data.setdefault("quantization", None)
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
            raise ValueError(f"invalid config {short_repr(config)}: expected an FP8Config, a mapping or a YAML path")
        return base.replace(**overrides) if overrides else base

    def replace(self, **overrides) -> "FP8Config":
        """A copy with some keys changed: from_kwargs' key rules (normalise_keys), then the keys given
        merged onto this config instead of the opt-in rule."""
        new = normalise_keys(overrides, quantization=self.quantization).data
        data = self.to_dict()
        data["quantization_config"]["activation_scales"] = self.quantization_config.activation_scales
        if "quantization_config" in overrides and overrides["quantization_config"] is None:
            data["quantization_config"] = {}  # None: the defaults, then what the shortcuts say
        qc = new.get("quantization_config", {})
        if not is_off(new.get("quantization")) and isinstance(qc, Mapping) and "method" not in qc:
            new["quantization_config"] = {**qc, "method": new["quantization"]}  # not the base's method
        for key, value in new.items():
            if key in ("quantization_config", "attention") and isinstance(value, Mapping):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
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
            # the object calibrate returns (fx_fp8.quant.activation_scales.ActivationScales): its JSON form
            scales = qc["activation_scales"]
            qc["activation_scales"] = scales.to_json() if hasattr(scales, "to_json") else dict(scales)
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


def _fp8_keys(data, where: str) -> dict:
    """The FP8 keys of a config mapping (a vLLM-Omni stage config's diffusion engine_args);
    parallel_config / cache_backend / cache_config belong to fx_fp8.pipeline.options.PipelineOptions."""
    return {k: v for k, v in config_keys(data, where).items() if k not in PIPELINE_KEYS}
