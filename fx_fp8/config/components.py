"""Component-scoped configuration, as vLLM-Omni's `ComponentQuantizationConfig`.

A `quantization` value that is a mapping of pipeline components (no `method` key) scopes the
linears' quantization by component, with vLLM-Omni's spelling (vllm_omni/quantization/factory.py):

    quantization:
      transformer: fp8                 # a method name,
      text_encoder: {method: int8}     # a quantization_config mapping (`quant_method` accepted),
      text_encoder_2: null             # or null: left as it is
      default: fp8                     # the denoising transformers no key covers (vLLM-Omni: unmatched prefixes)

A key names components as vLLM-Omni's `ComponentQuantizationConfig.resolve` matches them: a key
applies to every component whose name begins with it (`text_encoder` covers `text_encoder_2`
too), and where several keys begin a name the longest wins (`text_encoder_2: null` next to
`text_encoder: fp8` leaves text_encoder_2 as it is). A key with `*`, `?` or `[` is a shell
pattern matched against the whole name (`text_encoder_*` covers text_encoder_2 and _3, not
text_encoder), tried before the prefixes, the longest pattern winning (vLLM-Omni's layer-role
patterns). A key that covers no component is refused by name.

A plain config (a method, or no `quantization` key) means the denoising transformers, as
before. In a component map a denoising transformer that no key covers and `default` does not
cover keeps native linears (vLLM-Omni's default is none); its attention follows the
config's other keys. The other components (text encoders, ...) get their linears only: FP8
attention is a denoising transformer's. compile_pipeline reads the map (fx_fp8/pipeline/plan.py).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from fx_fp8.config.files import read_config
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.config.values import short_repr

#: the component-map key vLLM-Omni reads for the unnamed components
DEFAULT_COMPONENT = "default"
#: vLLM-Omni's two spellings of a spec's method
METHOD_KEYS = ("method", "quant_method")


def is_component_map(value) -> bool:
    """A `quantization` value that maps components to specs (vLLM-Omni: a mapping without a method key)."""
    return isinstance(value, Mapping) and not any(k in value for k in METHOD_KEYS)


@dataclass(frozen=True)
class ComponentConfigs:
    """A config split into its component map (None: a plain config) and the rest."""

    base: Any  # the config without the map (what FP8Config.load takes)
    overrides: dict
    specs: Optional[dict] = None  # {component: None | {"quantization": m, "quantization_config": {...}}}
    default: Optional[dict] = field(default=None)

    @classmethod
    def split(cls, config, overrides: Mapping) -> "ComponentConfigs":
        """config: what compile_pipeline was given (read here, unless read_config has read it)."""
        overrides = dict(overrides)
        data = read_config(config)
        if is_component_map(overrides.get("quantization")):
            return cls(data, overrides, *_specs(overrides.pop("quantization"), "quantization="))
        if isinstance(data, Mapping) and is_component_map(data.get("quantization")):
            if "quantization" in overrides:
                raise ValueError(
                    f"quantization={short_repr(overrides['quantization'])} and the config's component map "
                    f"{short_repr(dict(data['quantization']))} both set quantization: give one"
                )
            rest = {k: v for k, v in data.items() if k != "quantization"}
            return cls(rest, overrides, *_specs(data["quantization"], "quantization"))
        return cls(data, overrides)

    @property
    def named(self) -> list:
        """The map's keys ("default" aside): component names, each covering the names it begins."""
        return [c for c in (self.specs or {}) if c != DEFAULT_COMPONENT]

    def key_for(self, name: str) -> Optional[str]:
        """The key that applies to component `name` (None: no key begins it)."""
        return matching_key(name, self.named)

    def transformer_config(self, attr: str) -> FP8Config:
        """The config of the denoising transformer `attr`: the plain config, or with a map the spec
        of the key that applies to it (else `default`, else native linears) over the config's other keys."""
        base = FP8Config.load(self.base, **self.overrides)
        if self.specs is None:
            return base
        key = self.key_for(attr)
        spec = self.specs[key] if key is not None else self.default
        return base.replace(**(spec or {"quantization": None}))

    def component_config(self, name: str) -> FP8Config:
        """The config of a component that is not a denoising transformer: the spec of the key that
        applies to it, linears only (no FP8 attention), the base's lowering and downstream."""
        base = FP8Config.load(self.base, **self.overrides)
        key = self.key_for(name)
        spec = (self.specs[key] if key is not None else None) or {"quantization": None}
        return FP8Config.from_kwargs(
            diffusion_kv_cache_dtype=None, lowering=base.lowering, downstream=base.downstream, **spec
        )


def matching_key(name: str, keys) -> Optional[str]:
    """The key of `keys` that applies to component `name`, or None.

    vLLM-Omni's rule, ComponentQuantizationConfig in vllm-project/vllm-omni
    vllm_omni/quantization/component_config.py: keys with a shell wildcard (`*`, `?`, `[`) are
    fnmatch patterns, tried first, the longest pattern that matches the whole name winning (the
    version with layer-role patterns); then plain keys, sorted longest first, the first that
    `name` starts with winning (`resolve` at commit 442b6b32): no dot boundary, so
    'transformer' covers 'transformer_2'. No match falls to the default."""
    keys = list(keys)
    for key in sorted((k for k in keys if is_wildcard(k)), key=len, reverse=True):
        if fnmatch.fnmatchcase(name, key):
            return key
    for key in sorted((k for k in keys if not is_wildcard(k)), key=len, reverse=True):
        if name.startswith(key):
            return key
    return None


def covers(key: str, name: str) -> bool:
    """Whether `key` (a pattern or a prefix, as matching_key reads it) applies to `name` on its own."""
    return fnmatch.fnmatchcase(name, key) if is_wildcard(key) else name.startswith(key)


def is_wildcard(key: str) -> bool:
    """A key written as a shell pattern (fnmatch), matched against the whole component name."""
    return any(c in key for c in "*?[")


def _specs(mapping: Mapping, where: str) -> tuple[dict, Optional[dict]]:
    specs = {}
    for component, value in mapping.items():
        if not isinstance(component, str) or not component:
            raise ValueError(
                f"invalid component {short_repr(component)} in {where}: expected a pipeline component "
                "name such as 'transformer' or 'text_encoder'"
            )
        specs[component] = _spec(value, f"{where}.{component}")
    if not [c for c in specs if c != DEFAULT_COMPONENT]:
        raise ValueError(
            f"{where} {short_repr(dict(mapping))} names no component: map components such as "
            "'transformer' or 'text_encoder' to a method"
        )
    return specs, specs.pop(DEFAULT_COMPONENT, None)


def _spec(value, where: str) -> Optional[dict]:
    """One component's value as FP8 keys: None (left as it is), a method, or a quantization_config mapping."""
    if value is None:
        return None
    if isinstance(value, str):
        return {"quantization": value}
    if isinstance(value, Mapping):
        qc = dict(value)
        method, quant_method = qc.pop("method", None), qc.pop("quant_method", None)
        if method is not None and quant_method is not None and method != quant_method:
            raise ValueError(
                f"{where}: method {short_repr(method)} and quant_method {short_repr(quant_method)} disagree "
                "(they are one key): give one"
            )
        method = method if method is not None else quant_method
        if method is None:
            raise ValueError(
                f"{where} {short_repr(dict(value))} has no method: give method: fp8 or int8 (or null to "
                "leave the component as it is)"
            )
        return {"quantization": method, "quantization_config": {**qc, "method": method}}
    raise ValueError(
        f"invalid {where} {short_repr(value)}: expected a method ('fp8', 'int8'), a quantization_config "
        "mapping with a method, or null"
    )
