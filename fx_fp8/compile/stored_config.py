"""A model quantized at load compiles as it was loaded.

`from_pretrained(..., quantization_config=fx_fp8.DiffusersConfig(...))` records the FP8Config the
model was quantized with in `model.config.quantization_config` (a DiffusersConfig whose `fp8_config`
it is, or, read back from a config.json, its dict with quant_method "fx_fp8"). torch.compile's "fp8"
backend and compile_pipeline start from that config: with no options the model compiles as loaded
(an INT8-linears-only load keeps attention native); an option that agrees with it changes nothing;
one that contradicts it is an error naming both values. Where the kernels run (lowering,
downstream) and which steps and layers keep attention or linears out of FP8 (the step policy, the
attention layer selector: a run's policy on top of the loaded weights, as a model folder's own
fx_fp8.yaml gives it) are not fixed by the load: options set them freely.
"""

from __future__ import annotations

from typing import Optional

from fx_fp8.config.checkpoint_step_policy import read_step_policy
from fx_fp8.config.fp8_config import FP8Config

#: the quant_method diffusers records for fx_fp8 (fx_fp8.pipeline.diffusers_registration.METHOD)
METHOD = "fx_fp8"
#: record keys that are not FP8Config keys (runtime: vLLM-Omni's section, read by checkpoint_step_policy)
RECORD_KEYS = ("quant_method", "format_version", "quantized_layers", "runtime")
#: FP8Config keys an option may set whatever the load recorded: where the kernels run, the step
#: policy and the attention layer selector
FREE_KEYS = (
    "lowering",
    "downstream",
    "diffusion_kv_cache_skip_steps",
    "diffusion_kv_cache_skip_layers",
    "quantization_config.skip_steps",
    "quantization_config.skip_steps_mode",
)


class StoredConfigConflict(ValueError):
    """An explicit option contradicts the config a model was quantized with at load."""


def stored_config(model) -> Optional[FP8Config]:
    """The FP8Config `model` was quantized with at load, or None (not loaded through fx_fp8's
    diffusers quantizer; a torch.compile'd wrapper is looked through)."""
    model = getattr(model, "_orig_mod", model)
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    if qc is None:
        return None
    fp8 = getattr(qc, "fp8_config", None)
    if isinstance(fp8, FP8Config):
        return fp8
    data = qc if isinstance(qc, dict) else None
    if data is None or str(getattr(data.get("quant_method"), "value", data.get("quant_method"))) != METHOD:
        return None
    stored = FP8Config.from_mapping(
        {k: v for k, v in data.items() if k not in RECORD_KEYS}, where="quantization_config"
    )
    policy = read_step_policy(data)
    return stored.replace(**policy) if policy else stored


def with_checkpoint_step_policy(config: FP8Config, model) -> FP8Config:
    """`config` with the step policy of `model`'s checkpoint (config.quantization_config.runtime.
    diffusion_step_policy, any quantization method: checkpoint_step_policy.py) when `config` sets
    none for the linears; a different one of its own is StoredConfigConflict naming both."""
    model = getattr(model, "_orig_mod", model)
    policy = read_step_policy(getattr(getattr(model, "config", None), "quantization_config", None))
    if not policy or not config.linear_enabled:
        return config
    with_policy = config.replace(**policy)
    own = config.quantization_config
    if own.skip_steps and (own.skip_steps, own.skip_steps_mode) != (
        with_policy.quantization_config.skip_steps,
        "weight_only",
    ):
        raise StoredConfigConflict(
            f"quantization_config.skip_steps: the checkpoint's diffusion_step_policy asks for "
            f"{policy['quantization_skip_steps']!r} (weight_only), the options ask for {str(own.skip_steps)!r} "
            f"({own.skip_steps_mode}): drop the option to run the checkpoint's policy"
        )
    return with_policy


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in data.items():
        if isinstance(v, dict) and k != "activation_scales":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def conflicts(stored: FP8Config, asked: FP8Config) -> list[str]:
    """'key: loaded with A, asked for B' for every key (but lowering / downstream) that differs."""
    a, b = _flat(stored.to_dict()), _flat(asked.to_dict())
    return [
        f"{k}: the model was quantized at load with {a.get(k)!r}, the options ask for {b.get(k)!r}"
        for k in sorted(a.keys() | b.keys())
        if k not in FREE_KEYS and a.get(k) != b.get(k)
    ]


def settle(stored: FP8Config, base=None, **options) -> FP8Config:
    """The config to compile a model loaded with `stored`: `stored` with the options' lowering /
    downstream, after checking that the base config and the other options agree with it."""
    if base is None and not options:
        return stored
    asked = stored.replace(**options) if base is None else FP8Config.load(base, **options)
    problems = conflicts(stored, asked)
    if problems:
        raise StoredConfigConflict(
            "the options contradict the config this model was quantized with at load (its "
            "config.quantization_config): " + "; ".join(problems) + ". Drop those options to compile it as "
            "loaded, or reload it with a quantization_config that asks for them"
        )
    free = {k: v for k, v in _flat(asked.to_dict()).items() if k in FREE_KEYS and v != _flat(stored.to_dict())[k]}
    return stored.replace(**{_FLAT_KEY.get(k, k): v for k, v in free.items()}) if free else stored


#: the flat replace() key of a nested free key
_FLAT_KEY = {
    "quantization_config.skip_steps": "quantization_skip_steps",
    "quantization_config.skip_steps_mode": "quantization_skip_steps_mode",
}
