"""fx_fp8: FP8 attention and FP8 linears for diffusion transformers, as a torch.compile backend.

    torch.compile(transformer, backend="fp8")        # or "fp8_npu"
    torch.compile(transformer, backend="fp8", options={"diffusion_kv_cache_skip_steps": "0,1"})

`import fx_fp8` stays close to `import torch` (benchmarks/import_time.py): it registers the
torch.ops.fx_fp8.* custom ops and the diffusers quantizer hook, and imports every public name on
first use (PEP 562), so Dynamo, sympy, Triton, RE2, tabulate and diffusers load only when a compile
or a report needs them. The backends "fp8" / "fp8_npu" are torch entry points: torch.compile finds
them without importing fx_fp8 first.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from fx_fp8.ops import library  # noqa: F401  registers torch.ops.fx_fp8.*
from fx_fp8.pipeline.diffusers_registration import install as _install_diffusers_quantizer
from fx_fp8.quant.peft_guard import install as _install_peft_guard

_install_diffusers_quantizer()  # fx_fp8 joins diffusers' quantizer mappings (now or when diffusers loads them)
_install_peft_guard()  # a PEFT adapter on a prepared model: fx_fp8's error, naming what works (now or when PEFT loads)

__version__ = "0.1.0"

#: public name -> the module defining it, imported on first use
_LAZY = {
    "load_activation_scales": "fx_fp8.quant.activation_scales",
    "save_activation_scales": "fx_fp8.quant.activation_scales",
    "calibrate": "fx_fp8.quant.calibration",
    "AttentionQuantConfig": "fx_fp8.config.attention",
    "FP8Config": "fx_fp8.config.fp8_config",
    "QuantizationConfig": "fx_fp8.config.quantization",
    "CompileReport": "fx_fp8.report",
    "ReportEntry": "fx_fp8.report",
    "clear_reports": "fx_fp8.report",
    "get_reports": "fx_fp8.report",
    "parse_selector": "fx_fp8.config.selectors",
    "current_step": "fx_fp8.steps",
    "denoising_step": "fx_fp8.steps",
    "set_step": "fx_fp8.steps",
    "prepare_model": "fx_fp8.quant.prepare",
    "adopt_prequantized": "fx_fp8.quant.prequantized",
    "load_quantized": "fx_fp8.quant.checkpoint",
    "save_quantized": "fx_fp8.quant.checkpoint",
    "reachable_tensor_bytes": "fx_fp8.quant.quantized_linear",
    "refresh_weights": "fx_fp8.quant.quantized_linear",
    "compile_pipeline": "fx_fp8.pipeline.compile",
    "restore_pipeline": "fx_fp8.pipeline.restore",
    "pipeline_state": "fx_fp8.pipeline.state",
    "publish_steps": "fx_fp8.pipeline.step_publishing",
    "summary": "fx_fp8.pipeline.summary",
    "tune": "fx_fp8.tuning",  # measuring every FP8 decision on this GPU
}

if TYPE_CHECKING:  # what the names are, for type checkers and IDEs (no import at run time)
    from fx_fp8.config.attention import AttentionQuantConfig
    from fx_fp8.config.fp8_config import FP8Config
    from fx_fp8.config.quantization import QuantizationConfig
    from fx_fp8.config.selectors import parse_selector
    from fx_fp8.pipeline.compile import compile_pipeline
    from fx_fp8.pipeline.diffusers_quantizer import DiffusersConfig
    from fx_fp8.pipeline.restore import restore_pipeline
    from fx_fp8.pipeline.state import pipeline_state
    from fx_fp8.pipeline.step_publishing import publish_steps
    from fx_fp8.pipeline.summary import summary
    from fx_fp8.quant.activation_scales import load_activation_scales, save_activation_scales
    from fx_fp8.quant.calibration import calibrate
    from fx_fp8.quant.checkpoint import load_quantized, save_quantized
    from fx_fp8.quant.prepare import prepare_model
    from fx_fp8.quant.prequantized import adopt_prequantized
    from fx_fp8.quant.quantized_linear import reachable_tensor_bytes, refresh_weights
    from fx_fp8.report import CompileReport, ReportEntry, clear_reports, get_reports
    from fx_fp8.steps import current_step, denoising_step, set_step
    from fx_fp8.tuning import tune


def __getattr__(name):
    if name in _LAZY:  # _LAZY[name] literally: the layer test reads which modules this may import
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    if name == "DiffusersConfig":  # needs diffusers: imported on first use only
        try:
            from fx_fp8.pipeline.diffusers_quantizer import DiffusersConfig
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] != "diffusers":
                raise
            raise ImportError(
                f"fx_fp8.DiffusersConfig needs diffusers and accelerate ({e}): install them, e.g. the [diffusers] extra"
            ) from e
        return DiffusersConfig
    raise AttributeError(f"module 'fx_fp8' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | {"DiffusersConfig"})


__all__ = [
    "AttentionQuantConfig",
    "CompileReport",
    "FP8Config",
    "QuantizationConfig",
    "ReportEntry",
    "adopt_prequantized",
    "calibrate",
    "clear_reports",
    "compile_pipeline",
    "current_step",
    "denoising_step",
    "get_reports",
    "load_activation_scales",
    "load_quantized",
    "parse_selector",
    "pipeline_state",
    "prepare_model",
    "publish_steps",
    "reachable_tensor_bytes",
    "refresh_weights",
    "restore_pipeline",
    "save_activation_scales",
    "save_quantized",
    "set_step",
    "summary",
    "tune",
]
