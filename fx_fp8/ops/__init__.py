"""Custom ops (fx_fp8.ops.library, registered when fx_fp8 is imported), the FP8/INT8
numerics every lowering shares (quant), and the lowerings: reference (CPU), cuda, npu."""
