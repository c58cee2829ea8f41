"""An emulation of Hopper's FP8 tensor-core accumulation, for Triton's CPU interpreter.

The interpreter computes `tl.dot` as an exact numpy matmul plus the accumulator, so it cannot
show what an H100 / H200 does to an FP8 product: the wgmma adds its products and its C input
with about 14 bits of precision, truncating (DeepSeek-V3's report measured that on an H800).
`emulated_dot` models it as one effective step per k-chunk of 32 (one m64nNk32 wgmma):

    acc = C;  for each 32 columns of the inner dimension:  acc = trunc(acc + A[:, chunk] @ B[chunk, :])

with trunc cutting the running sum toward zero to `bits` significant bits. The effective width is
calibrated to the H200 measurement of fx_fp8's old kernel (P @ V accumulated in place over every
key tile: 3.2 % error at 4608 keys, 11.5 % at 16384; B1 H24 D128, Q, K ~ N(0, 1), V ~ N(0.5, 1)):
11 bits a chunk gives the same linear growth and size (tests/ops/test_attention_accumulation.py). It
lumps the hardware's finer steps together: truncating to 14 bits every 4 products, closer to the
published figure, gives the same growth about 25 % lower.

`install(bits, chunk)` patches the interpreter's dot builder for FP8 operands with an fp32
accumulator (the case the hardware truncates); other dots stay exact.
"""

from __future__ import annotations

import numpy as np

#: effective significant bits a k-chunk keeps (calibrated, see the module docstring)
BITS = 11
#: inner-dimension columns of one FP8 wgmma (m64nNk32)
CHUNK = 32


def truncate(x: np.ndarray, bits: int) -> np.ndarray:
    """x rounded toward zero to `bits` significant bits (float64 in, float64 out; 0 stays 0)."""
    mant, exp = np.frexp(np.asarray(x, dtype=np.float64))  # x = mant * 2**exp, |mant| in [0.5, 1)
    scale = float(2**bits)
    return np.ldexp(np.trunc(mant * scale) / scale, exp)


def emulated_dot(a: np.ndarray, b: np.ndarray, c: np.ndarray, bits: int = BITS, chunk: int = CHUNK) -> np.ndarray:
    """a @ b + c with the accumulator truncated to `bits` bits after every `chunk` inner columns,
    the C input entering the first chunk's sum (as the wgmma takes it). float32 result."""
    acc = np.asarray(c, dtype=np.float64)
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    for k0 in range(0, a64.shape[-1], chunk):
        acc = truncate(acc + a64[..., k0 : k0 + chunk] @ b64[..., k0 : k0 + chunk, :], bits)
    return acc.astype(np.float32)


def install(bits: int = BITS, chunk: int = CHUNK) -> None:
    """Make the Triton interpreter's FP8 x FP8 -> fp32 dots use `emulated_dot` (call it in a
    process that runs with TRITON_INTERPRET=1, before launching kernels)."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    exact = builder.create_dot

    def create_dot(a, b, d, input_precision, max_num_imprecise_acc):
        fp8 = all(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b))
        if not fp8 or d.dtype.scalar != tl.float32:
            return exact(a, b, d, input_precision, max_num_imprecise_acc)
        a32 = interpreter._convert_float(a.data, a.dtype, tl.float16, None).view(np.float16)
        b32 = interpreter._convert_float(b.data, b.dtype, tl.float16, None).view(np.float16)
        return interpreter.TensorHandle(emulated_dot(a32, b32, d.data, bits, chunk), tl.float32)

    builder.create_dot = create_dot
