"""SHA-256 digests of the reference lowering's FP8 / INT8 linear outputs, to compare bits across
torch versions (CI runs it in each torch it tests and requires equal digests) or devices.

    python benchmarks/reference_digest.py                 # one line per case, then the torch version
    python benchmarks/reference_digest.py --device cuda   # the same numbers from CUDA tensors

Inputs come from integer arithmetic and one correctly rounded division (no RNG, no libm), so
they are the same bits on every torch. The cases: ReferenceLowering.scaled_mm (quantization of
activations and weights, the GEMM, the rescale and the bias) per scale layout. With --compiled,
also a torch.compile'd model, whose surrounding code Inductor generates (not fx_fp8's to fix).
"""

from __future__ import annotations

import argparse
import hashlib

import torch

from fx_fp8.ops import quant
from fx_fp8.ops.lowering import get_lowering

#: (name, method, activation granularity, weight granularity, weight block, output dtype)
GEMM_CASES = [
    ("fp8 token x channel -> bf16", "fp8", "token", "channel", None, torch.bfloat16),
    ("fp8 token x channel -> fp32", "fp8", "token", "channel", None, torch.float32),
    ("fp8 tensor x tensor -> bf16", "fp8", "tensor", "tensor", None, torch.bfloat16),
    ("fp8 token x tensor -> fp32", "fp8", "token", "tensor", None, torch.float32),
    ("fp8 group x block 128 -> bf16", "fp8", "group", "block", (128, 128), torch.bfloat16),
    ("fp8 group x block 128 -> fp32", "fp8", "group", "block", (128, 128), torch.float32),
    ("int8 token x channel -> bf16", "int8", "token", "channel", None, torch.bfloat16),
    ("int8 group x block 1x32 -> fp32", "int8", "group", "block", (1, 32), torch.float32),
]
M, K, N = 77, 320, 200  # K: two full 128-column groups and a partial one; N: a partial 128-row block


def pattern(rows: int, cols: int, salt: int, device) -> torch.Tensor:
    """A fixed fp32 [rows, cols] matrix with a wide range of magnitudes, made on the CPU from
    integers, exact powers of two and one correctly rounded division, then moved to `device`."""
    i = torch.arange(rows, dtype=torch.int64).reshape(-1, 1)
    j = torch.arange(cols, dtype=torch.int64).reshape(1, -1)
    h = (i * 7919 + j * 104729 + salt * 1299709) % 1000003
    value = (h % 2001 - 1000).float()
    power = torch.tensor([2.0**e for e in range(-4, 5)])[h // 2001 % 9]  # 2**-4 .. 2**4
    return (value * power / 997.0).to(device)


def digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16]


def gemm_output(case, device) -> torch.Tensor:
    _, method, act, wgran, block, out_dtype = case
    x, w = pattern(M, K, 1, device), pattern(N, K, 2, device) / 16
    bias = pattern(1, N, 3, device).reshape(N)
    xq, xs = quant.quantize_activation(x, act, method, block[1] if block else None)
    wq, ws = quant.quantize_weight(w, wgran, block, method=method)
    return get_lowering("reference").scaled_mm(
        xq, xs, wq, ws, bias, method=method, weight_granularity=wgran, weight_block=block, out_dtype=out_dtype
    )


def compiled_output(device) -> torch.Tensor:
    """`torch.compile(model, backend="fp8")` of two bf16 linears with a GELU between (the
    reference lowering on CPU): FP8 linears inside Inductor-generated code."""
    import torch.nn as nn

    model = nn.Sequential(nn.Linear(K, 256), nn.GELU(), nn.Linear(256, 128)).to(device, torch.bfloat16)
    with torch.no_grad():
        for salt, layer in enumerate((model[0], model[2]), start=4):
            out_f, in_f = layer.weight.shape
            layer.weight.copy_(pattern(out_f, in_f, salt, device) / 16)
            layer.bias.copy_(pattern(1, out_f, salt + 10, device).reshape(out_f))
        x = pattern(80, K, 7, device).reshape(2, 40, K).bfloat16()
        return torch.compile(model, backend="fp8", options={"lowering": "reference"})(x)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compiled", action="store_true", help="also digest a torch.compile'd two-linear model")
    args = ap.parse_args(argv)
    for case in GEMM_CASES:
        print(f"{case[0]:34s} {digest(gemm_output(case, args.device))}")
    if args.compiled:
        print(f"{'compiled 2 linears, bf16':34s} {digest(compiled_output(args.device))}")
    print(f"torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
