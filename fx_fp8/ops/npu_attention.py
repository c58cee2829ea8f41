"""FP8 attention on Ascend: which of the three paths (mindiesd, fia_block, fia_mx) an attention
call takes, and each path's run-time work (see fx_fp8.ops.npu for the paths and their CANN
releases). The vendor calls' arguments come from npu_calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from fx_fp8.graph.shapes import concrete, known_one
from fx_fp8.ops import mindiesd, mx, npu_calls, quant
from fx_fp8.ops.npu_calls import (
    KERNEL_HEAD_DIMS,
    KERNEL_KV_BLOCK,
    KERNEL_OUT_DTYPES,
    KERNEL_Q_BLOCK,
    P_SCALE_RANGE,
    kernel_block_scales,
    kernel_head_dim,
    pad_head_dim,
    to_tnd,
)
from fx_fp8.ops.npu_platform import (
    MODE7_REFUSED_FROM,
    MXFP8_ATTENTION_FROM,
    cann_accepts_mode7,
    cann_has_mxfp8_attention,
    cann_version,
    chip_problem,
    import_problem,
    import_torch_npu,
)

KERNELS = ("mindiesd", "fia_block", "fia_mx")


# -- which attention path -----------------------------------------------------------------
@dataclass(frozen=True)
class AttentionPlan:
    kernel: Optional[str]  # one of KERNELS, None: native
    detail: str  # the path's description, or why the node stays native


def _native(reason: str) -> AttentionPlan:
    return AttentionPlan(None, reason)


def attention_plan(q, k, v, cfg, attn_mask=None, *, need_lse: bool = False) -> AttentionPlan:
    """The attention path for these inputs (FakeTensors at compile time, real ones at run time).
    cfg: granularity, q_block, kv_block, quantize_p, p_scale. Never specialises symbolic sizes."""
    problem = import_problem()
    if problem is not None:
        return _native(f"{problem}: attention stays native")
    problem = chip_problem()
    if problem is not None:
        return _native(f"{problem}: attention stays native")
    if q.dtype not in KERNEL_OUT_DTYPES:
        return _native(
            f"query dtype {q.dtype}: the FP8 attention kernels output fp16/bf16 only (run the model in bf16/fp16)"
        )
    d, dv = concrete(q.shape[-1]), concrete(v.shape[-1])
    if d is None or dv is None:
        return _native("symbolic head dim: the FP8 attention kernels are specialised per head dim")
    if dv != d:
        return _native(f"value head dim {dv} != query head dim {d} (the FP8 kernels need equal head dims)")
    if kernel_head_dim(d) is None:
        return _native(
            f"head dim {d} > {KERNEL_HEAD_DIMS[-1]} (the FP8 attention kernels take head dims up to "
            f"{KERNEL_HEAD_DIMS[-1]})"
        )
    if known_one(q.shape[2]):
        return _native("query length 1 (the fused attention's decode branch has no FP8 case)")
    if not cfg.quantize_p:
        return _native("quantize_p=False: the fused FP8 kernels always quantize P (the CPU reference can run without)")
    if attn_mask is not None:
        return _native(
            f"attention mask ({attn_mask.dtype}): the NPU FP8 attention cases take no mask "
            "(CANN V5 doc: per-block has no mask, MXFP8 takes none with sparse_mode 0)"
        )
    if not P_SCALE_RANGE[0] <= cfg.p_scale <= P_SCALE_RANGE[1]:
        return _native(
            f"p_scale={cfg.p_scale}: the FP8 attention kernels take a P scale in "
            f"[{P_SCALE_RANGE[0]:g}, {P_SCALE_RANGE[1]:g}] (quantScale1)"
        )
    version = cann_version()
    shown = version or "unknown"
    if cfg.granularity == "mx":
        if not cann_has_mxfp8_attention(version):
            return _native(
                f"CANN {shown} has no MXFP8 fused attention (quant modes 6/6/8 need CANN >= {MXFP8_ATTENTION_FROM})"
            )
        return AttentionPlan(
            "fia_mx",
            f"torch_npu MXFP8 attention (npu_dynamic_mx_quant + "
            f"npu_fused_infer_attention_score_v2, modes 6/6/8, TND, CANN {shown})",
        )
    if need_lse:
        return _native(
            "log-sum-exp requested: the per-block FP8 attention cases return no softmax_lse "
            "(attention.granularity: mx has it)"
        )
    if cfg.granularity == "block" and (cfg.q_block % KERNEL_Q_BLOCK or cfg.kv_block % KERNEL_KV_BLOCK):
        return _native(
            f"block scales q_block={cfg.q_block}/kv_block={cfg.kv_block}: the FP8 kernels' scale blocks "
            f"are {KERNEL_Q_BLOCK}/{KERNEL_KV_BLOCK} rows (use multiples of them)"
        )
    sd_problem = mindiesd.import_problem()
    if sd_problem is None:
        if cfg.granularity != "block" or (cfg.q_block in mindiesd.BLOCK_SIZES and cfg.kv_block in mindiesd.BLOCK_SIZES):
            return AttentionPlan(
                "mindiesd",
                f"MindIE-SD {mindiesd.version()} per-block FP8 attention "
                "(fa_block_quant_preprocess + fused_infer_attention_score_v2, "
                "modes 7/7/7, BNSD)",
            )
        sd_problem = (
            f"MindIE-SD's fa_block_quant_preprocess takes block sizes {mindiesd.BLOCK_SIZES}, "
            f"not q_block={cfg.q_block}/kv_block={cfg.kv_block}"
        )
    if cann_accepts_mode7(version):
        return AttentionPlan(
            "fia_block",
            f"torch_npu per-block FP8 attention (npu_fused_infer_attention_score_v2, modes 7/7/7, BNSD, CANN {shown})",
        )
    return _native(
        f"CANN {shown} refuses per-block FP8 attention (quant mode 7, gone from "
        f"npu_fused_infer_attention_score_v2 since CANN {MODE7_REFUSED_FROM}) and {sd_problem}: "
        "install MindIE-SD (pip install mindiesd) or set attention.granularity: mx"
    )


# -- shared pre-processing --------------------------------------------------------------------
def rotate_qk(q, k, *, hadamard: bool, smooth_k: bool):
    """fp32 Q and K smoothed and rotated exactly as quant.prepare_qkv does before quantizing."""
    qf, kf = q.float(), k.float()
    if smooth_k:
        kf = kf - kf.mean(dim=2, keepdim=True)
    if hadamard:
        qf, kf = quant.hadamard_rotate(qf), quant.hadamard_rotate(kf)
    return qf, kf


# -- path "fia_block": torch_npu per-block (older CANN) ----------------------------------------
def _attention_fia_block(
    q, k, v, *, softmax_scale, granularity, q_block, kv_block, hadamard, smooth_k, p_scale, return_lse
):
    torch_npu = import_torch_npu()
    qq, sq, kq, sk, vq, sv = quant.prepare_qkv(
        q, k, v, granularity=granularity, q_block=q_block, kv_block=kv_block, hadamard=hadamard, smooth_k=smooth_k
    )
    kwargs = npu_calls.attention_call_kwargs(
        q,
        qq,
        sq,
        kq,
        sk,
        vq,
        sv,
        softmax_scale=softmax_scale,
        granularity=granularity,
        q_block=q_block,
        kv_block=kv_block,
        p_scale=p_scale,
    )
    out = torch_npu.npu_fused_infer_attention_score_v2(**kwargs)[0]
    return out[:, :, : q.shape[2], : v.shape[-1]], None  # trim sequence padding the op may add, and ours


# -- path "mindiesd" -------------------------------------------------------------------------
def _attention_mindiesd(
    q, k, v, *, softmax_scale, granularity, q_block, kv_block, hadamard, smooth_k, p_scale, return_lse
):
    torch_npu = import_torch_npu()
    fa_block_quant_preprocess, fused_infer_attention_score_v2 = mindiesd.entry_points()
    b, h, s_q, d = q.shape
    h_kv, s_k = k.shape[1], k.shape[2]
    kd = kernel_head_dim(d)
    if granularity == "block":
        # the fp32 rotated Q/K the reference quantizes (MindIE-SD's FP8RotateQuantFA feeds the model
        # dtype; aclnnDynamicBlockQuant takes FLOAT32 too, and a bf16 rounding first would move ~2% of
        # the FP8 values by one step, ~3% of the attention output on random data)
        qf, kf = rotate_qk(q, k, hadamard=hadamard, smooth_k=smooth_k)
        qpad, kpad, vpad = (pad_head_dim(t, kd) for t in (qf, kf, v))
        fp8 = torch_npu.float8_e4m3fn
        qq, sq = npu_calls.mindiesd_block_quant(fa_block_quant_preprocess, qpad, q_block, KERNEL_Q_BLOCK, fp8)
        kq, sk = npu_calls.mindiesd_block_quant(fa_block_quant_preprocess, kpad, kv_block, KERNEL_KV_BLOCK, fp8)
        vq, sv = npu_calls.mindiesd_block_quant(fa_block_quant_preprocess, vpad, kv_block, KERNEL_KV_BLOCK, fp8)
    else:  # per-head / per-tensor scales: the reference's quantization, scales expanded to the kernel's blocks
        qq, sq, kq, sk, vq, sv = quant.prepare_qkv(
            q, k, v, granularity=granularity, q_block=q_block, kv_block=kv_block, hadamard=hadamard, smooth_k=smooth_k
        )
        qq, kq, vq = (pad_head_dim(t, kd) for t in (qq, kq, vq))
        sq = kernel_block_scales(sq, granularity, q_block, KERNEL_Q_BLOCK, b, h, s_q)
        sk = kernel_block_scales(sk, granularity, kv_block, KERNEL_KV_BLOCK, b, h_kv, s_k)
        sv = kernel_block_scales(sv, granularity, kv_block, KERNEL_KV_BLOCK, b, h_kv, s_k)
    kwargs = npu_calls.mindiesd_call_kwargs(q, qq, sq, kq, sk, vq, sv, softmax_scale=softmax_scale, p_scale=p_scale)
    query, key, value = kwargs.pop("query"), kwargs.pop("key"), kwargs.pop("value")
    out = fused_infer_attention_score_v2(query, key, value, **kwargs)[0]
    return out[:, :, :s_q, :d], None  # MindIE-SD crops the sequence axis the same way (_crop_fa_output)


# -- path "fia_mx": torch_npu MXFP8 -----------------------------------------------------------
def _attention_fia_mx(q, k, v, *, softmax_scale, hadamard, smooth_k, p_scale, return_lse, **_):
    b, h, s_q, d = q.shape
    s_k = k.shape[2]
    if b > 1 and s_k % mx.MX_BLOCK:
        # TND packs the batch along one token axis: V's 32-token blocks would straddle two samples
        parts = [
            _attention_fia_mx(
                q[i : i + 1],
                k[i : i + 1],
                v[i : i + 1],
                softmax_scale=softmax_scale,
                hadamard=hadamard,
                smooth_k=smooth_k,
                p_scale=p_scale,
                return_lse=return_lse,
            )
            for i in range(b)
        ]
        out = torch.cat([p[0] for p in parts])
        return out, (torch.cat([p[1] for p in parts]) if return_lse else None)
    torch_npu = import_torch_npu()
    kd = kernel_head_dim(d)
    qf, kf = rotate_qk(q, k, hadamard=hadamard, smooth_k=smooth_k)
    # fp32 rotated Q/K, as the reference quantizes them (aclnnDynamicMxQuant takes FLOAT; MindIE-SD feeds bf16)
    qt, kt, vt = (to_tnd(t, kd) for t in (qf, kf, v))
    qq, qs = torch_npu.npu_dynamic_mx_quant(qt, dst_type=torch.float8_e4m3fn, axis=-1)
    kq, ks = torch_npu.npu_dynamic_mx_quant(kt, dst_type=torch.float8_e4m3fn, axis=-1)
    vq, vs = torch_npu.npu_dynamic_mx_quant(vt, dst_type=torch.float8_e4m3fn, axis=0)
    kwargs = npu_calls.mx_call_kwargs(
        q,
        qq,
        qs,
        kq,
        ks,
        vq,
        vs,
        b=b,
        s_q=s_q,
        s_k=s_k,
        softmax_scale=softmax_scale,
        p_scale=p_scale,
        return_lse=return_lse,
    )
    out, lse = torch_npu.npu_fused_infer_attention_score_v2(**kwargs)
    out = out.reshape(b, s_q, h, kd).transpose(1, 2)[..., :d]
    if not return_lse:
        return out, None
    # (T, N, 1) -> (B, N, S); CANN marks invalid (fully masked) rows with inf, the reference with -inf
    lse = lse.float().reshape(b, s_q, h).transpose(1, 2)
    lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("-inf")), lse)
    if smooth_k:  # the lse of the unsmoothed scores, as the reference returns it
        lse = lse + quant.smoothing_lse_shift(q, k, softmax_scale)
    return out, lse


RUNNERS = {"mindiesd": _attention_mindiesd, "fia_block": _attention_fia_block, "fia_mx": _attention_fia_mx}
