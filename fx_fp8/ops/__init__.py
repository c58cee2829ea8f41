"""Custom ops (torch.library) and their lowerings: reference (CPU), cuda, npu."""
from fx_fp8.ops import library  # noqa: F401  registers torch.ops.fx_fp8.*
from fx_fp8.ops.lowering import Lowering, get_lowering, resolve_lowering_name

__all__ = ["Lowering", "get_lowering", "resolve_lowering_name"]
