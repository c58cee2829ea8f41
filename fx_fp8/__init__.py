"""fx_fp8: FP8 attention and FP8 linears for diffusion transformers, as a torch.compile backend.

    torch.compile(transformer, backend="fp8")        # or "fp8_npu"
    torch.compile(transformer, backend="fp8", options={"diffusion_kv_cache_skip_steps": "0,1"})
"""
from fx_fp8.ops import library  # noqa: F401  registers torch.ops.fx_fp8.*
from fx_fp8.quant.activation_scales import load_activation_scales, save_activation_scales
from fx_fp8.quant.calibration import calibrate
from fx_fp8.config.attention import AttentionQuantConfig
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.config.quantization import QuantizationConfig
from fx_fp8.report import CompileReport, ReportEntry, clear_reports, get_reports
from fx_fp8.config.selectors import parse_selector
from fx_fp8.steps import current_step, denoising_step, set_step
from fx_fp8.quant.prepare import prepare_model
from fx_fp8.quant.prequantized import adopt_prequantized
from fx_fp8.quant.checkpoint import load_quantized, save_quantized
from fx_fp8.quant.quantized_linear import reachable_tensor_bytes, refresh_weights
from fx_fp8.pipeline.compile import compile_pipeline  # (diffusers: lazily)
from fx_fp8.pipeline.restore import restore_pipeline
from fx_fp8.pipeline.state import pipeline_state
from fx_fp8.pipeline.step_publishing import publish_steps
from fx_fp8.pipeline.diffusers_registration import install as _install_diffusers_quantizer

_install_diffusers_quantizer()  # fx_fp8 joins diffusers' quantizer mappings (now or when diffusers loads them)

__version__ = "0.1.0"


def __getattr__(name):
    if name == "tune":  # fx_fp8.tuning: measuring every FP8 decision on this GPU
        from fx_fp8.tuning import tune

        return tune
    if name == "DiffusersConfig":  # needs diffusers: imported on first use only
        try:
            from fx_fp8.pipeline.diffusers_quantizer import DiffusersConfig
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] != "diffusers":
                raise
            raise ImportError(f"fx_fp8.DiffusersConfig needs diffusers and accelerate ({e}): install them, e.g. "
                              "the [diffusers] extra") from e
        return DiffusersConfig
    raise AttributeError(f"module 'fx_fp8' has no attribute {name!r}")


__all__ = [
    "AttentionQuantConfig", "CompileReport", "FP8Config", "QuantizationConfig", "ReportEntry",
    "adopt_prequantized", "calibrate", "clear_reports", "compile_pipeline", "current_step", "denoising_step", "get_reports",
    "load_activation_scales", "load_quantized", "parse_selector", "pipeline_state", "prepare_model", "publish_steps",
    "reachable_tensor_bytes", "refresh_weights", "restore_pipeline", "save_activation_scales", "save_quantized", "set_step",
]
