"""Ascend NPU lowering: FP8 attention through MindIE-SD or torch_npu, FP8 / INT8 W8A8 linears.

Attention has three device paths behind the same custom op. `attention_plan`
picks one at compile time from what is importable, the chip and the CANN
release (the report's reason says why none fits when the node stays native):

  mindiesd   MindIE-SD: Q/K rotated and smoothed as the reference does, then
             `fa_block_quant_preprocess` (torch_npu.npu_dynamic_block_quant, per-block
             FP8 e4m3) and MindIE-SD's own fused attention kernel
             (`fused_infer_attention_score_v2`, quant modes 7/7/7, BNSD). What
             vLLM-Omni calls (fx_fp8.ops.mindiesd). Ascend 950, granularity block/head/tensor.
  fia_block  torch_npu.npu_fused_infer_attention_score_v2, per-block FP8 (modes 7/7/7,
             BNSD, fp32 scales [B, N, ceil(S/128 or 256), 1]) on CANN releases that
             still accept mode 7: documented in aclnnFusedInferAttentionScoreV5 up to
             9.0.0-beta.2, refused from 9.0.0-rc.1 on (ops-transformer commit 17e3f5b9d,
             "per-block场景下线": "传入0-6之外的其他值会执行异常"). Never used where the
             installed CANN is newer, or its version cannot be read.
  fia_mx     torch_npu.npu_dynamic_mx_quant + npu_fused_infer_attention_score_v2 MXFP8
             (modes 6/6/8, TND, e8m0 block scales, CANN >= 9.1.0.pre): the case
             CANN recommends instead of mode 7 ("It is recommended to use mxfp8 full
             quantization instead", dequant_checker.cpp) and MindIE-SD's MXFP8
             attention. For `attention.granularity: mx` (fx_fp8.ops.mx is its reference).

Not used: the V5 "GQA full quant" case (modes 3/3/2): paged KV only (block table,
BnNBsD), NTD_TND only, head dim 128 only, and a value scale per head shared by the
whole batch, which none of fx_fp8's granularities (the reference numerics) is.

Linears: `npu_dynamic_quant` (one per group of linears reading the same tensor,
per-token scale) + `npu_quant_matmul` (W^T as x2, per-channel / per-tensor fp32
weight scale, per-token fp32 scale). FP8 on Ascend 950; INT8 on Atlas A2/A3 and
950. FP8 on A2/A3 runs weight-only (FP8 storage, native matmul) and says so.

torch_npu and mindiesd are imported inside the functions that call them,
never when fx_fp8 is imported: installing torch_npu breaks plain torch on
machines without CANN.
"""
from __future__ import annotations

import importlib
import re
import types
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from fx_fp8.ops import mindiesd, mx, quant
from fx_fp8.ops.lowering import Lowering
from fx_fp8.shapes import concrete, known_one

#: row blocks of the per-block FP8 attention case (fixed by the kernels)
KERNEL_Q_BLOCK = 128
KERNEL_KV_BLOCK = 256
#: query/key/value_quant_mode of the cases used
BLOCK_QUANT_MODES = (7, 7, 7)
MX_QUANT_MODES = (6, 6, 8)
#: head dims the kernels run; smaller head dims are zero-padded up to one of them (exact)
KERNEL_HEAD_DIMS = (64, 128)
#: output dtypes of the FP8 attention and quantized matmul kernels
KERNEL_OUT_DTYPES = (torch.bfloat16, torch.float16)
#: npu_quant_matmul: x1 / x2 last dims must not exceed this
MAX_MATMUL_DIM = 65535
#: quant_scale_p (quantScale1, the P scale) range of the FP8 cases in the CANN V5 doc: [1, 448]
P_SCALE_RANGE = (1.0, 448.0)
#: SoC version of Ascend 950 as torch_npu.npu.get_soc_version() reports it (MindIE-SD's A5 check)
ASCEND_950_SOC = 260
INT_MAX = 2147483647

#: CANN releases (see parse_cann_version): mode 7 refused from 9.0.0-rc.1; non-paged (TND) MXFP8 attention
#: from 9.1.0.pre (9.1.0-beta.3 had it for paged KV only, head dim 128, 64-aligned lengths)
MODE7_REFUSED_FROM = "9.0.0-rc.1"
MXFP8_ATTENTION_FROM = "9.1.0.pre"

KERNELS = ("mindiesd", "fia_block", "fia_mx")


# -- torch_npu, the chip and CANN, looked up lazily ---------------------------------------
def _torch_npu():
    import torch_npu  # noqa: F401  lazy on purpose (see module doc)

    return torch_npu


def import_problem() -> Optional[str]:
    """None when torch_npu imports, else why not (ImportError, or CANN libraries missing)."""
    try:
        _torch_npu()
    except Exception as e:  # a broken CANN install raises RuntimeError/OSError, not only ImportError
        return f"torch_npu not importable ({type(e).__name__}: {e})"
    return None


def device_name() -> str:
    return str(_torch_npu().npu.get_device_name())


def soc_version() -> Optional[int]:
    try:
        return int(_torch_npu().npu.get_soc_version())
    except Exception:
        return None


def is_fp8_chip(name: str, soc: Optional[int] = None) -> bool:
    """FP8 attention / matmul kernels exist on Ascend 950 (950PR / 950DT) only."""
    return "950" in name or soc == ASCEND_950_SOC


def chip_problem() -> Optional[str]:
    """None on an Ascend 950, else why this machine has no FP8 kernels."""
    problem = import_problem()
    if problem is not None:
        return problem
    try:
        name = device_name()
    except Exception as e:
        return f"cannot read the NPU name ({type(e).__name__}: {e})"
    if not is_fp8_chip(name, soc_version()):
        return f"{name} has no FP8 kernels (FP8 attention/matmul are Ascend 950 only; Atlas A2/A3 are INT8 only)"
    return None


def cann_version() -> str:
    """torch_npu.utils.get_cann_version() ("" when unavailable: CANN < 8.1.RC1 or no torch_npu)."""
    try:
        torch_npu = _torch_npu()
        utils = getattr(torch_npu, "utils", None) or importlib.import_module("torch_npu.utils")
        return str(utils.get_cann_version(module="CANN") or "")
    except Exception:
        return ""


#: pre-release stages in release order ("9.1.0.pre" is the snapshot before 9.1.0, after its betas)
_STAGES = {"alpha": 0, "beta": 1, "rc": 2, "pre": 3}


def parse_cann_version(text: str) -> Optional[tuple]:
    """Comparable key of a CANN version: "8.3.RC1", "9.0.0", "9.0.0-beta.2", "9.1.0.pre" ... None if unreadable."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?(?:[.\-]?([A-Za-z]+)\.?(\d*))?", text or "")
    if m is None:
        return None
    major, minor, patch, stage, num = m.groups()
    stage = (stage or "").lower()
    rank = _STAGES.get(stage, 4 if stage == "" else None)
    if rank is None:
        return None
    return int(major), int(minor), int(patch or 0), rank, int(num or 0)


def cann_accepts_mode7(version: str) -> bool:
    """Only a CANN release known to be older than 9.0.0-rc.1 gets the per-block case (mode 7)."""
    key = parse_cann_version(version)
    return key is not None and key < parse_cann_version(MODE7_REFUSED_FROM)


def cann_has_mxfp8_attention(version: str) -> bool:
    """Non-paged MXFP8 attention (modes 6/6/8, TND): CANN >= 9.1.0.pre, or a version that cannot
    be read (assumed current)."""
    key = parse_cann_version(version)
    return key is None or key >= parse_cann_version(MXFP8_ATTENTION_FROM)


def kernel_head_dim(d: int) -> Optional[int]:
    """The kernel head dim a head dim d runs at (zero-padded), or None when too large."""
    for kd in KERNEL_HEAD_DIMS:
        if d <= kd:
            return kd
    return None


# -- which attention path -----------------------------------------------------------------
@dataclass(frozen=True)
class AttentionPlan:
    kernel: Optional[str]   # one of KERNELS, None: native
    detail: str             # the path's description, or why the node stays native


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
        return _native(f"query dtype {q.dtype}: the FP8 attention kernels output fp16/bf16 only "
                       "(run the model in bf16/fp16)")
    d, dv = concrete(q.shape[-1]), concrete(v.shape[-1])
    if d is None or dv is None:
        return _native("symbolic head dim: the FP8 attention kernels are specialised per head dim")
    if dv != d:
        return _native(f"value head dim {dv} != query head dim {d} (the FP8 kernels need equal head dims)")
    if kernel_head_dim(d) is None:
        return _native(f"head dim {d} > {KERNEL_HEAD_DIMS[-1]} (the FP8 attention kernels take head dims up to "
                       f"{KERNEL_HEAD_DIMS[-1]})")
    if known_one(q.shape[2]):
        return _native("query length 1 (the fused attention's decode branch has no FP8 case)")
    if not cfg.quantize_p:
        return _native("quantize_p=False: the fused FP8 kernels always quantize P (the CPU reference can run without)")
    if attn_mask is not None:
        return _native(f"attention mask ({attn_mask.dtype}): the NPU FP8 attention cases take no mask "
                       "(CANN V5 doc: per-block has no mask, MXFP8 takes none with sparse_mode 0)")
    if not P_SCALE_RANGE[0] <= cfg.p_scale <= P_SCALE_RANGE[1]:
        return _native(f"p_scale={cfg.p_scale}: the FP8 attention kernels take a P scale in "
                       f"[{P_SCALE_RANGE[0]:g}, {P_SCALE_RANGE[1]:g}] (quantScale1)")
    version = cann_version()
    shown = version or "unknown"
    if cfg.granularity == "mx":
        if not cann_has_mxfp8_attention(version):
            return _native(f"CANN {shown} has no MXFP8 fused attention (quant modes 6/6/8 need CANN >= "
                           f"{MXFP8_ATTENTION_FROM})")
        return AttentionPlan("fia_mx", f"torch_npu MXFP8 attention (npu_dynamic_mx_quant + "
                                       f"npu_fused_infer_attention_score_v2, modes 6/6/8, TND, CANN {shown})")
    if need_lse:
        return _native("log-sum-exp requested: the per-block FP8 attention cases return no softmax_lse "
                       "(attention.granularity: mx has it)")
    if cfg.granularity == "block" and (cfg.q_block % KERNEL_Q_BLOCK or cfg.kv_block % KERNEL_KV_BLOCK):
        return _native(f"block scales q_block={cfg.q_block}/kv_block={cfg.kv_block}: the FP8 kernels' scale blocks "
                       f"are {KERNEL_Q_BLOCK}/{KERNEL_KV_BLOCK} rows (use multiples of them)")
    sd_problem = mindiesd.import_problem()
    if sd_problem is None:
        if cfg.granularity != "block" or (cfg.q_block in mindiesd.BLOCK_SIZES and cfg.kv_block in mindiesd.BLOCK_SIZES):
            return AttentionPlan("mindiesd", f"MindIE-SD {mindiesd.version()} per-block FP8 attention "
                                             "(fa_block_quant_preprocess + fused_infer_attention_score_v2, "
                                             "modes 7/7/7, BNSD)")
        sd_problem = (f"MindIE-SD's fa_block_quant_preprocess takes block sizes {mindiesd.BLOCK_SIZES}, "
                      f"not q_block={cfg.q_block}/kv_block={cfg.kv_block}")
    if cann_accepts_mode7(version):
        return AttentionPlan("fia_block", f"torch_npu per-block FP8 attention (npu_fused_infer_attention_score_v2, "
                                          f"modes 7/7/7, BNSD, CANN {shown})")
    return _native(f"CANN {shown} refuses per-block FP8 attention (quant mode 7, gone from "
                   f"npu_fused_infer_attention_score_v2 since CANN {MODE7_REFUSED_FROM}) and {sd_problem}: "
                   "install MindIE-SD (pip install mindiesd) or set attention.granularity: mx")


# -- shared pre-processing --------------------------------------------------------------------
def rotate_qk(q, k, *, hadamard: bool, smooth_k: bool):
    """fp32 Q and K smoothed and rotated exactly as quant.prepare_qkv does before quantizing."""
    qf, kf = q.float(), k.float()
    if smooth_k:
        kf = kf - kf.mean(dim=2, keepdim=True)
    if hadamard:
        qf, kf = quant.hadamard_rotate(qf), quant.hadamard_rotate(kf)
    return qf, kf


def _pad_head_dim(x: torch.Tensor, d: int) -> torch.Tensor:
    """Zero-pad the last dim to d (exact: zero columns change neither Q.K nor P.V's first columns,
    nor any block maximum). Padded as bytes: 0x00 is +0.0 in every dtype used here."""
    x = x.contiguous()
    if x.shape[-1] == d:
        return x
    if x.element_size() == 1:
        return F.pad(x.view(torch.uint8), (0, d - x.shape[-1])).view(x.dtype)
    return F.pad(x, (0, d - x.shape[-1]))


def kernel_block_scales(scale: torch.Tensor, granularity: str, block: int, kernel_block: int, b: int, h: int, s: int):
    """[B, N, ceil(S / kernel_block), 1] fp32 scales from (tensor [1,1,1] / head [B,H,1] / block
    [B,H,ceil(S/block)]) scales. Exact: every kernel block lies inside one quantization block."""
    nblk = -(-s // kernel_block)
    if granularity == "block":
        scale = scale.repeat_interleave(block // kernel_block, dim=-1)[..., :nblk]
    return scale.float().expand(b, h, nblk).unsqueeze(-1).contiguous()


def _p_scale_tensor(p_scale: float, device) -> torch.Tensor:
    """P is quantized as P * p_scale (P in [0, 1]), fx_fp8's p_scale convention."""
    return torch.full((1,), float(p_scale), dtype=torch.float32, device=device)


# -- path "fia_block": torch_npu per-block (older CANN) ----------------------------------------
def attention_call_kwargs(q, qq, sq, kq, sk, vq, sv, *, softmax_scale, granularity, q_block, kv_block, p_scale):
    """Every argument of the per-block npu_fused_infer_attention_score_v2 call, by name.
    q is the original (B, H, S, D) query; qq..sv come from quant.prepare_qkv. Tests wrap this."""
    b, h, s_q, d = qq.shape
    h_kv, s_k = kq.shape[1], kq.shape[2]
    kd = kernel_head_dim(d)
    return dict(
        query=_pad_head_dim(qq, kd), key=_pad_head_dim(kq, kd), value=_pad_head_dim(vq, kd),
        dequant_scale_query=kernel_block_scales(sq, granularity, q_block, KERNEL_Q_BLOCK, b, h, s_q),
        dequant_scale_key=kernel_block_scales(sk, granularity, kv_block, KERNEL_KV_BLOCK, b, h_kv, s_k),
        dequant_scale_value=kernel_block_scales(sv, granularity, kv_block, KERNEL_KV_BLOCK, b, h_kv, s_k),
        quant_scale_p=_p_scale_tensor(p_scale, q.device),
        num_query_heads=h, num_key_value_heads=h_kv,
        softmax_scale=float(softmax_scale),  # the op's default 1.0 is wrong for us: always explicit
        pre_tokens=INT_MAX, next_tokens=INT_MAX,
        input_layout="BNSD",  # prepare_qkv materialises new tensors in (B, N, S, D) order
        sparse_mode=0,
        query_quant_mode=BLOCK_QUANT_MODES[0], key_quant_mode=BLOCK_QUANT_MODES[1],
        value_quant_mode=BLOCK_QUANT_MODES[2],
        out_dtype=q.dtype,  # an `int?` in the schema: torch.ops turns a torch.dtype into its ScalarType code
    )


def _attention_fia_block(q, k, v, *, softmax_scale, granularity, q_block, kv_block, hadamard, smooth_k, p_scale,
                         return_lse):
    torch_npu = _torch_npu()
    qq, sq, kq, sk, vq, sv = quant.prepare_qkv(q, k, v, granularity=granularity, q_block=q_block, kv_block=kv_block,
                                               hadamard=hadamard, smooth_k=smooth_k)
    kwargs = attention_call_kwargs(q, qq, sq, kq, sk, vq, sv, softmax_scale=softmax_scale, granularity=granularity,
                                   q_block=q_block, kv_block=kv_block, p_scale=p_scale)
    out = torch_npu.npu_fused_infer_attention_score_v2(**kwargs)[0]
    return out[:, :, : q.shape[2], : v.shape[-1]], None  # trim sequence padding the op may add, and ours


# -- path "mindiesd" -------------------------------------------------------------------------
def mindiesd_block_quant(fa_block_quant_preprocess, x: torch.Tensor, block: int, kernel_block: int, dst_type):
    """fa_block_quant_preprocess one sample at a time (it squeezes the batch axis) ->
    (BNSD FP8 data, [B, N, ceil(S / kernel_block), 1] fp32 scales)."""
    data, scales = [], []
    for i in range(x.shape[0]):
        xq, xs = fa_block_quant_preprocess(x[i:i + 1], block_size=block, dst_type=dst_type, layout="BNSD")
        data.append(xq)
        scales.append(xs)
    xq, xs = torch.cat(data), torch.cat(scales)  # scales (B, N, ceil(S/block), ceil(D/128) = 1)
    nblk = -(-x.shape[2] // kernel_block)
    xs = xs[..., :1].repeat_interleave(block // kernel_block, dim=2)[:, :, :nblk]
    return xq.contiguous(), xs.float().contiguous()


def mindiesd_call_kwargs(q, qq, sq, kq, sk, vq, sv, *, softmax_scale, p_scale):
    """Every argument of MindIE-SD's fused_infer_attention_score_v2 call, by name (tests wrap this).
    As MindIE-SD's FP8RotateQuantFA calls it, plus the P scale in `quant_scale1` (its schema's
    slot for it: the wrapper drops `quant_scale_p`) and num_key_value_heads."""
    return dict(
        query=qq, key=kq, value=vq,
        input_layout="BNSD", num_query_heads=qq.shape[1], num_key_value_heads=kq.shape[1],
        softmax_scale=float(softmax_scale), pre_tokens=INT_MAX, next_tokens=INT_MAX,
        query_quant_mode=BLOCK_QUANT_MODES[0], key_quant_mode=BLOCK_QUANT_MODES[1],
        value_quant_mode=BLOCK_QUANT_MODES[2],
        dequant_scale_query=sq, dequant_scale_key=sk, dequant_scale_value=sv,
        quant_scale1=_p_scale_tensor(p_scale, q.device),
        out_dtype=q.dtype,
    )


def _attention_mindiesd(q, k, v, *, softmax_scale, granularity, q_block, kv_block, hadamard, smooth_k, p_scale,
                        return_lse):
    torch_npu = _torch_npu()
    fa_block_quant_preprocess, fused_infer_attention_score_v2 = mindiesd.entry_points()
    b, h, s_q, d = q.shape
    h_kv, s_k = k.shape[1], k.shape[2]
    kd = kernel_head_dim(d)
    if granularity == "block":
        # the fp32 rotated Q/K the reference quantizes (MindIE-SD's FP8RotateQuantFA feeds the model
        # dtype; aclnnDynamicBlockQuant takes FLOAT32 too, and a bf16 rounding first would move ~2% of
        # the FP8 values by one step, ~3% of the attention output on random data)
        qf, kf = rotate_qk(q, k, hadamard=hadamard, smooth_k=smooth_k)
        qpad, kpad, vpad = (_pad_head_dim(t, kd) for t in (qf, kf, v))
        fp8 = torch_npu.float8_e4m3fn
        qq, sq = mindiesd_block_quant(fa_block_quant_preprocess, qpad, q_block, KERNEL_Q_BLOCK, fp8)
        kq, sk = mindiesd_block_quant(fa_block_quant_preprocess, kpad, kv_block, KERNEL_KV_BLOCK, fp8)
        vq, sv = mindiesd_block_quant(fa_block_quant_preprocess, vpad, kv_block, KERNEL_KV_BLOCK, fp8)
    else:  # per-head / per-tensor scales: the reference's quantization, scales expanded to the kernel's blocks
        qq, sq, kq, sk, vq, sv = quant.prepare_qkv(q, k, v, granularity=granularity, q_block=q_block,
                                                   kv_block=kv_block, hadamard=hadamard, smooth_k=smooth_k)
        qq, kq, vq = (_pad_head_dim(t, kd) for t in (qq, kq, vq))
        sq = kernel_block_scales(sq, granularity, q_block, KERNEL_Q_BLOCK, b, h, s_q)
        sk = kernel_block_scales(sk, granularity, kv_block, KERNEL_KV_BLOCK, b, h_kv, s_k)
        sv = kernel_block_scales(sv, granularity, kv_block, KERNEL_KV_BLOCK, b, h_kv, s_k)
    kwargs = mindiesd_call_kwargs(q, qq, sq, kq, sk, vq, sv, softmax_scale=softmax_scale, p_scale=p_scale)
    query, key, value = kwargs.pop("query"), kwargs.pop("key"), kwargs.pop("value")
    out = fused_infer_attention_score_v2(query, key, value, **kwargs)[0]
    return out[:, :, :s_q, :d], None  # MindIE-SD crops the sequence axis the same way (_crop_fa_output)


# -- path "fia_mx": torch_npu MXFP8 -----------------------------------------------------------
def _to_tnd(x: torch.Tensor, d: int) -> torch.Tensor:
    """(B, N, S, D) -> (B * S, N, d) contiguous (TND), head dim zero-padded to d."""
    b, n, s, _ = x.shape
    return _pad_head_dim(x, d).transpose(1, 2).reshape(b * s, n, d).contiguous()


def mx_call_kwargs(q, qq, qs, kq, ks, vq, vs, *, b, s_q, s_k, softmax_scale, p_scale, return_lse):
    """Every argument of the MXFP8 npu_fused_infer_attention_score_v2 call, by name (tests wrap this).
    As MindIE-SD's MXFP8RotateQuantFA calls it, plus quant_scale_p (CANN: "复用quantScale1作为pScale")."""
    torch_npu = _torch_npu()
    e8m0 = torch_npu.float8_e8m0fnu
    return dict(
        query=qq, key=kq, value=vq,
        dequant_scale_query=qs, dequant_scale_key=ks, dequant_scale_value=vs,
        actual_seq_qlen=[s_q * (i + 1) for i in range(b)],   # TND: cumulative lengths, host ints
        actual_seq_kvlen=[s_k * (i + 1) for i in range(b)],
        quant_scale_p=_p_scale_tensor(p_scale, q.device),
        num_query_heads=qq.shape[1], num_key_value_heads=kq.shape[1],
        softmax_scale=float(softmax_scale), input_layout="TND", sparse_mode=0,
        query_quant_mode=MX_QUANT_MODES[0], key_quant_mode=MX_QUANT_MODES[1], value_quant_mode=MX_QUANT_MODES[2],
        query_dtype=torch.float8_e4m3fn, key_dtype=torch.float8_e4m3fn, value_dtype=torch.float8_e4m3fn,
        dequant_scale_query_dtype=e8m0, dequant_scale_key_dtype=e8m0, dequant_scale_value_dtype=e8m0,
        return_softmax_lse=bool(return_lse),
        out_dtype=q.dtype,
    )


def _attention_fia_mx(q, k, v, *, softmax_scale, hadamard, smooth_k, p_scale, return_lse, **_):
    b, h, s_q, d = q.shape
    s_k = k.shape[2]
    if b > 1 and s_k % mx.MX_BLOCK:
        # TND packs the batch along one token axis: V's 32-token blocks would straddle two samples
        parts = [_attention_fia_mx(q[i:i + 1], k[i:i + 1], v[i:i + 1], softmax_scale=softmax_scale, hadamard=hadamard,
                                   smooth_k=smooth_k, p_scale=p_scale, return_lse=return_lse) for i in range(b)]
        out = torch.cat([p[0] for p in parts])
        return out, (torch.cat([p[1] for p in parts]) if return_lse else None)
    torch_npu = _torch_npu()
    kd = kernel_head_dim(d)
    qf, kf = rotate_qk(q, k, hadamard=hadamard, smooth_k=smooth_k)
    # fp32 rotated Q/K, as the reference quantizes them (aclnnDynamicMxQuant takes FLOAT; MindIE-SD feeds bf16)
    qt, kt, vt = (_to_tnd(t, kd) for t in (qf, kf, v))
    qq, qs = torch_npu.npu_dynamic_mx_quant(qt, dst_type=torch.float8_e4m3fn, axis=-1)
    kq, ks = torch_npu.npu_dynamic_mx_quant(kt, dst_type=torch.float8_e4m3fn, axis=-1)
    vq, vs = torch_npu.npu_dynamic_mx_quant(vt, dst_type=torch.float8_e4m3fn, axis=0)
    kwargs = mx_call_kwargs(q, qq, qs, kq, ks, vq, vs, b=b, s_q=s_q, s_k=s_k, softmax_scale=softmax_scale,
                            p_scale=p_scale, return_lse=return_lse)
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


_RUNNERS = {"mindiesd": _attention_mindiesd, "fia_block": _attention_fia_block, "fia_mx": _attention_fia_mx}


# -- linears ---------------------------------------------------------------------------------
def linear_call_kwargs(xq, x_scale, wq, w_scale, bias, *, out_dtype):
    """Every argument of the npu_quant_matmul call, by name (tests wrap this).
    Bias in fp32: fp16 bias is not in the int8 dtype table (A2/A3: int32/bf16/fp32)."""
    m = xq.shape[0]
    return dict(
        x1=xq,
        x2=wq.t(),  # the op wants (K, N); W is (N, K) row-major, so W^T is a transposed view (as MindIE-SD passes)
        scale=w_scale.float().reshape(-1),  # (N,) per channel or (1,) per tensor
        pertoken_scale=x_scale.float().reshape(-1).expand(m).contiguous(),  # (M,); a per-tensor scale repeated
        bias=bias.float() if bias is not None else None,
        output_dtype=out_dtype,
    )


def weight_quant_call_kwargs(x2d, wq, w_scale, bias, group: int = 0):
    """Every argument of the npu_weight_quant_batchmatmul call, by name (tests wrap this). The
    published contract: x (M, K) fp16/bf16; weight int8 (K, N), a transposed view accepted;
    antiquant_scale in x's dtype, (N,) per channel or (1,) per tensor, or per group (A2/A3)
    (ceil(K / g), N) with antiquant_group_size g a multiple of 32 in [32, K - 1]; bias (N,), fp32
    with bf16 x and fp16 with fp16 x; output in x's dtype."""
    kwargs = dict(
        x=x2d,
        weight=wq.t(),  # W is (N, K) row-major: W^T is the (K, N) transposed view the op recommends
        # per group: fx_fp8 keeps (N, ceil(K / g)) scales; the op reads them K-major
        antiquant_scale=(w_scale.t() if group else w_scale.reshape(-1)).to(x2d.dtype),
        bias=(bias.float() if x2d.dtype == torch.bfloat16 else bias.to(x2d.dtype)) if bias is not None else None,
    )
    if group:
        kwargs["antiquant_group_size"] = group
    return kwargs


def weight_quant_group(wq, weight_granularity: str, weight_block) -> Optional[int]:
    """The antiquant_group_size npu_weight_quant_batchmatmul takes for this weight: 0 (per channel
    or per tensor), g (per output channel and g input columns, g a multiple of 32 below K), or
    None when the op's contract does not cover the layout."""
    if weight_granularity in ("channel", "tensor"):
        return 0
    if weight_granularity == "block" and weight_block is not None and weight_block[0] == 1:
        g, k = int(weight_block[1]), wq.shape[1]
        if g % 32 == 0 and 32 <= g <= k - 1:
            return g
    return None


class NPULowering(Lowering):
    name = "npu"
    description = ("Ascend NPU (torch_npu, MindIE-SD): FP8 attention and FP8 W8A8 on Ascend 950, "
                   "INT8 W8A8 on Atlas A2/A3 and 950")
    fused_activation_quant = True

    # compile time (FakeTensor metadata) ---------------------------------------------------
    def attention_reason(self, q, k, v, cfg, attn_mask=None, *, need_lse: bool = False) -> Optional[str]:
        plan = attention_plan(q, k, v, cfg, attn_mask, need_lse=need_lse)
        return plan.detail if plan.kernel is None else None

    def attention_kernel(self, q, k, v, cfg, attn_mask=None, *, need_lse: bool = False) -> tuple[str, str]:
        """(kernel, description) of the path an FP8 attention node takes: bake `kernel` into the
        op call (run time then follows the compile-time choice) and show the description in the
        report. Only meaningful where attention_reason returned None."""
        plan = attention_plan(q, k, v, cfg, attn_mask, need_lse=need_lse)
        return (plan.kernel or "auto"), plan.detail

    def weight_only(self, weight, qcfg) -> Optional[str]:
        problem = import_problem()
        if problem is not None:
            return problem
        if qcfg.method == "fp8":
            problem = chip_problem()
            if problem is not None:
                return f"{problem}; FP8 W8A8 needs Ascend 950 (quantization: int8 runs W8A8 on Atlas A2/A3)"
        return None

    def linear_reason(self, x, weight, qcfg) -> Optional[str]:
        if self.weight_only(weight, qcfg) is not None:
            return None  # weight-only runs a native matmul: no kernel constraint applies
        if x.dtype not in KERNEL_OUT_DTYPES:
            return f"input dtype {x.dtype}: npu_quant_matmul outputs fp16/bf16 only (run the model in bf16/fp16)"
        if qcfg.weight_granularity == "block":
            return "block weight scales: npu_quant_matmul takes per-channel or per-tensor weight scales here"
        n, k = (concrete(s) for s in weight.shape)
        if n is None or k is None or k > MAX_MATMUL_DIM or n > MAX_MATMUL_DIM:
            return (f"features {weight.shape[1]} -> {weight.shape[0]}: npu_quant_matmul takes dims up to "
                    f"{MAX_MATMUL_DIM}")
        return None

    # run time -------------------------------------------------------------------------------
    def attention(self, q, k, v, *, attn_mask, softmax_scale, granularity, q_block, kv_block, hadamard, smooth_k,
                  quantize_p, p_scale, kernel, return_lse):
        if attn_mask is not None:
            raise ValueError("npu lowering: the FP8 attention kernels take no attention mask")
        if kernel not in KERNELS:  # the pass did not bake a path in: choose it now, as at compile time
            cfg = types.SimpleNamespace(granularity=granularity, q_block=q_block, kv_block=kv_block,
                                        quantize_p=quantize_p, p_scale=p_scale)
            plan = attention_plan(q, k, v, cfg, None, need_lse=return_lse)
            if plan.kernel is None:
                raise RuntimeError(f"npu lowering: no FP8 attention path: {plan.detail}")
            kernel = plan.kernel
        if (kernel == "fia_mx") != (granularity == "mx"):
            raise ValueError(f"npu lowering: kernel {kernel!r} does not run granularity {granularity!r}")
        if return_lse and kernel != "fia_mx":
            raise ValueError(f"npu lowering: kernel {kernel!r} returns no log-sum-exp")
        out, lse = _RUNNERS[kernel](q, k, v, softmax_scale=softmax_scale, granularity=granularity, q_block=q_block,
                                    kv_block=kv_block, hadamard=hadamard, smooth_k=smooth_k, p_scale=p_scale,
                                    return_lse=return_lse)
        return (out, lse) if return_lse else out

    def quantize_activation(self, x2d, static_scale, *, method, granularity, group=None):
        if static_scale is not None:
            return quant.quantize_activation_static(x2d, static_scale, method)
        if granularity != "token" or x2d.dtype not in KERNEL_OUT_DTYPES:
            return quant.quantize_activation(x2d, granularity, method, group)  # plain torch ops
        torch_npu = _torch_npu()
        if method == "fp8":
            xq, scale = torch_npu.npu_dynamic_quant(x2d, dst_type=quant.FP8_DTYPE)
        else:  # int8 is the op's default output, as MindIE-SD's W8A8 layers call it
            xq, scale = torch_npu.npu_dynamic_quant(x2d)
        return xq, scale.reshape(-1, 1)

    def scaled_mm(self, xq, x_scale, wq, w_scale, bias, *, method, weight_granularity, weight_block, out_dtype,
                  fast_accum=False):
        # prepared QuantizedLinear modules reach here without linear_reason having been asked
        if weight_granularity == "block":
            raise ValueError("npu lowering: block weight scales need weight-only linears on NPU "
                             "(npu_quant_matmul takes per-channel or per-tensor scales here)")
        if out_dtype not in KERNEL_OUT_DTYPES:
            raise ValueError(f"npu lowering: output dtype {out_dtype} (npu_quant_matmul outputs fp16/bf16 only)")
        torch_npu = _torch_npu()
        return torch_npu.npu_quant_matmul(**linear_call_kwargs(xq, x_scale, wq, w_scale, bias, out_dtype=out_dtype))

    def weight_only_method(self, method: str) -> str:
        # npu_weight_quant_batchmatmul takes int8 (or int4 packed in int32) weights, not FP8
        return "int8"

    def weight_only_linear(self, x2d, wq, w_scale, bias, *, method, weight_granularity, weight_block):
        group = weight_quant_group(wq, weight_granularity, weight_block)
        if wq.dtype == torch.int8 and group is not None and x2d.dtype in KERNEL_OUT_DTYPES and x2d.shape[0] > 0:
            torch_npu = _torch_npu()
            return torch_npu.npu_weight_quant_batchmatmul(**weight_quant_call_kwargs(x2d, wq, w_scale, bias, group))
        # FP8 weights, or a block layout outside the op's contract (prepared elsewhere, a W8A8 layer on a
        # skipped step, a group size that is no multiple of 32): dequantize for a native matmul
        w = quant.dequantize_weight(wq, w_scale, weight_granularity, weight_block).to(x2d.dtype)
        out = x2d @ w.t()
        return out + bias.to(out.dtype) if bias is not None else out


LOWERING = NPULowering()
