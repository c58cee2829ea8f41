"""A second, independent reading of the vendor sources behind the NPU simulators, rule by rule, for
the two contracts the FP8 attention path depends on. Written from the sources cited per rule, not
from the simulators (it imports nothing from them) nor from fx_fp8 (it imports nothing from it):
the tests compare the simulators' accept / refuse decisions and results with it
(tests/ops/test_npu_vendor_rules.py).

Sources (stored copies read through the search tool; /work/shared/reference/torch_npu.md):

* [BQ-ACLNN] hicann/ops-nn quant/dynamic_block_quant/docs/aclnnDynamicBlockQuant.md (commit
  1297f177): CANN's DynamicBlockQuant, the kernel behind torch_npu.npu_dynamic_block_quant.
* [BQ-TORCH] Ascend/op-plugin docs/context/torch_npu-npu_dynamic_block_quant.md (commit c12b6362):
  the torch_npu signature `npu_dynamic_block_quant(x, *, min_scale=0.0, round_mode="rint",
  dst_type=1, row_block_size=1, col_block_size=128) -> (y, scale)` and its example (scale 0.0063
  for a row whose max is 0.8: the scale is input_max / 127, a dequantization scale).
* [SD] MindIE-SD 3.1.0, mindiesd/quantization/layer.py `FP8RotateQuantFA` (as summarised in
  /work/shared/reference/torch_npu.md, "Attention"): per-block FP8 attention, query/key/value
  quant modes 7/7/7, BNSD, block scales of 128 (Q) and 256 (K/V) rows, through
  `torch.ops.mindiesd.fused_infer_attention_score_v2` after `fa_block_quant_preprocess`.
* [FIA] torch_npu.md "Attention": `softmax_scale` defaults to 1.0 ("pass 1/sqrt(head_dim)
  yourself"); FP8 attention outputs fp16 / bf16; P quantized with the P scale; and CANN's V5 doc's
  per-block case as quoted there: fp32 dequant scales [B, N, ceil(S / block), 1], head dim <= 128,
  no mask, no softmax_lse, P scale within [1, 448] (e4m3's largest value).
"""

from __future__ import annotations

import math

import torch

E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value (OCP FP8 spec)
INT8_MAX = 127.0
ATTENTION_DTYPES = (torch.float16, torch.bfloat16)

# -- npu_dynamic_block_quant -------------------------------------------------------------------------
#: rule -> the source sentence it follows
BLOCK_QUANT_RULES = {
    "input-dtype": "[BQ-ACLNN] x: FLOAT16, BFLOAT16, FLOAT32",
    "x-rank": "[BQ-ACLNN] x: 2-3 dims (shape 维度 2-3; 950: x, yOut, scaleOut 2 or 3 dims)",
    "dst-type": "[BQ-TORCH] dst_type 1 = int8; [BQ-ACLNN] 950: INT8, HIFLOAT8, FLOAT8_E5M2, FLOAT8_E4M3FN",
    "chip": "[BQ-ACLNN] A2/A3: dstType INT8 only (FP8 output is Ascend 950 only)",
    "block-size": "[BQ-ACLNN] rowBlockSize 1, 64, 128, 256, 512; colBlockSize 64, 128, 192, 256; "
    "A2/A3: rowBlockSize 1, colBlockSize 128 only",
    "round-mode": "[BQ-ACLNN] INT8 / FLOAT8 outputs: round mode rint",
}
ROW_BLOCKS_950, COL_BLOCKS_950 = (1, 64, 128, 256, 512), (64, 128, 192, 256)
ROW_BLOCKS_A2, COL_BLOCKS_A2 = (1,), (128,)


def block_quant_violations(
    shape, dtype, *, fp8_output: bool, chip_950: bool, row_block: int, col_block: int, round_mode: str = "rint"
) -> set:
    """The rules of BLOCK_QUANT_RULES an npu_dynamic_block_quant call breaks."""
    out = set()
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        out.add("input-dtype")
    if len(shape) not in (2, 3):
        out.add("x-rank")
    if fp8_output and not chip_950:
        out.add("chip")
    rows, cols = (ROW_BLOCKS_950, COL_BLOCKS_950) if chip_950 else (ROW_BLOCKS_A2, COL_BLOCKS_A2)
    if row_block not in rows or col_block not in cols:
        out.add("block-size")
    if round_mode != "rint":
        out.add("round-mode")
    return out


def block_quant(x: torch.Tensor, *, row_block: int, col_block: int, fp8_output: bool):
    """[BQ-ACLNN]'s formula, block by block with plain loops: scale = max|x| / DTYPE_MAX over the block
    (the dequantization scale, as [BQ-TORCH]'s example shows), y = cast(x / scale); scale's shape
    [(B,) ceil(M / row_block), ceil(N / col_block)]."""
    top = E4M3_MAX if fp8_output else INT8_MAX
    batched = x.dim() == 3
    xs = x.float() if batched else x.float().unsqueeze(0)
    b, m, n = xs.shape
    mb, nb = math.ceil(m / row_block), math.ceil(n / col_block)
    scale = torch.empty(b, mb, nb)
    y = torch.empty(b, m, n)
    for i in range(b):
        for r in range(mb):
            for c in range(nb):
                block = xs[i, r * row_block : (r + 1) * row_block, c * col_block : (c + 1) * col_block]
                s = float(block.abs().max()) / top
                scale[i, r, c] = s
                q = block / s if s > 0 else block * 0
                y[i, r * row_block : (r + 1) * row_block, c * col_block : (c + 1) * col_block] = (
                    q if fp8_output else torch.round(q).clamp(-INT8_MAX, INT8_MAX)
                )
    y = y.to(torch.float8_e4m3fn) if fp8_output else y.to(torch.int8)
    return (y, scale) if batched else (y[0], scale[0])


# -- the per-block FP8 attention call (MindIE-SD's kernel) ---------------------------------------------
FIA_RULES = {
    "qkv-dtype": "[SD] query/key/value float8_e4m3fn (the per-block FP8 case)",
    "quant-mode": "[SD] query/key/value_quant_mode 7/7/7",
    "layout": "[SD] BNSD (BSND the transposed form)",
    "head-dim": "[FIA] head dim <= 128, equal for query and key",
    "dequant-scale": "[SD] + [FIA] fp32 scales [B, N, ceil(S / 128), 1] for Q and [B, N_kv, ceil(S / 256), 1] "
    "for K and V",
    "p-scale": "[FIA] the P scale: an fp32 scalar within [1, 448]",
    "mask": "[FIA] the per-block case takes no attention mask",
    "lse": "[FIA] the per-block case returns no softmax_lse",
    "out-dtype": "[FIA] FP8 attention outputs float16 or bfloat16",
    "softmax-scale": "[FIA] softmax_scale defaults to 1.0: pass 1/sqrt(head_dim), a positive float",
}
Q_ROWS, KV_ROWS = 128, 256


def fia_block_violations(query, key, value, kw: dict, *, p_scale_arg: str = "quant_scale1") -> set:
    """The rules of FIA_RULES a per-block FP8 call of MindIE-SD's fused_infer_attention_score_v2 breaks
    (`kw`: every argument but query/key/value; the P scale under `p_scale_arg`)."""
    out = set()
    if not all(t.dtype == torch.float8_e4m3fn for t in (query, key, value)):
        out.add("qkv-dtype")
    if (kw.get("query_quant_mode"), kw.get("key_quant_mode"), kw.get("value_quant_mode")) != (7, 7, 7):
        out.add("quant-mode")
    layout = kw.get("input_layout", "BSH")
    if layout not in ("BNSD", "BSND") or query.dim() != 4:
        out.add("layout")
        return out
    heads, seq = (1, 2) if layout == "BNSD" else (2, 1)
    b, n_q, s_q, d = query.shape[0], query.shape[heads], query.shape[seq], query.shape[3]
    n_kv, s_k = key.shape[heads], key.shape[seq]
    if not (1 <= d <= 128 and key.shape[3] == d):
        out.add("head-dim")
    for name, rows, n, s in (
        ("dequant_scale_query", Q_ROWS, n_q, s_q),
        ("dequant_scale_key", KV_ROWS, n_kv, s_k),
        ("dequant_scale_value", KV_ROWS, n_kv, s_k),
    ):
        t = kw.get(name)
        if not (
            isinstance(t, torch.Tensor)
            and t.dtype == torch.float32
            and tuple(t.shape) == (b, n, math.ceil(s / rows), 1)
        ):
            out.add("dequant-scale")
    p = kw.get(p_scale_arg)
    if not (
        isinstance(p, torch.Tensor) and p.dtype == torch.float32 and p.numel() == 1 and 1.0 <= float(p) <= E4M3_MAX
    ):
        out.add("p-scale")
    if kw.get("atten_mask") is not None:
        out.add("mask")
    if kw.get("return_softmax_lse"):
        out.add("lse")
    if kw.get("out_dtype") not in ATTENTION_DTYPES:
        out.add("out-dtype")
    scale = kw.get("softmax_scale", 1.0)
    if not (isinstance(scale, float) and math.isfinite(scale) and scale > 0 and not (scale == 1.0 and d != 1)):
        out.add("softmax-scale")
    return out
