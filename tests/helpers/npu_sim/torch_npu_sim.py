"""A stand-in `torch_npu` that checks every argument against the published op contracts.

Written from /work/shared/reference/torch_npu.md, the op-plugin docs and source
(docs/zh/custom_APIs/torch_npu/*.md, op_plugin/ops/opapi/FusedInferAttentionScoreV2KernelNpuOpApi.cpp,
op_plugin/config/op_plugin_functions.yaml) and the CANN op docs
(ops-transformer attention/fused_infer_attention_score/docs/aclnnFusedInferAttentionScoreV5.md,
ops-nn aclnnDynamicMxQuant.md / aclnnDynamicBlockQuant.md), never from fx_fp8's
code: it imports nothing from fx_fp8, so a wrong constant in the library cannot
be wrong here too. Each op validates its arguments, raises SimulatedContractError
naming the violated rule, then computes the result with plain float32 CPU math.

Scope: the cases fx_fp8 targets.
* npu_fused_infer_attention_score_v2, FP8 e4m3 query/key/value on Ascend 950:
  - per-block full quant, query/key/value_quant_mode 7: fp32 dequant scales
    [B, N, ceil(S/128 or 256), 1], BNSD or BSND, head dim 1-128, no mask, no
    softmax_lse, P scale in quant_scale_p within [1, 448] (V5 doc up to
    CANN 9.0.0-beta.2). CANN 9.0.0-rc.1 and later refuse mode 7 ("传入0-6之外的
    其他值会执行异常"; ops-transformer 17e3f5b9d "per-block场景下线"): the
    `cann_version` knob decides.
  - MXFP8 full quant, modes 6/6/8 (non-paged TND from CANN 9.1.0.pre): e8m0 scales
    (uint8 data + dequant_scale_*_dtype=float8_e8m0fnu) of shapes Q (T, N, D/64, 2),
    K (T, N, D/64, 2), V (T/64, N, D, 2), cumulative actual_seq_qlen/kvlen,
    head dim 64 or 128, P scale in quant_scale_p within [1, 448], no mask (sparse_mode 0),
    softmax_lse (T, N, 1).
* npu_dynamic_quant (per-token, int8 everywhere, FP8 on 950), npu_quant_matmul
  (int8 x int8 per the A2/A3 dtype table; FP8 x FP8 on 950), npu_dynamic_block_quant,
  npu_dynamic_mx_quant (scale_alg 0, block 32).
Anything else raises SimulatedContractError with rule "not-simulated".

The module object is installed into sys.modules["torch_npu"] only inside tests
(`installed()`); it never exists on disk under the name torch_npu.

The source of each rule, by rule name: npu_sim/sources.py (checked complete by a test).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import math
import re
import sys
import types
from collections import Counter

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
INT8_MAX = 127.0
# torch_npu's pseudo dtypes are plain ints (ACL enum + 256), not torch.dtype
HIFLOAT8, FLOAT8_E5M2, FLOAT8_E4M3FN, FLOAT8_E8M0FNU, FLOAT4_E2M1FN_X2 = 290, 291, 292, 293, 296

Q_BLOCK, KV_BLOCK = 128, 256  # row blocks of the per-block FP8 attention case
BLOCK_MODES, MX_MODES = (7, 7, 7), (6, 6, 8)
MX_BLOCK = 32
OUT_DTYPES = (torch.float16, torch.bfloat16)
MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
MAX_K = 65535
INT_MAX = 2147483647

# CANN releases: per-block (mode 7) documented until 9.0.0-beta.2 and refused from 9.0.0-rc.1;
# non-paged MXFP8 attention (6/6/8, TND) from 9.1.0.pre (9.1.0-beta.3: paged KV only)
MODE7_REFUSED_FROM = (9, 0, 0, 2, 1)
MXFP8_FROM = (9, 1, 0, 3, 0)
CURRENT_CANN = "9.1.0"

# torch_npu.npu.get_soc_version() by chip (MindIE-SD's get_platform: 220-225 A2, 250-255 A3, 260 A5)
SOC_VERSIONS = {
    "Ascend910B1": 220,
    "Ascend910B2": 221,
    "Ascend910B2C": 222,
    "Ascend910B3": 223,
    "Ascend910B4": 224,
    "Ascend910B4-1": 225,
    "Ascend910_9391": 250,
    "Ascend910_9392": 251,
    "Ascend910_9381": 252,
    "Ascend910_9382": 253,
    "Ascend910_9372": 254,
    "Ascend910_9362": 255,
    "Ascend950PR": 260,
    "Ascend950DT": 260,
}


class SimulatedContractError(RuntimeError):
    """An argument the real op would reject (or silently misread); `rule` names the rule."""

    def __init__(self, op: str, rule: str, detail: str):
        self.op, self.rule = op, rule
        super().__init__(f"{op}: contract rule [{rule}] violated: {detail}")


def _is_fp8_chip(name: str) -> bool:
    return "950" in name


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def cann_key(text: str):
    """Comparable key of a CANN version string ("9.0.0-beta.2", "8.3.RC1", "9.1.0"); None if unreadable."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?(?:[.\-]?([A-Za-z]+)\.?(\d*))?", text or "")
    if not m:
        return None
    stage = (m.group(4) or "").lower()
    rank = {"alpha": 0, "beta": 1, "rc": 2, "pre": 3, "": 4}.get(stage)  # "9.1.0.pre": after the betas
    if rank is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0), rank, int(m.group(5) or 0)


class _Checker:
    def __init__(self, op: str):
        self.op = op

    def fail(self, rule: str, detail: str):
        raise SimulatedContractError(self.op, rule, detail)

    def require(self, cond: bool, rule: str, detail: str):
        if not cond:
            self.fail(rule, detail)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _e8m0_to_float(b: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones(b.shape), b.view(torch.uint8).to(torch.int32) - 127)


# -- npu_fused_infer_attention_score_v2 ------------------------------------------------
def _check_block_scale(c: _Checker, name: str, t, expected_shape: tuple, device):
    c.require(t is not None, "dequant-scale-missing", f"{name} is required for FP8 inputs (quant mode 7)")
    c.require(isinstance(t, torch.Tensor), "dequant-scale-dtype", f"{name} must be a tensor, got {type(t).__name__}")
    c.require(t.dtype == torch.float32, "dequant-scale-dtype", f"{name} must be float32, got {t.dtype}")
    c.require(
        tuple(t.shape) == expected_shape,
        "dequant-scale-shape",
        f"{name} must have shape [B, N, ceil(S/block), 1] = {list(expected_shape)}, got {list(t.shape)}",
    )
    c.require(t.is_contiguous(), "dequant-scale-shape", f"{name} must be contiguous")
    c.require(t.device == device, "device", f"{name} on {t.device}, query on {device}")
    c.require(
        bool(torch.isfinite(t).all()) and bool((t > 0).all()), "dequant-scale-value", f"{name} must be finite and > 0"
    )


def _rows(scale: torch.Tensor, block: int, s: int) -> torch.Tensor:
    """[B, N, nblk, 1] block scales -> [B, N, S, 1] per-row scales."""
    return scale.repeat_interleave(block, dim=2)[:, :, :s]


def _p_scale(c: _Checker, quant_scale_p, low: float) -> float:
    c.require(
        quant_scale_p is not None,
        "quant-scale-p-missing",
        "quant_scale_p absent: the kernel then quantizes P with an undocumented default scale (not simulated)",
    )
    c.require(
        isinstance(quant_scale_p, torch.Tensor) and quant_scale_p.dtype == torch.float32 and quant_scale_p.numel() == 1,
        "quant-scale-p",
        f"quant_scale_p must be a 1-element float32 tensor, got {quant_scale_p!r}",
    )
    p = float(quant_scale_p.reshape(()))
    c.require(
        low <= p <= E4M3_MAX and (p > 0),
        "quant-scale-p",
        f"quant_scale_p={p}: outside the documented range [{low:g}, {E4M3_MAX:g}] for FP8 (P*quant_scale_p in e4m3)",
    )
    return p


def _check_common(c: _Checker, d: int, softmax_scale, out_dtype):
    c.require(
        isinstance(softmax_scale, (int, float))
        and not isinstance(softmax_scale, bool)
        and math.isfinite(softmax_scale)
        and softmax_scale > 0,
        "softmax-scale",
        f"softmax_scale must be a finite positive float, got {softmax_scale!r}",
    )
    c.require(
        not (softmax_scale == 1.0 and d != 1),
        "softmax-scale-default",
        f"softmax_scale=1.0 (the op's default) with head dim {d}: pass 1/sqrt(head_dim) or the model's scale",
    )
    c.require(
        out_dtype is not None, "out-dtype", "out_dtype is required for FP8 inputs (the op would default to float16)"
    )
    c.require(
        out_dtype in OUT_DTYPES, "out-dtype", f"out_dtype {out_dtype!r}: FP8 attention outputs float16 or bfloat16"
    )


def _softmax_pv(q, k, v, sq, sk, sv, softmax_scale, p_scale):
    """fp32 math of the fused kernels: scores from dequantized Q.K, P = exp(S - max) quantized
    as P * p_scale to e4m3, O = (Pq V) / (rowsum(P) * p_scale); returns (O, lse)."""
    scores = (q @ k.transpose(-1, -2)) * sq * sk.transpose(-1, -2) * softmax_scale
    m = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - m)
    row_sum = p.sum(dim=-1, keepdim=True)
    p_q = (p * p_scale).to(FP8).float()
    return (p_q @ (v * sv)) / (row_sum * p_scale), (m + torch.log(row_sum)).squeeze(-1)


def make_attention_op(sim):
    def npu_fused_infer_attention_score_v2(
        query,
        key,
        value,
        *,
        query_rope=None,
        key_rope=None,
        pse_shift=None,
        atten_mask=None,
        actual_seq_qlen=None,
        actual_seq_kvlen=None,
        block_table=None,
        dequant_scale_query=None,
        dequant_scale_key=None,
        dequant_offset_key=None,
        dequant_scale_value=None,
        dequant_offset_value=None,
        dequant_scale_key_rope=None,
        quant_scale_out=None,
        quant_offset_out=None,
        quant_scale_p=None,
        learnable_sink=None,
        num_query_heads=1,
        num_key_value_heads=0,
        softmax_scale=1.0,
        pre_tokens=INT_MAX,
        next_tokens=INT_MAX,
        input_layout="BSH",
        sparse_mode=0,
        block_size=0,
        query_quant_mode=0,
        key_quant_mode=0,
        value_quant_mode=0,
        inner_precise=0,
        return_softmax_lse=False,
        query_dtype=None,
        key_dtype=None,
        value_dtype=None,
        query_rope_dtype=None,
        key_rope_dtype=None,
        key_shared_prefix_dtype=None,
        value_shared_prefix_dtype=None,
        dequant_scale_query_dtype=None,
        dequant_scale_key_dtype=None,
        dequant_scale_value_dtype=None,
        dequant_scale_key_rope_dtype=None,
        out_dtype=None,
    ):
        op = "npu_fused_infer_attention_score_v2"
        c = _Checker(op)
        for name, t in (("query", query), ("key", key), ("value", value)):
            c.require(isinstance(t, torch.Tensor), "qkv-dtype", f"{name} must be a tensor")
        if query.dtype == torch.uint8 or query_dtype == HIFLOAT8:
            c.fail("not-simulated", "HiFloat8 (uint8 + query_dtype) inputs are not simulated")
        c.require(
            query.dtype == FP8 and key.dtype == FP8 and value.dtype == FP8,
            "qkv-dtype",
            f"the FP8 cases need float8_e4m3fn query/key/value, got {query.dtype}/{key.dtype}/{value.dtype}",
        )
        c.require(_is_fp8_chip(sim.chip), "chip", f"{sim.chip} has no FP8 attention kernel (Ascend 950 only)")
        for name, t in (("query", query), ("key", key), ("value", value)):
            c.require(
                t.is_contiguous(), "contiguous", f"{name} must be contiguous (the op reads {input_layout} memory order)"
            )
            c.require(t.device == query.device, "device", f"{name} on {t.device}, query on {query.device}")
        c.require(
            _is_int(num_query_heads) and num_query_heads > 0,
            "heads",
            f"num_query_heads must be a positive int, got {num_query_heads!r}",
        )
        c.require(
            _is_int(num_key_value_heads) and num_key_value_heads >= 0,
            "heads",
            f"num_key_value_heads must be an int >= 0, got {num_key_value_heads!r}",
        )
        common = dict(
            rope=(query_rope, key_rope, dequant_scale_key_rope),
            pse_shift=pse_shift,
            offsets=(dequant_offset_key, dequant_offset_value),
            postquant=(quant_scale_out, quant_offset_out),
            learnable_sink=learnable_sink,
            block_table=block_table,
        )
        given = sorted(
            k for k, v in common.items() if (any(x is not None for x in v) if isinstance(v, tuple) else v is not None)
        )
        c.require(not given, "unsupported-argument", f"{given} are not part of the FP8 full-quant cases simulated")
        c.require(block_size == 0, "unsupported-argument", f"block_size={block_size} (paged KV) is not simulated")
        modes = (query_quant_mode, key_quant_mode, value_quant_mode)
        kw = dict(
            actual_seq_qlen=actual_seq_qlen,
            actual_seq_kvlen=actual_seq_kvlen,
            atten_mask=atten_mask,
            dequant_scale_query=dequant_scale_query,
            dequant_scale_key=dequant_scale_key,
            dequant_scale_value=dequant_scale_value,
            quant_scale_p=quant_scale_p,
            num_query_heads=num_query_heads,
            num_key_value_heads=num_key_value_heads,
            softmax_scale=softmax_scale,
            input_layout=input_layout,
            sparse_mode=sparse_mode,
            inner_precise=inner_precise,
            return_softmax_lse=return_softmax_lse,
            dtypes=(query_dtype, key_dtype, value_dtype),
            scale_dtypes=(dequant_scale_query_dtype, dequant_scale_key_dtype, dequant_scale_value_dtype),
            out_dtype=out_dtype,
        )
        version = sim.cann_version
        key_v = cann_key(version)
        if modes == BLOCK_MODES:
            c.require(
                key_v is not None and key_v < MODE7_REFUSED_FROM,
                "quant-mode-refused",
                f"CANN {version or '(unknown)'} refuses query/key/value_quant_mode 7 (per-block FP8 full quant "
                "was taken offline in CANN 9.0.0-rc.1; modes outside 0-6 raise)",
            )
            out, lse = _block_case(sim, c, query, key, value, **kw)
        elif modes == MX_MODES:
            c.require(
                key_v is None or key_v >= MXFP8_FROM,
                "quant-mode-unsupported",
                f"CANN {version} has no non-paged MXFP8 fused attention (modes 6/6/8 with TND from 9.1.0.pre)",
            )
            out, lse = _mx_case(sim, c, query, key, value, **kw)
        else:
            c.fail(
                "quant-mode",
                f"query/key/value_quant_mode {modes}: FP8 full quant is {BLOCK_MODES} (per-block) "
                f"or {MX_MODES} (MXFP8) here",
            )
        sim.calls[op] += 1
        sim.last_kwargs[op] = dict(
            input_layout=input_layout,
            num_query_heads=num_query_heads,
            num_key_value_heads=num_key_value_heads,
            softmax_scale=softmax_scale,
            quant_scale_p=float(quant_scale_p.reshape(())),
            out_dtype=out_dtype,
            head_dim=query.shape[-1],
            modes=modes,
            return_softmax_lse=return_softmax_lse,
        )
        return out, lse

    return npu_fused_infer_attention_score_v2


def _block_case(
    sim,
    c,
    query,
    key,
    value,
    *,
    actual_seq_qlen,
    actual_seq_kvlen,
    atten_mask,
    dequant_scale_query,
    dequant_scale_key,
    dequant_scale_value,
    quant_scale_p,
    num_query_heads,
    num_key_value_heads,
    softmax_scale,
    input_layout,
    sparse_mode,
    inner_precise,
    return_softmax_lse,
    dtypes,
    scale_dtypes,
    out_dtype,
):
    """Per-block FP8 full quant (modes 7/7/7), as documented before CANN 9.0.0-rc.1 (also MindIE-SD's kernel)."""
    c.require(
        actual_seq_qlen is None and actual_seq_kvlen is None,
        "unsupported-argument",
        "actual_seq_qlen/kvlen are not simulated for the per-block case",
    )
    c.require(
        all(d is None for d in scale_dtypes),
        "unsupported-argument",
        "dequant_scale_*_dtype: the per-block case takes plain float32 scales",
    )
    c.require(atten_mask is None, "mask-unsupported", "the per-block FP8 case takes no attention mask (不支持Mask场景)")
    c.require(
        not return_softmax_lse,
        "lse-unsupported",
        "the per-block FP8 case returns no softmax_lse (不支持SoftmaxLSE场景)",
    )
    c.require(
        input_layout in ("BNSD", "BSND"),
        "layout",
        f"input_layout {input_layout!r}: BNSD or BSND simulated for the per-block case",
    )
    for name, t in (("query", query), ("key", key), ("value", value)):
        c.require(t.dim() == 4, "layout", f"{input_layout} needs 4-D {name}, got {t.dim()}-D")
    n_kv = num_key_value_heads or num_query_heads
    head_axis, seq_axis = (1, 2) if input_layout == "BNSD" else (2, 1)
    c.require(
        query.shape[head_axis] == num_query_heads,
        "layout-heads",
        f"{input_layout} query shape {list(query.shape)}: axis {head_axis} = {query.shape[head_axis]} "
        f"!= num_query_heads={num_query_heads}",
    )
    c.require(
        key.shape[head_axis] == n_kv,
        "layout-heads",
        f"{input_layout} key shape {list(key.shape)}: axis {head_axis} = {key.shape[head_axis]} "
        f"!= num_key_value_heads={n_kv}",
    )
    c.require(
        num_query_heads <= 256 and n_kv <= 256 and num_query_heads % n_kv == 0 and num_query_heads // n_kv <= 64,
        "heads",
        f"num_query_heads={num_query_heads}, num_key_value_heads={n_kv}: N <= 256, G <= 64",
    )
    c.require(tuple(key.shape) == tuple(value.shape), "kv-shape", f"key {list(key.shape)} != value {list(value.shape)}")
    b, d = query.shape[0], query.shape[3]
    s_q, s_k = query.shape[seq_axis], key.shape[seq_axis]
    c.require(key.shape[0] == b, "kv-shape", f"batch of key {key.shape[0]} != query {b}")
    c.require(key.shape[3] == d, "head-dim", f"key head dim {key.shape[3]} != query head dim {d}")
    c.require(1 <= d <= 128, "head-dim", f"head dim {d}: the per-block FP8 case takes 1-128")
    c.require(s_q >= 2, "query-length", "query length 1 enters the decode branch (no per-block FP8 case)")
    _check_block_scale(
        c, "dequant_scale_query", dequant_scale_query, (b, num_query_heads, _cdiv(s_q, Q_BLOCK), 1), query.device
    )
    _check_block_scale(c, "dequant_scale_key", dequant_scale_key, (b, n_kv, _cdiv(s_k, KV_BLOCK), 1), query.device)
    _check_block_scale(c, "dequant_scale_value", dequant_scale_value, (b, n_kv, _cdiv(s_k, KV_BLOCK), 1), query.device)
    p_scale = _p_scale(c, quant_scale_p, 1.0)
    _check_common(c, d, softmax_scale, out_dtype)
    c.require(sparse_mode == 0, "sparse-mode", f"sparse_mode={sparse_mode}: only 0 is simulated")
    c.require(
        inner_precise in (0, 1), "inner-precise", f"inner_precise={inner_precise}: the per-block case takes 0 or 1"
    )

    q, k, v = (t.float() for t in (query, key, value))
    if input_layout == "BSND":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    group = num_query_heads // n_kv
    sk = _rows(dequant_scale_key, KV_BLOCK, s_k).repeat_interleave(group, dim=1)
    sv = _rows(dequant_scale_value, KV_BLOCK, s_k).repeat_interleave(group, dim=1)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out, _ = _softmax_pv(q, k, v, _rows(dequant_scale_query, Q_BLOCK, s_q), sk, sv, softmax_scale, p_scale)
    if sim.pad_output_rows:  # some builds hand back a block-padded sequence axis: callers must trim
        pad = _cdiv(s_q, sim.pad_output_rows) * sim.pad_output_rows - s_q
        out = F.pad(out, (0, 0, 0, pad), value=float("nan"))
    if input_layout == "BSND":
        out = out.transpose(1, 2)
    return out.to(out_dtype).contiguous(), torch.zeros(1, dtype=torch.float32, device=query.device)


def _check_cumulative(c: _Checker, name: str, lens, total: int) -> list:
    c.require(lens is not None, "actual-seq", f"{name} is required for TND (cumulative lengths)")
    c.require(
        isinstance(lens, (list, tuple)) and all(_is_int(x) for x in lens) and len(lens) > 0,
        "actual-seq",
        f"{name} must be a list of host ints, got {lens!r}",
    )
    c.require(
        all(b >= a for a, b in zip([0, *lens], lens)) and lens[-1] == total,
        "actual-seq",
        f"{name}={list(lens)} must be non-decreasing cumulative lengths ending at T={total}",
    )
    return [0, *lens]


def _check_mx_scale(c: _Checker, name: str, t, dtype_arg, expected_shape: tuple, device):
    c.require(t is not None, "dequant-scale-missing", f"{name} is required for MXFP8 (modes 6/6/8)")
    c.require(
        dtype_arg == FLOAT8_E8M0FNU,
        "dequant-scale-dtype",
        f"{name}_dtype must be torch_npu.float8_e8m0fnu ({FLOAT8_E8M0FNU}), got {dtype_arg!r}",
    )
    c.require(
        isinstance(t, torch.Tensor) and t.dtype in (torch.uint8, torch.float8_e8m0fnu),
        "dequant-scale-dtype",
        f"{name} must hold e8m0 bytes (uint8), got {getattr(t, 'dtype', type(t).__name__)}",
    )
    c.require(
        tuple(t.shape) == expected_shape,
        "dequant-scale-shape",
        f"{name} must have shape {list(expected_shape)}, got {list(t.shape)}",
    )
    c.require(t.is_contiguous() and t.device == device, "dequant-scale-shape", f"{name} must be contiguous on {device}")


def _mx_rows(scale: torch.Tensor, n: int) -> torch.Tensor:
    """(..., nblk/2, 2) e8m0 pairs along the last axis -> (..., n) per-element fp32 scales."""
    s = _e8m0_to_float(scale).reshape(*scale.shape[:-2], -1)
    return s.repeat_interleave(MX_BLOCK, dim=-1)[..., :n]


def _mx_case(
    sim,
    c,
    query,
    key,
    value,
    *,
    actual_seq_qlen,
    actual_seq_kvlen,
    atten_mask,
    dequant_scale_query,
    dequant_scale_key,
    dequant_scale_value,
    quant_scale_p,
    num_query_heads,
    num_key_value_heads,
    softmax_scale,
    input_layout,
    sparse_mode,
    inner_precise,
    return_softmax_lse,
    dtypes,
    scale_dtypes,
    out_dtype,
):
    """MXFP8 full quant (modes 6/6/8): V5 doc "MxFP8全量化", TND, non-paged."""
    c.require(input_layout == "TND", "layout", f"input_layout {input_layout!r}: MXFP8 full quant supports TND only")
    for name, t in (("query", query), ("key", key), ("value", value)):
        c.require(t.dim() == 3, "layout", f"TND needs 3-D (T, N, D) {name}, got {t.dim()}-D")
    for name, dt in zip(("query_dtype", "key_dtype", "value_dtype"), dtypes):
        c.require(dt in (None, FP8, FLOAT8_E4M3FN), "qkv-dtype", f"{name}={dt!r}: float8_e4m3fn data")
    n_kv = num_key_value_heads or num_query_heads
    c.require(
        query.shape[1] == num_query_heads,
        "layout-heads",
        f"TND query shape {list(query.shape)}: axis 1 != num_query_heads={num_query_heads}",
    )
    c.require(
        key.shape[1] == n_kv and value.shape[1] == n_kv,
        "layout-heads",
        f"TND key shape {list(key.shape)}: axis 1 != num_key_value_heads={n_kv}",
    )
    c.require(num_query_heads % n_kv == 0, "heads", f"num_query_heads={num_query_heads} not a multiple of {n_kv}")
    c.require(tuple(key.shape) == tuple(value.shape), "kv-shape", f"key {list(key.shape)} != value {list(value.shape)}")
    t_q, d = query.shape[0], query.shape[2]
    t_k = key.shape[0]
    c.require(key.shape[2] == d, "head-dim", f"key head dim {key.shape[2]} != query head dim {d}")
    c.require(d in (64, 128), "head-dim", f"head dim {d}: MXFP8 TND takes 64 or 128")
    cq = _check_cumulative(c, "actual_seq_qlen", actual_seq_qlen, t_q)
    ck = _check_cumulative(c, "actual_seq_kvlen", actual_seq_kvlen, t_k)
    c.require(len(cq) == len(ck), "actual-seq", "actual_seq_qlen and actual_seq_kvlen describe different batch counts")
    _check_mx_scale(
        c,
        "dequant_scale_query",
        dequant_scale_query,
        scale_dtypes[0],
        (t_q, num_query_heads, _cdiv(d, 64), 2),
        query.device,
    )
    _check_mx_scale(
        c, "dequant_scale_key", dequant_scale_key, scale_dtypes[1], (t_k, n_kv, _cdiv(d, 64), 2), query.device
    )
    _check_mx_scale(
        c, "dequant_scale_value", dequant_scale_value, scale_dtypes[2], (_cdiv(t_k, 64), n_kv, d, 2), query.device
    )
    c.require(atten_mask is None, "mask-unsupported", "MXFP8 with sparse_mode 0 takes no attenMask")
    p_scale = _p_scale(c, quant_scale_p, 1.0)  # quantScale1 as pScale, range [1, 448]
    _check_common(c, d, softmax_scale, out_dtype)
    c.require(sparse_mode == 0, "sparse-mode", f"sparse_mode={sparse_mode}: only 0 is simulated")
    c.require(inner_precise in (0, 1, 2, 3), "inner-precise", f"inner_precise={inner_precise} not in 0..3")

    q = query.float() * _mx_rows(dequant_scale_query, d)
    k = key.float() * _mx_rows(dequant_scale_key, d)
    v_scale = _e8m0_to_float(dequant_scale_value).movedim(-1, 1).reshape(-1, n_kv, d)  # (T/32 padded, N, D)
    v = value.float() * v_scale.repeat_interleave(MX_BLOCK, dim=0)[:t_k]
    group = num_query_heads // n_kv
    out = torch.zeros(t_q, num_query_heads, d)
    lse = torch.zeros(t_q, num_query_heads, 1)
    for (q0, q1), (k0, k1) in zip(zip(cq, cq[1:]), zip(ck, ck[1:])):
        qb = q[q0:q1].transpose(0, 1)  # (N, Sq, D)
        kb = k[k0:k1].transpose(0, 1).repeat_interleave(group, dim=0)
        vb = v[k0:k1].transpose(0, 1).repeat_interleave(group, dim=0)
        one = torch.ones(1, 1)
        o, l = _softmax_pv(qb, kb, vb, one, one, one, softmax_scale, p_scale)
        out[q0:q1] = o.transpose(0, 1)
        lse[q0:q1] = l.transpose(0, 1).unsqueeze(-1)
    lse_out = lse if return_softmax_lse else torch.zeros(1)
    return out.to(out_dtype).to(query.device), lse_out.to(query.device)


# -- npu_dynamic_quant -------------------------------------------------------------------
def make_dynamic_quant_op(sim):
    def npu_dynamic_quant(
        input, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken", dst_type_max=0.0
    ):
        op = "npu_dynamic_quant"
        c = _Checker(op)
        c.require(isinstance(input, torch.Tensor), "input-dtype", "input must be a tensor")
        c.require(input.dtype in OUT_DTYPES, "input-dtype", f"input dtype {input.dtype}: float16/bfloat16 only")
        c.require(input.dim() > 1, "input-rank", f"input must have more than 1 dim, got {input.dim()}")
        c.require(
            not _is_int(dst_type),
            "dst-type",
            f"dst_type={dst_type!r} is an int pseudo dtype: FP8 e4m3 uses the native torch.float8_e4m3fn",
        )
        dst = torch.int8 if dst_type is None else dst_type
        c.require(dst in (torch.int8, FP8), "dst-type", f"dst_type {dst_type!r}: int8 or torch.float8_e4m3fn")
        if dst == FP8:
            c.require(_is_fp8_chip(sim.chip), "chip", f"{sim.chip} cannot quantize to FP8 (Ascend 950 only)")
        c.require(
            smooth_scales is None and group_index is None,
            "not-simulated",
            "smooth_scales/group_index are not simulated",
        )
        c.require(quant_mode == "pertoken", "quant-mode", f"quant_mode={quant_mode!r}: only 'pertoken' is simulated")
        c.require(dst_type_max == 0.0, "not-simulated", "dst_type_max is not simulated")
        top = E4M3_MAX if dst == FP8 else INT8_MAX
        x = input.float()
        scale = x.abs().amax(dim=-1) / top  # scale = rowMax(|x|) / DTYPE_MAX, y = round(x / scale)
        y = (x / scale.unsqueeze(-1)).clamp(-top, top)
        y = y.to(FP8) if dst == FP8 else torch.round(y).to(torch.int8)
        sim.calls[op] += 1
        return y, scale

    return npu_dynamic_quant


# -- npu_quant_matmul ----------------------------------------------------------------------
def make_quant_matmul_op(sim):
    def npu_quant_matmul(
        x1,
        x2,
        scale,
        *,
        offset=None,
        pertoken_scale=None,
        bias=None,
        output_dtype=None,
        x1_dtype=None,
        x2_dtype=None,
        pertoken_scale_dtype=None,
        scale_dtype=None,
        group_sizes=None,
        y_scale=None,
    ):
        op = "npu_quant_matmul"
        c = _Checker(op)
        c.require(isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor), "x-dtype", "x1 and x2 must be tensors")
        c.require(
            x1.dtype == x2.dtype and x1.dtype in (FP8, torch.int8),
            "x-dtype",
            f"x1/x2 dtypes {x1.dtype}/{x2.dtype}: both float8_e4m3fn (Ascend 950) or both int8",
        )
        int8 = x1.dtype == torch.int8
        if not int8:
            c.require(_is_fp8_chip(sim.chip), "chip", f"{sim.chip} has no FP8 matmul (Ascend 950 only)")
        extras = dict(
            offset=offset,
            x1_dtype=x1_dtype,
            x2_dtype=x2_dtype,
            pertoken_scale_dtype=pertoken_scale_dtype,
            scale_dtype=scale_dtype,
            group_sizes=group_sizes,
            y_scale=y_scale,
        )
        given = sorted(k for k, v in extras.items() if v is not None)
        c.require(not given, "unsupported-argument", f"{given} are not part of the per-token x per-channel case")
        c.require(2 <= x1.dim() <= 6, "x1-rank", f"x1 must have 2-6 dims, got {x1.dim()}")
        c.require(x2.dim() == 2, "not-simulated", f"only 2-D x2 (K, N) is simulated, got {x2.dim()}-D")
        k, n = x2.shape
        c.require(
            x1.shape[-1] == k,
            "k-mismatch",
            f"x1 {list(x1.shape)} @ x2 {list(x2.shape)}: x2 must be (K, N) with K = x1's last dim ({x1.shape[-1]})",
        )
        c.require(k <= MAX_K and n <= MAX_K, "k-limit", f"last dims must not exceed {MAX_K}")
        c.require(
            x2.is_contiguous() or x2.t().is_contiguous(),
            "x2-layout",
            "x2 must be contiguous (K, N) or the transpose of a contiguous (N, K) weight",
        )
        c.require(
            output_dtype is not None, "output-dtype", "output_dtype None means int8 output: pass float16/bfloat16"
        )
        c.require(output_dtype in OUT_DTYPES, "output-dtype", f"output_dtype {output_dtype!r}: float16 or bfloat16")
        # int8 (A2/A3 table): scale float32, or bfloat16 with bfloat16 output
        scale_ok = (torch.float32,) + ((torch.bfloat16,) if int8 and output_dtype == torch.bfloat16 else ())
        c.require(
            isinstance(scale, torch.Tensor) and scale.dtype in scale_ok,
            "scale-dtype",
            f"scale must be a {'/'.join(str(d) for d in scale_ok)} tensor, got {getattr(scale, 'dtype', type(scale).__name__)}",
        )
        c.require(
            scale.dim() == 1 and scale.shape[0] in (1, n),
            "scale-shape",
            f"scale must be 1-D (1,) or (N,) = ({n},), got {list(scale.shape)}",
        )
        m = math.prod(x1.shape[:-1])
        if int8 and output_dtype == torch.float16:
            c.require(
                pertoken_scale is not None,
                "pertoken-scale-missing",
                "int8 x int8 -> float16 needs pertoken_scale (A2/A3 dtype table)",
            )
        if pertoken_scale is not None:
            c.require(
                isinstance(pertoken_scale, torch.Tensor) and pertoken_scale.dtype == torch.float32,
                "pertoken-scale-dtype",
                f"pertoken_scale must be float32, got {getattr(pertoken_scale, 'dtype', None)}",
            )
            c.require(
                tuple(pertoken_scale.shape) == (m,),
                "pertoken-scale-shape",
                f"pertoken_scale must be 1-D (m,) = ({m},), got {list(pertoken_scale.shape)}",
            )
        if bias is not None:
            bias_ok = (
                (torch.int32, torch.bfloat16, torch.float32) if int8 else (torch.float32, torch.bfloat16, torch.float16)
            )
            c.require(
                isinstance(bias, torch.Tensor) and bias.dtype in bias_ok,
                "bias",
                f"bias dtype {getattr(bias, 'dtype', None)}: {'/'.join(str(d) for d in bias_ok)}",
            )
            c.require(tuple(bias.shape) == (n,), "bias", f"bias must be 1-D (N,) = ({n},), got {list(bias.shape)}")
        for name, t in (("x2", x2), ("scale", scale), ("pertoken_scale", pertoken_scale), ("bias", bias)):
            if t is not None:
                c.require(t.device == x1.device, "device", f"{name} on {t.device}, x1 on {x1.device}")

        if int8:
            acc = (x1.reshape(-1, k).to(torch.int64) @ x2.to(torch.int64)).float().reshape(*x1.shape[:-1], n)
        else:
            acc = x1.float() @ x2.float()
        out = acc * scale.float()
        if pertoken_scale is not None:
            out = out * pertoken_scale.reshape(*x1.shape[:-1], 1)
        if bias is not None:
            out = out + bias.float()
        sim.calls[op] += 1
        sim.last_kwargs[op] = dict(x_dtype=x1.dtype, output_dtype=output_dtype, bias_dtype=getattr(bias, "dtype", None))
        return out.to(output_dtype)

    return npu_quant_matmul


# -- npu_weight_quant_batchmatmul ----------------------------------------------------------
def make_weight_quant_matmul_op(sim):
    """The torch_npu API reference (A2/A3): x (M, K) fp16/bf16; weight int8 (or int4 packed in
    int32) (K, N), transposed views accepted; antiquant_scale fp16/bf16 in x's dtype, (N,) / (1, N)
    per channel or (1,) per tensor; bias fp16 / fp32 (N,); no quant_scale: output in x's dtype."""

    def npu_weight_quant_batchmatmul(
        x,
        weight,
        antiquant_scale,
        antiquant_offset=None,
        quant_scale=None,
        quant_offset=None,
        bias=None,
        antiquant_group_size=0,
        inner_precise=0,
    ):
        op = "npu_weight_quant_batchmatmul"
        c = _Checker(op)
        c.require(
            isinstance(x, torch.Tensor) and x.dtype in OUT_DTYPES,
            "x-dtype",
            f"x must be float16/bfloat16, got {getattr(x, 'dtype', None)}",
        )
        c.require(x.dim() == 2, "x-rank", f"x must be 2-D (M, K), got {x.dim()}-D")
        c.require(
            isinstance(weight, torch.Tensor) and weight.dtype in (torch.int8, torch.int32),
            "weight-dtype",
            f"weight must be int8 (or int4 packed in int32), got {getattr(weight, 'dtype', None)}",
        )
        c.require(weight.dtype == torch.int8, "not-simulated", "int4 weights are not simulated")
        c.require(weight.dim() == 2, "weight-rank", f"weight must be 2-D (K, N), got {weight.dim()}-D")
        k, n = weight.shape
        c.require(x.shape[-1] == k, "k-mismatch", f"x {list(x.shape)} @ weight {list(weight.shape)}: weight is (K, N)")
        c.require(
            isinstance(antiquant_scale, torch.Tensor) and antiquant_scale.dtype == x.dtype,
            "scale-dtype",
            f"antiquant_scale must be {x.dtype} (x's dtype), got {getattr(antiquant_scale, 'dtype', None)}",
        )
        g = antiquant_group_size
        if g:  # per group (A2/A3): g a multiple of 32 in [32, K - 1], scales (ceil(K / g), N)
            c.require(
                isinstance(g, int) and g % 32 == 0 and 32 <= g <= k - 1,
                "group-size",
                f"antiquant_group_size={g!r}: a multiple of 32 in [32, K-1] (K={k})",
            )
            c.require(
                tuple(antiquant_scale.shape) == (-(-k // g), n),
                "scale-shape",
                f"per-group antiquant_scale must be (ceil(K/g), N) = ({-(-k // g)}, {n}), "
                f"got {list(antiquant_scale.shape)}",
            )
        else:
            c.require(
                tuple(antiquant_scale.shape) in ((n,), (1, n), (1,)),
                "scale-shape",
                f"antiquant_scale must be (N,), (1, N) or (1,) with N={n}, got {list(antiquant_scale.shape)}",
            )
        given = sorted(
            k_
            for k_, v in dict(
                antiquant_offset=antiquant_offset, quant_scale=quant_scale, quant_offset=quant_offset
            ).items()
            if v is not None
        )
        c.require(not given, "unsupported-argument", f"{given} are not part of the symmetric case")
        if bias is not None:
            c.require(
                isinstance(bias, torch.Tensor) and bias.dtype in (torch.float16, torch.float32),
                "bias",
                f"bias dtype {getattr(bias, 'dtype', None)}: float16 or float32",
            )
            c.require(bias.dtype == torch.float32 or x.dtype == torch.float16, "bias", "bf16 x takes a float32 bias")
            c.require(
                tuple(bias.shape) in ((n,), (1, n)), "bias", f"bias must be (N,) = ({n},), got {list(bias.shape)}"
            )
        for name, t in (("weight", weight), ("antiquant_scale", antiquant_scale), ("bias", bias)):
            if t is not None:
                c.require(t.device == x.device, "device", f"{name} on {t.device}, x on {x.device}")
        scale = (
            antiquant_scale.float().repeat_interleave(g, 0)[:k] if g else antiquant_scale.float().reshape(1, -1)
        )  # the row of K each weight element reads
        out = x.float() @ (weight.float() * scale)
        if bias is not None:
            out = out + bias.float().reshape(1, -1)
        sim.calls[op] += 1
        sim.last_kwargs[op] = dict(
            x_dtype=x.dtype, weight_dtype=weight.dtype, bias_dtype=getattr(bias, "dtype", None), antiquant_group_size=g
        )
        return out.to(x.dtype)

    return npu_weight_quant_batchmatmul


# -- npu_dynamic_block_quant (aclnnDynamicBlockQuant) --------------------------------------
def make_dynamic_block_quant_op(sim):
    def npu_dynamic_block_quant(
        x, *, min_scale=0.0, round_mode="rint", dst_type=1, row_block_size=1, col_block_size=128
    ):
        op = "npu_dynamic_block_quant"
        c = _Checker(op)
        c.require(
            isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16, torch.float32),
            "input-dtype",
            f"x dtype {getattr(x, 'dtype', None)}: float16/bfloat16/float32",
        )
        c.require(x.dim() in (2, 3), "x-rank", f"x must be 2-D or 3-D, got {x.dim()}-D {list(x.shape)}")
        fp8_chip = _is_fp8_chip(sim.chip)
        if dst_type in (1, torch.int8):
            top, out_dtype = INT8_MAX, torch.int8
        elif dst_type in (FLOAT8_E4M3FN, FP8):
            c.require(fp8_chip, "chip", f"{sim.chip}: FP8 block quantization is Ascend 950 only")
            top, out_dtype = E4M3_MAX, FP8
        elif dst_type in (HIFLOAT8, FLOAT8_E5M2, torch.float8_e5m2):
            c.fail("not-simulated", f"dst_type {dst_type!r} is not simulated")
        else:
            c.fail("dst-type", f"dst_type {dst_type!r}: int8 or float8_e4m3fn (torch_npu.float8_e4m3fn)")
        rows, cols = ((1, 64, 128, 256, 512), (64, 128, 192, 256)) if fp8_chip else ((1,), (128,))
        c.require(row_block_size in rows, "block-size", f"row_block_size={row_block_size}: {sim.chip} takes {rows}")
        c.require(col_block_size in cols, "block-size", f"col_block_size={col_block_size}: {sim.chip} takes {cols}")
        c.require(round_mode == "rint", "round-mode", f"round_mode={round_mode!r}: rint")
        c.require(min_scale >= 0, "min-scale", f"min_scale={min_scale} must be >= 0")
        xf = x.float().reshape(-1, *x.shape[-2:])
        b, m, n = xf.shape
        nr, nc = _cdiv(m, row_block_size), _cdiv(n, col_block_size)
        blocks = F.pad(xf, (0, nc * col_block_size - n, 0, nr * row_block_size - m))
        blocks = blocks.reshape(b, nr, row_block_size, nc, col_block_size)
        amax = blocks.abs().amax(dim=(2, 4))
        scale = amax / top  # scaleOut = min(input_max / DTYPE_MAX, 1 / minScale); yOut = cast(x / scaleOut)
        if min_scale > 0:
            scale = torch.minimum(scale, torch.full_like(scale, 1 / min_scale))
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        y = (blocks / safe[:, :, None, :, None]).clamp(-top, top)
        y = y.to(FP8) if out_dtype == FP8 else torch.round(y).to(torch.int8)
        y = y.reshape(b, nr * row_block_size, nc * col_block_size)[:, :m, :n].reshape(x.shape)
        sim.calls[op] += 1
        return y.contiguous(), scale.reshape(*x.shape[:-2], nr, nc)

    return npu_dynamic_block_quant


# -- npu_dynamic_mx_quant (aclnnDynamicMxQuant) ----------------------------------------------
def make_dynamic_mx_quant_op(sim):
    def npu_dynamic_mx_quant(
        input,
        *,
        axis=-1,
        round_mode="rint",
        dst_type=FLOAT4_E2M1FN_X2,
        block_size=32,
        scale_alg=0,
        dst_type_max=0.0,
        max_low_bound=0.0,
    ):
        op = "npu_dynamic_mx_quant"
        c = _Checker(op)
        c.require(_is_fp8_chip(sim.chip), "chip", f"{sim.chip}: MX quantization is Ascend 950 only")
        c.require(
            isinstance(input, torch.Tensor) and input.dtype in (torch.float16, torch.bfloat16, torch.float32),
            "input-dtype",
            f"input dtype {getattr(input, 'dtype', None)}: float16/bfloat16/float32",
        )
        c.require(1 <= input.dim() <= 7, "input-rank", f"input must have 1-7 dims, got {input.dim()}")
        if dst_type not in (FP8, FLOAT8_E4M3FN):
            c.require(
                dst_type in (FLOAT4_E2M1FN_X2, FLOAT8_E5M2, torch.float8_e5m2),
                "dst-type",
                f"dst_type {dst_type!r}: float8_e4m3fn/e5m2 or float4_e2m1",
            )
            c.fail("not-simulated", f"dst_type {dst_type!r}: only float8_e4m3fn is simulated (the default is FP4)")
        c.require(_is_int(axis) and -input.dim() <= axis < input.dim(), "axis", f"axis={axis} out of range")
        c.require(round_mode == "rint", "round-mode", f"round_mode={round_mode!r}: FP8 destinations take rint only")
        c.require(block_size == MX_BLOCK, "not-simulated", f"block_size={block_size}: only 32 is simulated")
        c.require(scale_alg in (0, None), "not-simulated", f"scale_alg={scale_alg}: only 0 (OCP) is simulated")
        c.require(
            dst_type_max == 0.0 and max_low_bound == 0.0, "not-simulated", "dst_type_max/max_low_bound not simulated"
        )
        ax = axis % input.dim()
        xf = input.float().movedim(ax, -1)
        n = xf.shape[-1]
        nblk = _cdiv(n, MX_BLOCK)
        blocks = F.pad(xf, (0, nblk * MX_BLOCK - n)).reshape(*xf.shape[:-1], nblk, MX_BLOCK)
        amax = blocks.abs().amax(dim=-1)
        _, e = torch.frexp(amax)
        shared = torch.where(amax > 0, e.to(torch.int32) - 1 - 8, torch.full_like(e, -127, dtype=torch.int32))
        shared = shared.clamp(-127, 127)  # shared_exp = floor(log2(max|V|)) - emax, emax(e4m3) = 8
        scale = torch.ldexp(torch.ones(shared.shape), shared)
        y = (blocks / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
        y = y.reshape(*xf.shape[:-1], nblk * MX_BLOCK)[..., :n].movedim(-1, ax).contiguous()
        code = (shared + 127).to(torch.uint8)
        code = F.pad(code, (0, nblk % 2))  # even number of blocks, pad value 0
        code = code.reshape(*code.shape[:-1], -1, 2).movedim(-2, ax).contiguous()  # pairs last, interleaved
        sim.calls[op] += 1
        return y.to(input.device), code.to(input.device)

    return npu_dynamic_mx_quant


# -- the module object ---------------------------------------------------------------------
def make_torch_npu(chip: str = "Ascend950PR", cann_version: str = CURRENT_CANN) -> types.ModuleType:
    """A fresh simulated torch_npu. State on the module: `chip` (npu.get_device_name(); get_soc_version()
    follows it), `cann_version` (utils.get_cann_version()), `calls` (successful calls per op),
    `last_kwargs`, `pad_output_rows` (pad the attention output's sequence axis)."""
    mod = types.ModuleType("torch_npu", "fx_fp8 test simulator of torch_npu's op contracts (not the real package)")
    mod.__version__ = "0.0.0+contract-sim"
    # importlib.util.find_spec("torch_npu") must not crash on the stand-in
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None, origin="fx_fp8 contract simulator")
    mod.chip = chip
    mod.cann_version = cann_version
    mod.calls = Counter()
    mod.last_kwargs = {}
    mod.pad_output_rows = None
    mod.SimulatedContractError = SimulatedContractError
    mod.hifloat8, mod.float8_e5m2, mod.float8_e4m3fn, mod.float8_e8m0fnu = (
        HIFLOAT8,
        FLOAT8_E5M2,
        FLOAT8_E4M3FN,
        FLOAT8_E8M0FNU,
    )
    mod.float4_e2m1fn_x2 = FLOAT4_E2M1FN_X2
    mod.npu = types.SimpleNamespace(
        get_device_name=lambda device=None: mod.chip,
        is_available=lambda: True,
        device_count=lambda: 1,
        get_soc_version=lambda: SOC_VERSIONS.get(mod.chip, 0),
    )
    utils = types.ModuleType("torch_npu.utils")
    utils.get_cann_version = lambda module="CANN": mod.cann_version if module == "CANN" else ""
    mod.utils = utils
    mod.npu_fused_infer_attention_score_v2 = make_attention_op(mod)
    mod.npu_dynamic_quant = make_dynamic_quant_op(mod)
    mod.npu_quant_matmul = make_quant_matmul_op(mod)
    mod.npu_weight_quant_batchmatmul = make_weight_quant_matmul_op(mod)
    mod.npu_dynamic_block_quant = make_dynamic_block_quant_op(mod)
    mod.npu_dynamic_mx_quant = make_dynamic_mx_quant_op(mod)
    return mod


_MISSING = object()


@contextlib.contextmanager
def modules_installed(modules: dict):
    """sys.modules updated with `modules` for the duration; every name restored (or removed) afterwards."""
    saved = {n: sys.modules.get(n, _MISSING) for n in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for n, old in saved.items():
            if old is _MISSING:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = old


@contextlib.contextmanager
def installed(chip: str = "Ascend950PR", cann_version: str = CURRENT_CANN):
    """sys.modules["torch_npu"] (and "torch_npu.utils") = a simulator for the duration; restored afterwards."""
    mod = make_torch_npu(chip, cann_version)
    with modules_installed({"torch_npu": mod, "torch_npu.utils": mod.utils}):
        yield mod
