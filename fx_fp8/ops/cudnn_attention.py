"""Optional cuDNN FP8 attention through nvidia-cudnn-frontend (fx-fp8's `cuda` extra: `pip install -e ".[cuda]"`).

cuDNN's FP8 SDPA (`graph.sdpa_fp8`) takes one descale factor per tensor for
Q, K and V, a scale / descale pair for the probabilities (cuDNN's S, our P)
and a scale for the output O, which it writes in FP8 (the documented O data
type of the FP8 forward is E4M3 / E5M2). The pre-pass is the reference's
with per-tensor scales: K smoothed (its mean over tokens removed), Q and K
Hadamard-rotated, Q / K / V quantized with one scale each (the Triton kernels
of `triton_quant`, scales stay on the device: no host sync); then

    descale_q, descale_k, descale_v = sq, sk, sv
    scale_s = p_scale, descale_s = 1 / p_scale       P in [0, 1] quantized as e4m3(P * p_scale)
    scale_o = 1 / sv                                 |O| <= max |V| (O is a convex combination of
                                                     V's rows), so O fits in e4m3 with V's scale
    O = O_fp8 * sv in the query dtype; LSE = cuDNN's Stats (max + ln(sum exp), natural log).

Numerics: the reference at granularity "tensor" (`quant.prepare_qkv` +
`quant.attention_from_fp8`), plus the e4m3 rounding of O (`emulate` below).
SQNR against float64 attention, B1 H8 S1024 D128, Q/K/V ~ N(0, 1), "x5" =
four channels of Q and K scaled by 5 (tests/ops/test_attention_numerics.py's
inputs and its 25 dB bar), measured with the CPU reference:

    recipe                                          Gaussian   x5 outliers
    block 128/256 + Hadamard + smooth K (the bar)   25.57 dB   25.65 dB
    tensor + Hadamard + smooth K, bf16 O            25.57 dB   25.67 dB
    tensor + Hadamard + smooth K, FP8 O (cuDNN)     24.59 dB   24.71 dB

The e4m3 output costs ~1 dB and puts cuDNN's FP8 SDPA below the bar on both
inputs, so the default of `attention.kernel: auto` (`cuda.AUTO_KERNEL`) is the
Triton kernel and cuDNN an opt-in (`attention.kernel: cudnn`, with
`attention.granularity: tensor`); auto picks cuDNN only where the measured table
(`attention_table`) shows it fastest within 1.5x of the reference's error on
that GPU and the node uses per-tensor scales. tests/ops/test_cuda_cudnn.py
re-measures the SQNR and fails if the default and the measurement disagree.

cudnn is imported lazily, only here; a missing package, GPU or cuDNN
backend is a reason in `attention_reason`, never an import error.
"""

from __future__ import annotations

from typing import Optional

import torch

from fx_fp8.graph.shapes import concrete, size_str
from fx_fp8.ops import quant

#: the bar of tests/ops/test_attention_numerics.py (Gaussian and x5-outlier inputs)
SQNR_BAR_DB = 25.0
#: cuDNN backend version with the FP8 SDPA forward (cudnn-frontend 1.3's sdpa_fp8 needs cuDNN 9.1)
MIN_CUDNN_BACKEND = 90100
#: head dims the pre-pass's Hadamard kernel takes (powers of two); cuDNN needs multiples of 16, at most 256
HEAD_DIMS = (16, 32, 64, 128, 256)
SCALAR_INPUTS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")


def import_cudnn():
    import cudnn  # noqa: F401  nvidia-cudnn-frontend; lazy on purpose (optional dependency)

    return cudnn


def import_reason() -> Optional[str]:
    try:
        import_cudnn()
    except Exception as e:  # ImportError, or a frontend that cannot load its cuDNN backend
        from fx_fp8.install_hint import install_hint

        return f"nvidia-cudnn-frontend not importable ({type(e).__name__}: {e}); {install_hint('cuda')}"
    return None


def attention_reason(q, k, v, cfg, attn_mask=None, *, need_lse: bool = False) -> Optional[str]:
    """Why cuDNN's FP8 SDPA cannot run this attention (FakeTensor metadata), or None. need_lse is
    supported (cuDNN's Stats)."""
    if q.device.type != "cuda":
        return f"needs CUDA tensors (got device {q.device.type!r})"
    major, minor = torch.cuda.get_device_capability(q.device)
    if major < 9:
        return f"GPU sm{major}{minor}: cuDNN's FP8 SDPA needs sm90 (Hopper) or newer"
    reason = import_reason()
    if reason:
        return reason
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if version is None or version < MIN_CUDNN_BACKEND:
        return f"cuDNN backend {version} has no FP8 SDPA (needs {MIN_CUDNN_BACKEND} or newer)"
    if cfg.granularity != "tensor":
        return (
            f"cuDNN's FP8 SDPA takes per-tensor scales, attention.granularity is {cfg.granularity!r} "
            "(set it to 'tensor', or use attention.kernel: triton for the block recipe)"
        )
    if not cfg.quantize_p:
        return "cuDNN's FP8 SDPA always quantizes P (attention.quantize_p must be true)"
    d, dv = concrete(q.shape[-1]), concrete(v.shape[-1])
    if d not in HEAD_DIMS or dv != d:
        return (
            f"head dim {size_str(q.shape[-1])} (value {size_str(v.shape[-1])}) not supported (needs one of {HEAD_DIMS})"
        )
    if attn_mask is not None:
        return "attention masks are not supported on the cuDNN FP8 path"
    return None


# -- arguments and numerics (CPU-testable) ---------------------------------------------
def scale_tensors(sq: torch.Tensor, sk: torch.Tensor, sv: torch.Tensor, p_scale: float) -> dict[str, torch.Tensor]:
    """The six fp32 (1, 1, 1, 1) scalar inputs of sdpa_fp8 from the per-tensor scales."""
    one = torch.ones((1, 1, 1, 1), dtype=torch.float32, device=sv.device)
    v = sv.float().reshape(1, 1, 1, 1)
    return {
        "descale_q": sq.float().reshape(1, 1, 1, 1).contiguous(),
        "descale_k": sk.float().reshape(1, 1, 1, 1).contiguous(),
        "descale_v": v.contiguous(),
        "descale_s": one / float(p_scale),
        "scale_s": one * float(p_scale),
        "scale_o": (1.0 / v).contiguous(),
    }


def emulate(
    q,
    k,
    v,
    *,
    softmax_scale: float,
    hadamard: bool = True,
    smooth_k: bool = True,
    p_scale: float = 448.0,
    return_lse: bool = False,
):
    """The cuDNN path's numerics on any device: the reference at per-tensor granularity, then O
    rounded to e4m3 with scale_o = 1 / sv. Output in q's dtype."""
    qq, sq, kq, sk, vq, sv = quant.prepare_qkv(
        q, k, v, granularity="tensor", q_block=1, kv_block=1, hadamard=hadamard, smooth_k=smooth_k
    )
    res = quant.attention_from_fp8(
        qq,
        sq,
        kq,
        sk,
        vq,
        sv,
        softmax_scale=softmax_scale,
        q_block=1,
        kv_block=1,
        quantize_p=True,
        p_scale=p_scale,
        out_dtype=torch.float32,
        return_lse=return_lse,
    )
    out, lse = res if return_lse else (res, None)
    if return_lse and smooth_k:
        lse = lse + quant.smoothing_lse_shift(q, k, softmax_scale)
    so = sv.reshape(())
    out = (quant.cast_fp8(out, so).float() * so).to(q.dtype)
    return (out, lse) if return_lse else out


# -- the cuDNN graph ----------------------------------------------------------------------
def build_graph(
    cudnn,
    *,
    shape_q,
    stride_q,
    shape_k,
    stride_k,
    stride_v,
    stride_o,
    softmax_scale: float,
    need_lse: bool,
    handle=None,
    fp8_output: bool = True,
):
    """Build and plan the sdpa_fp8 graph. Returns (graph, named graph tensors). Shapes are
    (B, H, S, D); strides in elements; O is FP8 E4M3 with O's strides (BF16 with fp8_output=False:
    not in cuDNN's documented FP8 support matrix; benchmarks/attention_kernels.py tries whether the
    installed cuDNN accepts it, with scale_o = 1); Stats (B, H, Sq, 1) fp32."""
    fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    kwargs = dict(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32)
    if handle is not None:
        kwargs["handle"] = handle
    graph = cudnn.pygraph(**kwargs)
    b, h, s_q, d = shape_q
    t = {
        "q": graph.tensor(name="q", dim=list(shape_q), stride=list(stride_q), data_type=fp8),
        "k": graph.tensor(name="k", dim=list(shape_k), stride=list(stride_k), data_type=fp8),
        "v": graph.tensor(name="v", dim=list(shape_k), stride=list(stride_v), data_type=fp8),
    }
    for name in SCALAR_INPUTS:
        t[name] = graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
    op = dict(
        q=t["q"],
        k=t["k"],
        v=t["v"],
        **{n: t[n] for n in SCALAR_INPUTS},
        attn_scale=float(softmax_scale),
        use_causal_mask=False,
        name="fx_fp8_sdpa_fp8",
    )
    try:
        o, stats, amax_s, amax_o = graph.sdpa_fp8(**op, generate_stats=need_lse)
    except TypeError:  # frontends before 1.13 name it is_inference (the negation)
        o, stats, amax_s, amax_o = graph.sdpa_fp8(**op, is_inference=not need_lse)
    o.set_output(True).set_dim([b, h, s_q, d]).set_stride(list(stride_o)).set_data_type(
        fp8 if fp8_output else cudnn.data_type.BFLOAT16
    )
    t["o"] = o
    if need_lse:
        stats.set_output(True).set_dim([b, h, s_q, 1]).set_stride([h * s_q, s_q, 1, 1]).set_data_type(f32)
        t["stats"] = stats
    for name, amax in (("amax_s", amax_s), ("amax_o", amax_o)):
        amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        t[name] = amax
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph, t


def variant_pack(t: dict, tensors: dict[str, torch.Tensor]) -> dict:
    """graph tensor -> device tensor for graph.execute. FP8 data goes as uint8 views (older
    frontends do not know torch's float8 dtypes; cuDNN reads the bytes with the graph's type)."""
    pack = {}
    for name, gt in t.items():
        x = tensors[name]
        pack[gt] = x.view(torch.uint8) if x.dtype == quant.FP8_DTYPE else x
    return pack


class CudnnFP8Attention:
    """Runs the cuDNN FP8 SDPA; owns the built graphs (one per shape / layout / LSE flag) and the
    cuDNN handles (one per device). Made by the CUDA lowering on first use."""

    def __init__(self):
        self._graphs: dict[tuple, tuple] = {}
        self._handles: dict[int, object] = {}

    def _handle(self, cudnn, device: torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._handles:
            with torch.cuda.device(index):
                self._handles[index] = cudnn.create_handle()
        return self._handles[index]

    def attention(
        self, q, k, v, *, attn_mask, softmax_scale, granularity, hadamard, smooth_k, quantize_p, p_scale, return_lse
    ):
        from fx_fp8.ops import triton_quant

        if attn_mask is not None:
            raise ValueError("fx_fp8 cuDNN FP8 attention takes no attention mask")
        if granularity != "tensor" or not quantize_p:
            raise ValueError(
                "fx_fp8 cuDNN FP8 attention needs attention.granularity 'tensor' and quantize_p true "
                f"(got {granularity!r}, quantize_p={quantize_p})"
            )
        cudnn = import_cudnn()
        qq, sq, kq, sk, vq, sv, shift = triton_quant.prepare_qkv(
            q,
            k,
            v,
            granularity="tensor",
            q_block=1,
            kv_block=1,
            hadamard=hadamard,
            smooth_k=smooth_k,
            pad=False,
            transpose_v=False,
            lse_shift=return_lse,
        )
        b, h, s_q, d = qq.shape
        o8 = torch.empty((b, h, s_q, d), dtype=quant.FP8_DTYPE, device=q.device)
        handle = self._handle(cudnn, q.device)
        key = (
            str(q.device),
            tuple(qq.shape),
            tuple(qq.stride()),
            tuple(kq.shape),
            tuple(kq.stride()),
            tuple(vq.stride()),
            float(softmax_scale),
            bool(return_lse),
        )
        if key not in self._graphs:
            self._graphs[key] = build_graph(
                cudnn,
                shape_q=qq.shape,
                stride_q=qq.stride(),
                shape_k=kq.shape,
                stride_k=kq.stride(),
                stride_v=vq.stride(),
                stride_o=o8.stride(),
                softmax_scale=softmax_scale,
                need_lse=return_lse,
                handle=handle,
            )
        graph, t = self._graphs[key]
        tensors = dict(
            q=qq,
            k=kq,
            v=vq,
            o=o8,
            **scale_tensors(sq, sk, sv, p_scale),
            amax_s=torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device),
            amax_o=torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device),
        )
        lse = None
        if return_lse:
            lse = torch.empty((b, h, s_q, 1), dtype=torch.float32, device=q.device)
            tensors["stats"] = lse
        workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=q.device)
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
        graph.execute(variant_pack(t, tensors), workspace, handle=handle)
        out = o8.to(q.dtype) * sv.reshape(())  # 0-dim scale: computed in fp32, one rounding to q's dtype
        if not return_lse:
            return out
        lse = lse.squeeze(-1)  # of the smoothed scores: add back what smoothing removed, as the reference
        return out, (lse + shift * softmax_scale if shift is not None else lse)
