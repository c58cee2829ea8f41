"""The arguments of every vendor call the npu lowering makes, built by name (and MindIE-SD's
block quantization, called one sample at a time): the contract torch_npu and MindIE-SD
publish, and what the simulator in tests/helpers/npu_sim checks. Also the kernels' fixed facts
(block rows, quant modes, head dims, dtypes, limits).

The lowering looks these functions up through this module at call time (`npu_calls.x(...)`),
so a test can wrap one to corrupt an argument and see the simulator name the broken rule.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from fx_fp8.ops.npu_platform import import_torch_npu

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
INT_MAX = 2147483647


def kernel_head_dim(d: int) -> Optional[int]:
    """The kernel head dim a head dim d runs at (zero-padded), or None when too large."""
    for kd in KERNEL_HEAD_DIMS:
        if d <= kd:
            return kd
    return None


def pad_head_dim(x: torch.Tensor, d: int) -> torch.Tensor:
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


def p_scale_tensor(p_scale: float, device) -> torch.Tensor:
    """P is quantized as P * p_scale (P in [0, 1]), fx_fp8's p_scale convention."""
    return torch.full((1,), float(p_scale), dtype=torch.float32, device=device)


def to_tnd(x: torch.Tensor, d: int) -> torch.Tensor:
    """(B, N, S, D) -> (B * S, N, d) contiguous (TND), head dim zero-padded to d."""
    b, n, s, _ = x.shape
    return pad_head_dim(x, d).transpose(1, 2).reshape(b * s, n, d).contiguous()


# -- attention ------------------------------------------------------------------------------
def attention_call_kwargs(q, qq, sq, kq, sk, vq, sv, *, softmax_scale, granularity, q_block, kv_block, p_scale):
    """Every argument of the per-block npu_fused_infer_attention_score_v2 call, by name.
    q is the original (B, H, S, D) query; qq..sv come from quant.prepare_qkv. Tests wrap this."""
    b, h, s_q, d = qq.shape
    h_kv, s_k = kq.shape[1], kq.shape[2]
    kd = kernel_head_dim(d)
    return dict(
        query=pad_head_dim(qq, kd),
        key=pad_head_dim(kq, kd),
        value=pad_head_dim(vq, kd),
        dequant_scale_query=kernel_block_scales(sq, granularity, q_block, KERNEL_Q_BLOCK, b, h, s_q),
        dequant_scale_key=kernel_block_scales(sk, granularity, kv_block, KERNEL_KV_BLOCK, b, h_kv, s_k),
        dequant_scale_value=kernel_block_scales(sv, granularity, kv_block, KERNEL_KV_BLOCK, b, h_kv, s_k),
        quant_scale_p=p_scale_tensor(p_scale, q.device),
        num_query_heads=h,
        num_key_value_heads=h_kv,
        softmax_scale=float(softmax_scale),  # the op's default 1.0 is wrong for us: always explicit
        pre_tokens=INT_MAX,
        next_tokens=INT_MAX,
        input_layout="BNSD",  # prepare_qkv materialises new tensors in (B, N, S, D) order
        sparse_mode=0,
        query_quant_mode=BLOCK_QUANT_MODES[0],
        key_quant_mode=BLOCK_QUANT_MODES[1],
        value_quant_mode=BLOCK_QUANT_MODES[2],
        out_dtype=q.dtype,  # an `int?` in the schema: torch.ops turns a torch.dtype into its ScalarType code
    )


def mindiesd_block_quant(fa_block_quant_preprocess, x: torch.Tensor, block: int, kernel_block: int, dst_type):
    """fa_block_quant_preprocess one sample at a time (it squeezes the batch axis) ->
    (BNSD FP8 data, [B, N, ceil(S / kernel_block), 1] fp32 scales)."""
    data, scales = [], []
    for i in range(x.shape[0]):
        xq, xs = fa_block_quant_preprocess(x[i : i + 1], block_size=block, dst_type=dst_type, layout="BNSD")
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
        query=qq,
        key=kq,
        value=vq,
        input_layout="BNSD",
        num_query_heads=qq.shape[1],
        num_key_value_heads=kq.shape[1],
        softmax_scale=float(softmax_scale),
        pre_tokens=INT_MAX,
        next_tokens=INT_MAX,
        query_quant_mode=BLOCK_QUANT_MODES[0],
        key_quant_mode=BLOCK_QUANT_MODES[1],
        value_quant_mode=BLOCK_QUANT_MODES[2],
        dequant_scale_query=sq,
        dequant_scale_key=sk,
        dequant_scale_value=sv,
        quant_scale1=p_scale_tensor(p_scale, q.device),
        out_dtype=q.dtype,
    )


def mx_call_kwargs(q, qq, qs, kq, ks, vq, vs, *, b, s_q, s_k, softmax_scale, p_scale, return_lse):
    """Every argument of the MXFP8 npu_fused_infer_attention_score_v2 call, by name (tests wrap this).
    As MindIE-SD's MXFP8RotateQuantFA calls it, plus quant_scale_p (CANN: "复用quantScale1作为pScale")."""
    torch_npu = import_torch_npu()
    e8m0 = torch_npu.float8_e8m0fnu
    return dict(
        query=qq,
        key=kq,
        value=vq,
        dequant_scale_query=qs,
        dequant_scale_key=ks,
        dequant_scale_value=vs,
        actual_seq_qlen=[s_q * (i + 1) for i in range(b)],  # TND: cumulative lengths, host ints
        actual_seq_kvlen=[s_k * (i + 1) for i in range(b)],
        quant_scale_p=p_scale_tensor(p_scale, q.device),
        num_query_heads=qq.shape[1],
        num_key_value_heads=kq.shape[1],
        softmax_scale=float(softmax_scale),
        input_layout="TND",
        sparse_mode=0,
        query_quant_mode=MX_QUANT_MODES[0],
        key_quant_mode=MX_QUANT_MODES[1],
        value_quant_mode=MX_QUANT_MODES[2],
        query_dtype=torch.float8_e4m3fn,
        key_dtype=torch.float8_e4m3fn,
        value_dtype=torch.float8_e4m3fn,
        dequant_scale_query_dtype=e8m0,
        dequant_scale_key_dtype=e8m0,
        dequant_scale_value_dtype=e8m0,
        return_softmax_lse=bool(return_lse),
        out_dtype=q.dtype,
    )


# -- linears --------------------------------------------------------------------------------
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
