"""Ascend NPU lowering: FP8 attention and FP8 W8A8 linears through torch_npu.

Attention: Q/K/V are rotated, smoothed and quantized exactly as the CPU
reference does (`quant.prepare_qkv`), then handed to
`torch_npu.npu_fused_infer_attention_score_v2` in its per-block FP8 case
(float8_e4m3fn Q/K/V, query/key/value_quant_mode 7, fp32 dequant scales of
shape [B, N, ceil(S / block), 1] with 128-row Q blocks and 256-row K/V blocks,
layout BNSD, `quant_scale_p` for the probabilities, head dim 64 or 128).
Linears: `npu_dynamic_quant` (per-token FP8 activations) and
`npu_quant_matmul` (FP8 weight as x2 = W^T, per-channel fp32 scale).
FP8 kernels exist on Ascend 950 only: on Atlas A2/A3 attention stays native
and linears run weight-only (FP8 storage, native matmul).

torch_npu is imported inside the functions that call it, never when fx_fp8
is imported: installing it breaks plain torch on machines without CANN.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from fx_fp8.ops import quant
from fx_fp8.ops.lowering import Lowering

#: row blocks of the per-block FP8 attention kernel (fixed by the kernel)
KERNEL_Q_BLOCK = 128
KERNEL_KV_BLOCK = 256
#: query/key/value_quant_mode of the per-block FP8 case
BLOCK_QUANT_MODE = 7
#: head dims the FP8 kernel takes; smaller head dims are zero-padded up to one of them
KERNEL_HEAD_DIMS = (64, 128)
#: output dtypes of the FP8 attention and matmul kernels
KERNEL_OUT_DTYPES = (torch.bfloat16, torch.float16)
#: npu_quant_matmul: x1/x2 last dim limit
MAX_MATMUL_K = 65535


# -- torch_npu and the chip, looked up lazily ------------------------------------
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


def is_fp8_chip(name: str) -> bool:
    """FP8 attention/matmul kernels exist on Ascend 950 (950PR/950DT) only."""
    return "950" in name


def fp8_kernel_problem() -> Optional[str]:
    """None when this machine has the FP8 kernels, else the reason it does not."""
    problem = import_problem()
    if problem is not None:
        return problem
    try:
        name = device_name()
    except Exception as e:
        return f"cannot read the NPU name ({type(e).__name__}: {e})"
    if not is_fp8_chip(name):
        return f"{name} has no FP8 kernels (FP8 attention/matmul are Ascend 950 only; Atlas A2/A3 are INT8 only)"
    return None


def kernel_head_dim(d: int) -> Optional[int]:
    """The kernel head dim a head dim d runs at (zero-padded), or None when too large."""
    for kd in KERNEL_HEAD_DIMS:
        if d <= kd:
            return kd
    return None


# -- attention: argument building -------------------------------------------------
def kernel_block_scales(scale: torch.Tensor, granularity: str, block: int, kernel_block: int, b: int, h: int, s: int):
    """[B, N, ceil(S / kernel_block), 1] fp32 scales from prepare_qkv's
    (tensor [1,1,1] / head [B,H,1] / block [B,H,ceil(S/block)]) scales.
    Exact: every kernel block lies inside one quantization block."""
    nblk = -(-s // kernel_block)
    if granularity == "block":
        scale = scale.repeat_interleave(block // kernel_block, dim=-1)[..., :nblk]
    return scale.float().expand(b, h, nblk).unsqueeze(-1).contiguous()


def npu_attention_mask(attn_mask: Optional[torch.Tensor], b: int, s_q: int, s_k: int) -> Optional[torch.Tensor]:
    """SDPA bool mask (True = attend, broadcast to (B, H, Sq, Sk)) -> torch_npu
    mask (True = masked out), shape (B or 1, 1, Sq, Sk), contiguous."""
    if attn_mask is None:
        return None
    if attn_mask.dtype != torch.bool:
        raise ValueError(f"npu lowering: attention mask dtype {attn_mask.dtype} not supported (boolean masks only)")
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    if m.shape[1] != 1:
        raise ValueError(f"npu lowering: per-head attention mask of shape {tuple(attn_mask.shape)} not supported")
    return (~m).expand(m.shape[0], 1, s_q, s_k).contiguous()


def _pad_head_dim(x: torch.Tensor, d: int) -> torch.Tensor:
    """Zero-pad the last dim to d (exact: zero columns change neither Q.K nor P.V's first columns).
    Padded as uint8 bytes: 0x00 is +0.0 in e4m3 and byte padding works on every device."""
    x = x.contiguous()
    if x.shape[-1] == d:
        return x
    return F.pad(x.view(torch.uint8), (0, d - x.shape[-1])).view(x.dtype)


def attention_call_kwargs(q, qq, sq, kq, sk, vq, sv, *, attn_mask, softmax_scale, granularity, q_block, kv_block, p_scale):
    """Every argument of the npu_fused_infer_attention_score_v2 call, by name.

    q is the original (B, H, S, D) query (for dtype/device); qq..sv come from
    quant.prepare_qkv. Tests wrap this function to corrupt one argument.
    """
    b, h, s_q, d = qq.shape
    h_kv, s_k = kq.shape[1], kq.shape[2]
    kd = kernel_head_dim(d)
    if kd is None:
        raise ValueError(f"npu lowering: head dim {d} exceeds the FP8 kernel's {KERNEL_HEAD_DIMS[-1]}")
    return dict(
        query=_pad_head_dim(qq, kd),
        key=_pad_head_dim(kq, kd),
        value=_pad_head_dim(vq, kd),
        atten_mask=npu_attention_mask(attn_mask, b, s_q, s_k),
        dequant_scale_query=kernel_block_scales(sq, granularity, q_block, KERNEL_Q_BLOCK, b, h, s_q),
        dequant_scale_key=kernel_block_scales(sk, granularity, kv_block, KERNEL_KV_BLOCK, b, h_kv, s_k),
        dequant_scale_value=kernel_block_scales(sv, granularity, kv_block, KERNEL_KV_BLOCK, b, h_kv, s_k),
        # P is quantized as P * quant_scale_p (P in [0, 1]), our p_scale convention
        quant_scale_p=torch.full((1,), float(p_scale), dtype=torch.float32, device=q.device),
        num_query_heads=h,
        num_key_value_heads=h_kv,
        softmax_scale=float(softmax_scale),  # the op's default 1.0 is wrong for us: always explicit
        pre_tokens=2147483647,
        next_tokens=2147483647,
        input_layout="BNSD",  # prepare_qkv materialises new tensors in (B, N, S, D) order
        sparse_mode=0,
        query_quant_mode=BLOCK_QUANT_MODE,
        key_quant_mode=BLOCK_QUANT_MODE,
        value_quant_mode=BLOCK_QUANT_MODE,
        out_dtype=q.dtype,  # an `int?` in the schema: torch.ops turns a torch.dtype into its ScalarType code
    )


# -- linear: argument building ------------------------------------------------------
def quantize_activation(torch_npu, x2d: torch.Tensor, input_scale, act_granularity: str):
    """(x_fp8 [M, K], per-row fp32 scale [M]) with the reference's numerics."""
    m = x2d.shape[0]
    if input_scale is not None:  # static scale
        scale = input_scale.float().reshape(())
        return quant.cast_fp8(x2d, scale), scale.expand(m).contiguous()
    if act_granularity == "tensor":
        xq, scale = quant.quantize_per_tensor(x2d)
        return xq, scale.reshape(()).expand(m).contiguous()
    xq, scale = torch_npu.npu_dynamic_quant(x2d, dst_type=quant.FP8_DTYPE)
    return xq, scale


def linear_call_kwargs(xq, x_scale, weight, weight_scale, bias, *, out_dtype):
    """Every argument of the npu_quant_matmul call, by name (tests wrap this)."""
    return dict(
        x1=xq,
        x2=weight.t(),  # the op wants (K, N); W is (N, K) row-major, so W^T is a transposed view
        scale=weight_scale.float().reshape(-1),  # (N,) per channel or (1,) per tensor
        pertoken_scale=x_scale.float().reshape(-1),
        bias=bias,
        output_dtype=out_dtype,
    )


class NPULowering(Lowering):
    name = "npu"
    description = "Ascend NPU (torch_npu): fused FP8 attention and FP8 W8A8 matmul on Ascend 950"

    # compile time (FakeTensor metadata) --------------------------------------
    def attention_reason(self, q, k, v, cfg, attn_mask=None) -> Optional[str]:
        problem = fp8_kernel_problem()
        if problem is not None:
            return f"{problem}: attention stays native"
        if q.dtype not in KERNEL_OUT_DTYPES:
            return f"query dtype {q.dtype}: the FP8 attention kernel outputs fp16/bf16 only (run the model in bf16/fp16)"
        if q.shape[2] < 2:
            return "query length 1 (the op's incremental-decoding branch has no per-block FP8 case)"
        d = q.shape[-1]
        if v.shape[-1] != d:
            return f"value head dim {v.shape[-1]} != query head dim {d} (the FP8 kernel needs equal head dims)"
        if kernel_head_dim(d) is None:
            return f"head dim {d} > {KERNEL_HEAD_DIMS[-1]} (the FP8 kernel takes head dims {' or '.join(map(str, KERNEL_HEAD_DIMS))})"
        if cfg.granularity == "block" and (cfg.q_block % KERNEL_Q_BLOCK or cfg.kv_block % KERNEL_KV_BLOCK):
            return (f"block scales q_block={cfg.q_block}/kv_block={cfg.kv_block}: the FP8 kernel's scale blocks are "
                    f"{KERNEL_Q_BLOCK}/{KERNEL_KV_BLOCK} rows (use multiples of them)")
        if not cfg.quantize_p:
            return "quantize_p=False: the fused FP8 kernel always quantizes P (the CPU reference can run without)"
        if attn_mask is not None:
            if attn_mask.dtype != torch.bool:
                return f"additive ({attn_mask.dtype}) attention mask: the NPU kernel takes boolean masks only"
            if attn_mask.dim() >= 3 and attn_mask.shape[-3] != 1:  # SDPA broadcasts dim -3 over heads
                return f"per-head attention mask {tuple(attn_mask.shape)}: the NPU kernel takes one mask for all heads"
        return None

    def linear_reason(self, x, weight, qcfg) -> Optional[str]:
        if qcfg.method == "int8":
            return "INT8 W8A8 (quantization: int8) is not implemented in the npu lowering"
        if self.weight_only(weight) is not None:
            return None  # weight-only runs a native matmul: no kernel constraint applies
        if x.dtype not in KERNEL_OUT_DTYPES:
            return f"input dtype {x.dtype}: npu_quant_matmul outputs fp16/bf16 only (run the model in bf16/fp16)"
        if qcfg.weight_granularity == "block":
            return "block weight scales: npu_quant_matmul takes per-channel or per-tensor FP8 weight scales"
        if weight.shape[1] > MAX_MATMUL_K:
            return f"in_features {weight.shape[1]} > {MAX_MATMUL_K} (npu_quant_matmul limit)"
        return None

    def weight_only(self, weight) -> Optional[str]:
        return fp8_kernel_problem()

    # run time -------------------------------------------------------------------
    def attention(self, q, k, v, *, attn_mask, softmax_scale, granularity, q_block, kv_block, hadamard, smooth_k, quantize_p, p_scale):
        torch_npu = _torch_npu()
        qq, sq, kq, sk, vq, sv = quant.prepare_qkv(
            q, k, v, granularity=granularity, q_block=q_block, kv_block=kv_block, hadamard=hadamard, smooth_k=smooth_k
        )
        kwargs = attention_call_kwargs(q, qq, sq, kq, sk, vq, sv, attn_mask=attn_mask, softmax_scale=softmax_scale,
                                       granularity=granularity, q_block=q_block, kv_block=kv_block, p_scale=p_scale)
        out = torch_npu.npu_fused_infer_attention_score_v2(**kwargs)[0]
        # BNSD output; trim sequence padding the op may add and the head-dim padding we added
        return out[:, :, : q.shape[2], : v.shape[-1]]

    def linear(self, x, weight, weight_scale, bias, input_scale, *, weight_granularity, weight_block, act_granularity, weight_only):
        x2d = x.reshape(-1, x.shape[-1])
        if weight_only:
            w = quant.dequantize_weight(weight, weight_scale, weight_granularity, weight_block).to(x.dtype)
            out = x2d @ w.t()
            if bias is not None:
                out = out + bias.to(out.dtype)
        else:
            # prepared FP8Linear modules reach here without linear_reason having been asked
            if weight_granularity == "block":
                raise ValueError("npu lowering: block weight scales need weight-only FP8 on NPU "
                                 "(npu_quant_matmul takes per-channel or per-tensor scales)")
            if x.dtype not in KERNEL_OUT_DTYPES:
                raise ValueError(f"npu lowering: input dtype {x.dtype} (npu_quant_matmul outputs fp16/bf16 only)")
            torch_npu = _torch_npu()
            xq, xs = quantize_activation(torch_npu, x2d, input_scale, act_granularity)
            out = torch_npu.npu_quant_matmul(**linear_call_kwargs(xq, xs, weight, weight_scale, bias, out_dtype=x.dtype))
        return out.reshape(*x.shape[:-1], weight.shape[0])


LOWERING = NPULowering()
