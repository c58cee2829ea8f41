"""FX graph passes (installed as `fx_fp8.passes`): one class per pass, a manager, filters."""
from fx_fp8.passes.attention import FP8AttentionPass
from fx_fp8.passes.base import CompileContext, FXPass
from fx_fp8.passes.linear import FP8LinearPass
from fx_fp8.passes.manager import PassManager, default_passes
from fx_fp8.passes.prequantized import PrequantizedLinearPass

__all__ = ["CompileContext", "FXPass", "FP8AttentionPass", "FP8LinearPass", "PassManager", "PrequantizedLinearPass",
           "default_passes"]
