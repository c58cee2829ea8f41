"""fx_fp8 as a diffusers quantization backend: quantize linears while `from_pretrained` reads them.

    transformer = FluxTransformer2DModel.from_pretrained(path, torch_dtype=torch.bfloat16,
                                                         quantization_config=fx_fp8.DiffusersConfig())
    transformer = FluxTransformer2DModel.from_single_file(file, config=path, subfolder="transformer",
                                                          quantization_config=fx_fp8.DiffusersConfig())
    pipe = FluxPipeline.from_pretrained(path, torch_dtype=torch.bfloat16, quantization_config=
                                        PipelineQuantizationConfig(quant_mapping={"transformer": fx_fp8.DiffusersConfig()}))
    transformer.save_pretrained("out/")                        # config.json carries the quantization config
    FluxTransformer2DModel.from_pretrained("out/")             # with fx_fp8 imported: the same bytes back

DiffusersConfig takes what FP8Config.load takes (an FP8Config, a mapping or a YAML path, then
vLLM-Omni keyword options). Each eligible nn.Linear (fx_fp8.quant.rules, as prepare_model without
example inputs decides: ignored_layers, the sensitive layers by name, sizes) becomes the
QuantizedLinear prepare_model would make of it, one layer at a time as the loader hands its
weight over (fx_fp8/quant/layer_quantize.py), on the device `device_map` names (default CPU).
The loaded model is a prepared model: compile it with `torch.compile(model, backend="fp8")`
(same options) and its weights are used as they are.

A loaded model's config.json `quantization_config` records every quantized layer with its
recipe (`quantized_layers`); from_pretrained of such a folder builds those layers empty and
loads their quantized weights and scales unchanged. Registration with diffusers:
fx_fp8/pipeline/diffusers_registration.py.
"""

from __future__ import annotations

import copy
import enum
import json
from typing import Any, Optional

import torch
import torch.nn as nn
from diffusers.quantizers.base import DiffusersQuantizer
from diffusers.quantizers.quantization_config import QuantizationConfigMixin

from fx_fp8.config.checkpoint_step_policy import read_step_policy
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.config.patterns import warn_unmatched_patterns
from fx_fp8.pipeline.diffusers_registration import METHOD, ensure_registered, register_pending
from fx_fp8.quant.checkpoint import some_names
from fx_fp8.quant.layer_quantize import (
    check_load_time_config,
    empty_quantized_linear,
    layer_kind,
    layer_plan,
    quantized_linear,
)
from fx_fp8.quant.layer_record import QUANTIZED_TENSORS, Fields, check_grouped, grouped_plans, grouped_records
from fx_fp8.quant.linear_plan import LinearPlan
from fx_fp8.quant.module_swap import replace_module
from fx_fp8.quant.quantized_linear import QuantizedLinear
from fx_fp8.quant.rules import is_plain_linear
from fx_fp8.quant.state_guard import guard

#: version of the quantized_layers record in config.json
FORMAT_VERSION = 1


class FxFp8Method(str, enum.Enum):
    """quant_method of DiffusersConfig (diffusers reads `.value`)."""

    FX_FP8 = METHOD


class DiffusersConfig(QuantizationConfigMixin):
    """fx_fp8's quantization config for diffusers' `from_pretrained(..., quantization_config=...)` and
    `PipelineQuantizationConfig(quant_mapping={"transformer": ...})`.

    DiffusersConfig(config=None, **options): `config` is an FP8Config, a mapping or a YAML path (as
    FP8Config.load), `options` vLLM-Omni keyword options on top (quantization, quantization_config,
    ignored_layers, lowering, ...). Only the linear settings act while loading; the rest is kept
    in the record (`fp8_config`: the FP8Config to compile with). Settings load time cannot honour
    (static activation scales, smoothing: they need a calibration of the loaded model; linears off)
    raise ValueError here.
    `quantized_layers` is written by fx_fp8 into a loaded model's config (what is quantized, how);
    a config holding it describes a quantized checkpoint and is only for loading that checkpoint.
    """

    def __init__(
        self,
        config=None,
        *,
        quant_method=METHOD,
        format_version=FORMAT_VERSION,
        quantized_layers: Optional[list] = None,
        runtime: Optional[dict] = None,
        **options,
    ):
        ensure_registered()
        if quant_method != METHOD:
            raise ValueError(f"DiffusersConfig is fx_fp8's ({METHOD!r}); got quant_method {quant_method!r}")
        if format_version != FORMAT_VERSION:
            raise ValueError(
                f"fx_fp8 quantization config format_version {format_version!r}: this fx_fp8 reads "
                f"version {FORMAT_VERSION}"
            )
        self.quant_method = FxFp8Method.FX_FP8
        # vLLM-Omni's runtime section: its diffusion_step_policy becomes the linears' step policy
        self.runtime = runtime
        policy = read_step_policy({"runtime": runtime}) if runtime is not None else None
        self.fp8_config = FP8Config.load(config, **{**(policy or {}), **options})
        check_load_time_config(self.fp8_config)
        self.quantized_layers = check_grouped(_RECORD_FIELDS, quantized_layers)

    def with_layers(self, quantized_layers: list) -> "DiffusersConfig":
        """A copy that records `quantized_layers`."""
        return DiffusersConfig(self.fp8_config, quantized_layers=quantized_layers, runtime=self.runtime)

    def to_dict(self) -> dict[str, Any]:
        data = {"quant_method": METHOD, "format_version": FORMAT_VERSION, **self.fp8_config.to_dict()}
        if self.quantized_layers is not None:
            data["quantized_layers"] = copy.deepcopy(self.quantized_layers)
        if self.runtime is not None:
            data["runtime"] = copy.deepcopy(self.runtime)
        return data

    def to_diff_dict(self) -> dict[str, Any]:  # QuantizationConfigMixin.to_json_string / __repr__ use it
        return self.to_dict()

    def __iter__(self):
        yield from self.to_dict().items()

    def __eq__(self, other):
        return isinstance(other, DiffusersConfig) and self.to_dict() == other.to_dict()

    __hash__ = None


# -- the record of quantized layers (its schema: fx_fp8/quant/layer_record.py) --------------------
#: where a damaged record comes from, and what to do about it
_RECORD_FIELDS = Fields(
    "the fx_fp8 quantization_config (config.json)",
    "the file was edited or is not what save_pretrained of a model loaded with "
    "fx_fp8.DiffusersConfig wrote: load the full-precision checkpoint with it and save again",
)


def record_of(model: nn.Module) -> list[dict]:
    """The grouped record of the model's QuantizedLinear modules: one entry per recipe."""
    return grouped_records({n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)})


class FxFp8Quantizer(DiffusersQuantizer):
    """diffusers' loader calls this per tensor (fx_fp8/pipeline/diffusers_registration.py registers it).

    Quantizing a full-precision checkpoint: every eligible linear's weight goes through
    create_quantized_param, which replaces that linear by its QuantizedLinear on the target device;
    the bf16 weight is dropped when the loader moves on. Loading a quantized checkpoint: the
    recorded layers are QuantizedLinear modules on the meta device before loading, and their
    quantized weights and fp32 scales are set exactly as stored (the loader would cast them to
    torch_dtype).
    """

    use_keep_in_fp32_modules = True  # a module diffusers keeps in float32 stays so; its linears quantize from fp32
    requires_calibration = False
    required_packages = ["accelerate"]

    def __init__(self, quantization_config: DiffusersConfig, **kwargs):
        # from_pretrained says whether the checkpoint is quantized (its config.json has a
        # quantization_config); from_single_file does not (diffusers' default is "quantized": BFL
        # and GGUF single files are): there the config decides, by its record of quantized layers
        single_file = "pre_quantized" not in kwargs
        super().__init__(quantization_config, **kwargs)
        if not isinstance(quantization_config, DiffusersConfig):
            raise ValueError(
                f"fx_fp8's quantizer takes an fx_fp8.DiffusersConfig, got {type(quantization_config).__name__}"
            )
        if single_file:
            self.pre_quantized = quantization_config.quantized_layers is not None
        self.fp8 = quantization_config.fp8_config
        self.plan: dict[str, str] = {}  # name -> "quantized" / "weight_only" (checkpoint in full precision)
        self.native: dict[str, str] = {}  # name -> why it stays an nn.Linear
        self.recorded: dict[str, LinearPlan] = {}  # name -> stored plan: the layers of a quantized checkpoint
        self.loaded: dict[str, set] = {}  # name -> the quantized tensors set from a quantized checkpoint
        self.keep_in_fp32: list[str] = []
        self.loaded_keys: set = set()

    # -- before loading ---------------------------------------------------------------------
    def validate_environment(self, *args, **kwargs):
        from diffusers.utils import is_accelerate_available

        if not is_accelerate_available():
            raise ImportError(
                "loading with fx_fp8.DiffusersConfig needs the 'accelerate' package "
                "(diffusers builds the model empty with it): pip install accelerate"
            )
        recorded = self.quantization_config.quantized_layers is not None
        if self.pre_quantized and not recorded:
            raise ValueError(
                "this folder's config.json has an fx_fp8 quantization_config without quantized_layers "
                "(no record of what was quantized): it was not written by save_pretrained of a model "
                "loaded with fx_fp8.DiffusersConfig"
            )
        if recorded and not self.pre_quantized:
            raise ValueError(
                "this DiffusersConfig records quantized_layers (it describes an already quantized "
                "checkpoint): pass a new fx_fp8.DiffusersConfig(...) to quantize a full-precision one"
            )
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in {str(v) for v in device_map.values()}:
            raise ValueError(
                f"device_map {device_map!r} offloads to disk: fx_fp8 quantizes while loading and "
                "cannot quantize what goes to disk; use devices only"
            )

    def maybe_update_loaded_keys(self, loaded_keys: list[str], checkpoint_files: list[str]) -> list[str]:
        self.loaded_keys = set(loaded_keys)
        return loaded_keys

    def _process_model_before_weight_loading(self, model, device_map=None, keep_in_fp32_modules=(), **kwargs):
        self.keep_in_fp32 = [m for m in keep_in_fp32_modules or () if m]
        if kwargs.get("state_dict") is not None:  # from_single_file hands over the whole (converted) checkpoint
            self.loaded_keys = set(kwargs["state_dict"])
        linears = {n: m for n, m in model.named_modules() if is_plain_linear(m)}
        if self.pre_quantized:
            self._build_recorded_layers(model, linears)
            return model
        prequantized = [n for n in linears if f"{n}.weight_scale" in self.loaded_keys]
        if prequantized:
            raise ValueError(
                f"the checkpoint already holds quantized linears ({some_names(prequantized, 8)} have a "
                "weight_scale): fx_fp8.DiffusersConfig quantizes full-precision checkpoints"
            )
        if self.fp8.linear_enabled:  # the full-precision weights of a typo'd layer are never loaded
            warn_unmatched_patterns(
                self.fp8.quantization_config.ignored_layers, linears, "DiffusersConfig", stacklevel=2
            )
        for name, m in linears.items():
            kind, why = layer_kind(name, m.in_features, m.out_features, m.weight.dtype, self.fp8)
            if kind == "native":
                self.native[name] = why
            else:
                self.plan[name] = kind
        return model

    def _layer_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype diffusers gives the layer's floating tensors (its modules kept in float32)."""
        return torch.float32 if any(m in name.split(".") for m in self.keep_in_fp32) else dtype

    def _build_recorded_layers(self, model, linears: dict) -> None:
        """Validate the record against the model and the checkpoint's keys, then put empty
        QuantizedLinear modules where it says (nothing changes unless everything matches)."""
        self.recorded = grouped_plans(self.quantization_config.quantized_layers)
        problems = []
        for name in self.recorded:
            if name not in linears:
                found = dict(model.named_modules()).get(name)
                problems.append(
                    f"{name}: recorded as quantized, the model has "
                    f"{type(found).__name__ if found is not None else 'no module'} there"
                )
            missing = [t for t in ("weight", "weight_scale") if f"{name}.{t}" not in self.loaded_keys]
            if missing:
                problems.append(f"{name}: recorded as quantized, the checkpoint has no {' / '.join(missing)}")
        stray = [n for n in linears if n not in self.recorded and f"{n}.weight_scale" in self.loaded_keys]
        if stray:
            problems.append(
                f"the checkpoint holds quantized weights for linears its record does not name: {some_names(stray, 8)}"
            )
        if problems:
            raise ValueError(
                "the fx_fp8 quantized checkpoint does not match its config.json record "
                "(quantization_config.quantized_layers):\n  " + "\n  ".join(problems)
            )
        for name, plan in self.recorded.items():
            old = linears[name]
            replace_module(
                model,
                name,
                empty_quantized_linear(
                    old.in_features,
                    old.out_features,
                    old.bias is not None,
                    self._layer_dtype(name, old.weight.dtype),
                    plan.recipe,
                    plan.act,
                ),
            )
            self.loaded[name] = set()
        for name, m in linears.items():
            if name not in self.recorded:
                kind, why = layer_kind(name, m.in_features, m.out_features, m.weight.dtype, self.fp8)
                self.native[name] = why if kind == "native" else "full precision in the checkpoint (not in its record)"

    # -- while loading ------------------------------------------------------------------------
    def check_if_quantized_param(self, model, param_value, param_name: str, state_dict: dict, **kwargs) -> bool:
        name, _, tensor = param_name.rpartition(".")
        if self.pre_quantized:
            return name in self.recorded and tensor in QUANTIZED_TENSORS
        return tensor == "weight" and name in self.plan

    def create_quantized_param(
        self, model, param_value, param_name: str, target_device, state_dict=None, unexpected_keys=None, **kwargs
    ):
        name, _, tensor = param_name.rpartition(".")
        layer = model.get_submodule(name)
        if self.pre_quantized:
            self._set_stored(layer, name, tensor, state_dict[param_name], target_device)
            return
        if param_value.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"{param_name} is {param_value.dtype} in the checkpoint: fx_fp8.DiffusersConfig "
                "quantizes full-precision (fp32 / bf16 / fp16) weights"
            )
        plan = layer_plan(name, layer.in_features, layer.out_features, layer.weight.dtype, self.fp8, target_device)
        new = quantized_linear(param_value, layer.bias, plan, target_device)
        replace_module(model, name, new)

    def _set_stored(self, layer: QuantizedLinear, name: str, tensor: str, value: torch.Tensor, device) -> None:
        """One stored tensor of a quantized layer, as it is in the file (never cast)."""
        expected = getattr(layer, tensor, None)
        if expected is None:
            raise ValueError(f"{name}.{tensor} is in the checkpoint, but its recorded recipe has no {tensor}")
        if value.dtype != expected.dtype or tuple(value.shape) != tuple(expected.shape):
            raise ValueError(
                f"{name}.{tensor} in the checkpoint is {value.dtype} {list(value.shape)}; its record "
                f"({layer.method} {layer.weight_granularity} scales) expects {expected.dtype} "
                f"{list(expected.shape)}"
            )
        moved = value.to(device)
        if tensor == "weight":
            layer._parameters["weight"] = torch.nn.Parameter(moved, requires_grad=False)
        else:
            layer._buffers[tensor] = moved
        self.loaded[name].add(tensor)

    # -- after loading ------------------------------------------------------------------------
    def _process_model_after_weight_loading(self, model, **kwargs):
        layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
        if self.pre_quantized:
            missing = [f"{n}.{t}" for n, got in self.loaded.items() for t in ("weight", "weight_scale") if t not in got]
        else:
            missing = [f"{n}.weight" for n in self.plan if n not in layers]
        if missing:  # a weight the checkpoint lacks stays empty: diffusers only warns; nothing can run
            raise ValueError(f"the checkpoint has no {some_names(missing, 8)}: those quantized layers would stay empty")
        for name, layer in layers.items():
            if self.pre_quantized and layer.bias is not None:
                layer.orig_dtype = layer.bias.dtype
            layer.accept_weight(name)
        guard(model, self.native, refuse_save_pretrained=False)
        self.quantization_config = self.quantization_config.with_layers(record_of(model))
        model.register_to_config(quantization_config=self.quantization_config)
        return model

    # -- saving -------------------------------------------------------------------------------
    def get_state_dict_and_metadata(self, state_dict: dict, safe_serialization: bool = False):
        """The state dict as it is; the record written into config.json must name exactly the
        layers whose quantized weights are in it."""
        recorded = set(grouped_plans(self.quantization_config.quantized_layers or []))
        stored = {k[: -len(".weight_scale")] for k in state_dict if k.endswith(".weight_scale")}
        if recorded != stored:
            raise ValueError(
                "the model's quantized layers changed since it was loaded (config.json's record: "
                f"{len(recorded)} layers, the state dict: {len(stored)}; e.g. "
                f"{some_names(sorted(recorded ^ stored), 3)}): save it with fx_fp8.save_quantized"
            )
        return state_dict, {}

    @property
    def supports_parallel_loading(self) -> bool:
        return False  # threads would quantize several layers at once: more than one full-precision layer held

    @property
    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True

    def __repr__(self):
        return f"FxFp8Quantizer({json.dumps(self.fp8.to_dict()['quantization_config'], default=str)})"


register_pending()  # diffusers' quantizers may have been imported by this module's own imports
