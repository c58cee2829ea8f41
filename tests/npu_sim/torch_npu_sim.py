"""A stand-in `torch_npu` that checks every argument against the published op contracts.

Written from /work/shared/reference/torch_npu.md and the op-plugin / CANN docs
(npu_fused_infer_attention_score_v2, npu_dynamic_quant, npu_quant_matmul),
never from fx_fp8's code: it imports nothing from fx_fp8, so a wrong constant in
the library cannot be wrong here too. Each op validates its arguments, raises
SimulatedContractError naming the violated rule, then computes the result with
plain float32 CPU math (dequantize, attention / matmul in fp32).

Scope: the cases fx_fp8 targets. Attention: the FP8 e4m3 per-block case of the
v2 op (q/k/v float8_e4m3fn, query/key/value_quant_mode 7, fp32 dequant scales
[B, N, ceil(S/128 or 256), 1], BNSD or BSND, head dim 64 or 128, quant_scale_p,
out_dtype fp16/bf16). Matmul: FP8 (Ascend 950) or INT8 x1/x2, 2-D x2.
Anything else raises SimulatedContractError with rule "not-simulated".

The module object is installed into sys.modules["torch_npu"] only inside tests
(`installed()`); it never exists on disk under the name torch_npu.
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import math
import sys
import types
from collections import Counter

import torch

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
INT8_MAX = 127.0
# torch_npu's pseudo dtypes are plain ints (ACL enum + 256), not torch.dtype
HIFLOAT8, FLOAT8_E5M2, FLOAT8_E4M3FN, FLOAT8_E8M0FNU = 290, 291, 292, 293

Q_BLOCK, KV_BLOCK = 128, 256        # row blocks of the per-block FP8 attention case
BLOCK_QUANT_MODE = 7
FP8_HEAD_DIMS = (64, 128)
OUT_DTYPES = (torch.float16, torch.bfloat16)
MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
MAX_K = 65535
INT_MAX = 2147483647


class SimulatedContractError(RuntimeError):
    """An argument the real op would reject (or silently misread); `rule` names the rule."""

    def __init__(self, op: str, rule: str, detail: str):
        self.op, self.rule = op, rule
        super().__init__(f"{op}: contract rule [{rule}] violated: {detail}")


def _is_fp8_chip(name: str) -> bool:
    return "950" in name


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Checker:
    def __init__(self, op: str):
        self.op = op

    def fail(self, rule: str, detail: str):
        raise SimulatedContractError(self.op, rule, detail)

    def require(self, cond: bool, rule: str, detail: str):
        if not cond:
            self.fail(rule, detail)


# -- npu_fused_infer_attention_score_v2 ------------------------------------------------
def _check_scale(c: _Checker, name: str, t, expected_shape: tuple, device):
    c.require(t is not None, "dequant-scale-missing", f"{name} is required for FP8 inputs (quant mode {BLOCK_QUANT_MODE})")
    c.require(isinstance(t, torch.Tensor), "dequant-scale-dtype", f"{name} must be a tensor, got {type(t).__name__}")
    c.require(t.dtype == torch.float32, "dequant-scale-dtype", f"{name} must be float32, got {t.dtype}")
    c.require(tuple(t.shape) == expected_shape, "dequant-scale-shape",
              f"{name} must have shape [B, N, ceil(S/block), 1] = {list(expected_shape)}, got {list(t.shape)}")
    c.require(t.is_contiguous(), "dequant-scale-shape", f"{name} must be contiguous")
    c.require(t.device == device, "device", f"{name} on {t.device}, query on {device}")
    c.require(bool(torch.isfinite(t).all()) and bool((t > 0).all()), "dequant-scale-value", f"{name} must be finite and > 0")


def _check_mask(c: _Checker, mask, b: int, s_q: int, s_k: int, device):
    c.require(isinstance(mask, torch.Tensor), "mask-dtype", f"atten_mask must be a tensor, got {type(mask).__name__}")
    c.require(mask.dtype in MASK_DTYPES, "mask-dtype",
              f"atten_mask dtype {mask.dtype} (bool/int8/uint8 only; True = masked out, the opposite of SDPA)")
    allowed = [(s_q, s_k), (1, s_q, s_k), (b, 1, s_q, s_k), (1, 1, s_q, s_k)]
    c.require(tuple(mask.shape) in allowed, "mask-shape",
              f"atten_mask shape {list(mask.shape)} not one of {[list(a) for a in allowed]} (sparse_mode 0)")
    c.require(mask.is_contiguous(), "mask-contiguous", "atten_mask must be contiguous")
    c.require(mask.device == device, "device", f"atten_mask on {mask.device}, query on {device}")


def _rows(scale: torch.Tensor, block: int, s: int) -> torch.Tensor:
    """[B, N, nblk, 1] block scales -> [B, N, S, 1] per-row scales."""
    return scale.repeat_interleave(block, dim=2)[:, :, :s]


def make_attention_op(sim):
    def npu_fused_infer_attention_score_v2(
        query, key, value, *, query_rope=None, key_rope=None, pse_shift=None, atten_mask=None,
        actual_seq_qlen=None, actual_seq_kvlen=None, block_table=None, dequant_scale_query=None,
        dequant_scale_key=None, dequant_offset_key=None, dequant_scale_value=None, dequant_offset_value=None,
        dequant_scale_key_rope=None, quant_scale_out=None, quant_offset_out=None, quant_scale_p=None,
        learnable_sink=None, num_query_heads=1, num_key_value_heads=0, softmax_scale=1.0,
        pre_tokens=INT_MAX, next_tokens=INT_MAX, input_layout="BSH", sparse_mode=0, block_size=0,
        query_quant_mode=0, key_quant_mode=0, value_quant_mode=0, inner_precise=0, return_softmax_lse=False,
        query_dtype=None, key_dtype=None, value_dtype=None, query_rope_dtype=None, key_rope_dtype=None,
        key_shared_prefix_dtype=None, value_shared_prefix_dtype=None, dequant_scale_query_dtype=None,
        dequant_scale_key_dtype=None, dequant_scale_value_dtype=None, dequant_scale_key_rope_dtype=None,
        out_dtype=None,
    ):
        op = "npu_fused_infer_attention_score_v2"
        c = _Checker(op)
        for name, t in (("query", query), ("key", key), ("value", value)):
            c.require(isinstance(t, torch.Tensor), "qkv-dtype", f"{name} must be a tensor")
        if query.dtype == torch.uint8 or query_dtype is not None:
            c.fail("not-simulated", "HiFloat8 (uint8 + query_dtype) inputs are not simulated")
        c.require(query.dtype == FP8 and key.dtype == FP8 and value.dtype == FP8, "qkv-dtype",
                  f"the FP8 case needs float8_e4m3fn query/key/value, got {query.dtype}/{key.dtype}/{value.dtype}")
        c.require(_is_fp8_chip(sim.chip), "chip", f"{sim.chip} has no FP8 attention kernel (Ascend 950 only)")
        extras = dict(query_rope=query_rope, key_rope=key_rope, pse_shift=pse_shift, actual_seq_qlen=actual_seq_qlen,
                      actual_seq_kvlen=actual_seq_kvlen, block_table=block_table, dequant_offset_key=dequant_offset_key,
                      dequant_offset_value=dequant_offset_value, dequant_scale_key_rope=dequant_scale_key_rope,
                      quant_scale_out=quant_scale_out, quant_offset_out=quant_offset_out, learnable_sink=learnable_sink,
                      key_dtype=key_dtype, value_dtype=value_dtype, query_rope_dtype=query_rope_dtype,
                      key_rope_dtype=key_rope_dtype, dequant_scale_query_dtype=dequant_scale_query_dtype,
                      dequant_scale_key_dtype=dequant_scale_key_dtype, dequant_scale_value_dtype=dequant_scale_value_dtype)
        given = sorted(k for k, v in extras.items() if v is not None)
        c.require(not given, "unsupported-argument", f"{given} are not part of the per-block FP8 case")
        c.require(block_size == 0, "unsupported-argument", f"block_size={block_size} (paged KV) is not part of the per-block FP8 case")
        c.require(not return_softmax_lse, "not-simulated", "return_softmax_lse=True is not simulated")

        # layout: the label must agree with the tensors' shapes
        c.require(input_layout in ("BNSD", "BSND"), "layout",
                  f"input_layout {input_layout!r}: the per-block FP8 case takes BNSD or BSND")
        for name, t in (("query", query), ("key", key), ("value", value)):
            c.require(t.dim() == 4, "layout", f"{input_layout} needs 4-D {name}, got {t.dim()}-D")
            c.require(t.is_contiguous(), "contiguous", f"{name} must be contiguous (the op reads {input_layout} memory order)")
            c.require(t.device == query.device, "device", f"{name} on {t.device}, query on {query.device}")
        c.require(isinstance(num_query_heads, int) and not isinstance(num_query_heads, bool) and num_query_heads > 0,
                  "heads", f"num_query_heads must be a positive int, got {num_query_heads!r}")
        c.require(isinstance(num_key_value_heads, int) and num_key_value_heads >= 0, "heads",
                  f"num_key_value_heads must be an int >= 0, got {num_key_value_heads!r}")
        n_kv = num_key_value_heads or num_query_heads
        head_axis, seq_axis = (1, 2) if input_layout == "BNSD" else (2, 1)
        c.require(query.shape[head_axis] == num_query_heads, "layout-heads",
                  f"{input_layout} query shape {list(query.shape)}: axis {head_axis} = {query.shape[head_axis]} "
                  f"!= num_query_heads={num_query_heads}")
        c.require(key.shape[head_axis] == n_kv, "layout-heads",
                  f"{input_layout} key shape {list(key.shape)}: axis {head_axis} = {key.shape[head_axis]} "
                  f"!= num_key_value_heads={n_kv}")
        c.require(num_query_heads % n_kv == 0 and num_query_heads // n_kv <= 64, "heads",
                  f"num_query_heads={num_query_heads} must be a multiple (<= 64x) of num_key_value_heads={n_kv}")
        c.require(tuple(key.shape) == tuple(value.shape), "kv-shape", f"key {list(key.shape)} != value {list(value.shape)}")
        b, d = query.shape[0], query.shape[3]
        s_q, s_k = query.shape[seq_axis], key.shape[seq_axis]
        c.require(key.shape[0] == b, "kv-shape", f"batch of key {key.shape[0]} != query {b}")
        c.require(key.shape[3] == d, "head-dim", f"key head dim {key.shape[3]} != query head dim {d}")
        c.require(d in FP8_HEAD_DIMS, "head-dim", f"head dim {d}: the FP8 kernel takes {FP8_HEAD_DIMS}")
        c.require(s_q >= 2, "query-length", "query length 1 enters the incremental branch (no per-block FP8 case)")

        modes = (query_quant_mode, key_quant_mode, value_quant_mode)
        c.require(modes == (BLOCK_QUANT_MODE,) * 3, "quant-mode",
                  f"query/key/value_quant_mode {modes}: the per-block FP8 case is {(BLOCK_QUANT_MODE,) * 3}")
        _check_scale(c, "dequant_scale_query", dequant_scale_query, (b, num_query_heads, _cdiv(s_q, Q_BLOCK), 1), query.device)
        _check_scale(c, "dequant_scale_key", dequant_scale_key, (b, n_kv, _cdiv(s_k, KV_BLOCK), 1), query.device)
        _check_scale(c, "dequant_scale_value", dequant_scale_value, (b, n_kv, _cdiv(s_k, KV_BLOCK), 1), query.device)

        c.require(quant_scale_p is not None, "quant-scale-p-missing", "quant_scale_p (the P scale) is required for FP8 full quant")
        c.require(isinstance(quant_scale_p, torch.Tensor) and quant_scale_p.dtype == torch.float32
                  and quant_scale_p.numel() == 1, "quant-scale-p",
                  f"quant_scale_p must be a 1-element float32 tensor, got {quant_scale_p!r}")
        p_scale = float(quant_scale_p.reshape(()))
        c.require(0 < p_scale <= E4M3_MAX, "quant-scale-p", f"quant_scale_p={p_scale}: P*quant_scale_p must stay in e4m3 range (0, 448]")

        c.require(isinstance(softmax_scale, (int, float)) and not isinstance(softmax_scale, bool)
                  and math.isfinite(softmax_scale) and softmax_scale > 0, "softmax-scale",
                  f"softmax_scale must be a finite positive float, got {softmax_scale!r}")
        c.require(not (softmax_scale == 1.0 and d != 1), "softmax-scale-default",
                  f"softmax_scale=1.0 (the op's default) with head dim {d}: pass 1/sqrt(head_dim) or the model's scale")

        c.require(out_dtype is not None, "out-dtype", "out_dtype is required for FP8 inputs (the op would default to float16)")
        c.require(out_dtype in OUT_DTYPES, "out-dtype", f"out_dtype {out_dtype!r}: FP8 attention outputs float16 or bfloat16")

        c.require(sparse_mode == 0, "sparse-mode", f"sparse_mode={sparse_mode}: only 0 (explicit or no mask) is simulated")
        c.require(inner_precise in (0, 1, 2, 3), "inner-precise", f"inner_precise={inner_precise} not in 0..3")
        if atten_mask is not None:
            _check_mask(c, atten_mask, b, s_q, s_k, query.device)

        # numerics: dequantize, scores in fp32, P quantized as P * quant_scale_p
        q, k, v = (t.float() for t in (query, key, value))
        if input_layout == "BSND":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        group = num_query_heads // n_kv
        sk = _rows(dequant_scale_key, KV_BLOCK, s_k).repeat_interleave(group, dim=1)
        sv = _rows(dequant_scale_value, KV_BLOCK, s_k).repeat_interleave(group, dim=1)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) * _rows(dequant_scale_query, Q_BLOCK, s_q) * sk.transpose(-1, -2) * softmax_scale
        if atten_mask is not None:
            scores = scores.masked_fill(atten_mask.bool(), float("-inf"))
        p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        row_sum = p.sum(dim=-1, keepdim=True)
        p_q = (p * p_scale).to(FP8).float()
        out = (p_q @ (v * sv)) / (row_sum * p_scale)
        if sim.pad_output_rows:  # some builds hand back a block-padded sequence axis: callers must trim
            pad = _cdiv(s_q, sim.pad_output_rows) * sim.pad_output_rows - s_q
            out = torch.nn.functional.pad(out, (0, 0, 0, pad), value=float("nan"))
        if input_layout == "BSND":
            out = out.transpose(1, 2)
        sim.calls[op] += 1
        sim.last_kwargs[op] = dict(input_layout=input_layout, num_query_heads=num_query_heads,
                                   num_key_value_heads=num_key_value_heads, softmax_scale=softmax_scale,
                                   quant_scale_p=p_scale, out_dtype=out_dtype, head_dim=d)
        return out.to(out_dtype).contiguous(), torch.empty(0, dtype=torch.float32, device=query.device)

    return npu_fused_infer_attention_score_v2


# -- npu_dynamic_quant -------------------------------------------------------------------
def make_dynamic_quant_op(sim):
    def npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken",
                          dst_type_max=0.0):
        op = "npu_dynamic_quant"
        c = _Checker(op)
        c.require(isinstance(input, torch.Tensor), "input-dtype", "input must be a tensor")
        c.require(input.dtype in OUT_DTYPES, "input-dtype", f"input dtype {input.dtype}: float16/bfloat16 only")
        c.require(input.dim() > 1, "input-rank", f"input must have more than 1 dim, got {input.dim()}")
        c.require(not (isinstance(dst_type, int) and not isinstance(dst_type, bool)), "dst-type",
                  f"dst_type={dst_type!r} is an int pseudo dtype: FP8 e4m3 uses the native torch.float8_e4m3fn")
        dst = torch.int8 if dst_type is None else dst_type
        c.require(dst in (torch.int8, FP8), "dst-type", f"dst_type {dst_type!r}: int8 or torch.float8_e4m3fn")
        if dst == FP8:
            c.require(_is_fp8_chip(sim.chip), "chip", f"{sim.chip} cannot quantize to FP8 (Ascend 950 only)")
        c.require(smooth_scales is None and group_index is None, "not-simulated", "smooth_scales/group_index are not simulated")
        c.require(quant_mode == "pertoken", "quant-mode", f"quant_mode={quant_mode!r}: only 'pertoken' is simulated")
        c.require(dst_type_max == 0.0, "not-simulated", "dst_type_max is not simulated")
        top = E4M3_MAX if dst == FP8 else INT8_MAX
        x = input.float()
        scale = x.abs().amax(dim=-1) / top
        y = (x / scale.unsqueeze(-1)).clamp(-top, top)
        y = y.to(FP8) if dst == FP8 else torch.round(y).to(torch.int8)
        sim.calls[op] += 1
        return y, scale

    return npu_dynamic_quant


# -- npu_quant_matmul ----------------------------------------------------------------------
def make_quant_matmul_op(sim):
    def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                         x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None,
                         group_sizes=None, y_scale=None):
        op = "npu_quant_matmul"
        c = _Checker(op)
        c.require(isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor), "x-dtype", "x1 and x2 must be tensors")
        c.require(x1.dtype == x2.dtype and x1.dtype in (FP8, torch.int8), "x-dtype",
                  f"x1/x2 dtypes {x1.dtype}/{x2.dtype}: both float8_e4m3fn (Ascend 950) or both int8")
        if x1.dtype == FP8:
            c.require(_is_fp8_chip(sim.chip), "chip", f"{sim.chip} has no FP8 matmul (Ascend 950 only)")
        extras = dict(offset=offset, x1_dtype=x1_dtype, x2_dtype=x2_dtype, pertoken_scale_dtype=pertoken_scale_dtype,
                      scale_dtype=scale_dtype, group_sizes=group_sizes, y_scale=y_scale)
        given = sorted(k for k, v in extras.items() if v is not None)
        c.require(not given, "unsupported-argument", f"{given} are not part of the per-token x per-channel case")
        c.require(2 <= x1.dim() <= 6, "x1-rank", f"x1 must have 2-6 dims, got {x1.dim()}")
        c.require(x2.dim() == 2, "not-simulated", f"only 2-D x2 (K, N) is simulated, got {x2.dim()}-D")
        k, n = x2.shape
        c.require(x1.shape[-1] == k, "k-mismatch",
                  f"x1 {list(x1.shape)} @ x2 {list(x2.shape)}: x2 must be (K, N) with K = x1's last dim ({x1.shape[-1]})")
        c.require(k <= MAX_K and n <= MAX_K, "k-limit", f"last dims must not exceed {MAX_K}")
        c.require(x2.is_contiguous() or x2.t().is_contiguous(), "x2-layout",
                  "x2 must be contiguous (K, N) or the transpose of a contiguous (N, K) weight")
        c.require(isinstance(scale, torch.Tensor) and scale.dtype == torch.float32, "scale-dtype",
                  f"scale must be a float32 tensor, got {getattr(scale, 'dtype', type(scale).__name__)}")
        c.require(scale.dim() == 1 and scale.shape[0] in (1, n), "scale-shape",
                  f"scale must be 1-D (1,) or (N,) = ({n},), got {list(scale.shape)}")
        m = math.prod(x1.shape[:-1])
        if pertoken_scale is not None:
            c.require(isinstance(pertoken_scale, torch.Tensor) and pertoken_scale.dtype == torch.float32,
                      "pertoken-scale-dtype", f"pertoken_scale must be float32, got {getattr(pertoken_scale, 'dtype', None)}")
            c.require(tuple(pertoken_scale.shape) == (m,), "pertoken-scale-shape",
                      f"pertoken_scale must be 1-D (m,) = ({m},), got {list(pertoken_scale.shape)}")
        if bias is not None:
            c.require(isinstance(bias, torch.Tensor) and bias.dtype in (torch.float32, torch.bfloat16, torch.float16),
                      "bias", f"bias dtype {getattr(bias, 'dtype', None)}: float32/bfloat16/float16 with FP8 output")
            c.require(tuple(bias.shape) == (n,), "bias", f"bias must be 1-D (N,) = ({n},), got {list(bias.shape)}")
        c.require(output_dtype is not None, "output-dtype", "output_dtype None means int8 output: pass float16/bfloat16")
        c.require(output_dtype in OUT_DTYPES, "output-dtype", f"output_dtype {output_dtype!r}: float16 or bfloat16")
        for name, t in (("x2", x2), ("scale", scale), ("pertoken_scale", pertoken_scale), ("bias", bias)):
            if t is not None:
                c.require(t.device == x1.device, "device", f"{name} on {t.device}, x1 on {x1.device}")

        out = (x1.float() @ x2.float()) * scale
        if pertoken_scale is not None:
            out = out * pertoken_scale.reshape(*x1.shape[:-1], 1)
        if bias is not None:
            out = out + bias.float()
        sim.calls[op] += 1
        return out.to(output_dtype)

    return npu_quant_matmul


# -- the module object ---------------------------------------------------------------------
def make_torch_npu(chip: str = "Ascend950PR") -> types.ModuleType:
    """A fresh simulated torch_npu. State on the module: `chip` (what
    npu.get_device_name() returns), `calls` (successful calls per op),
    `last_kwargs`, `pad_output_rows` (pad the attention output's sequence axis)."""
    mod = types.ModuleType("torch_npu", "fx_fp8 test simulator of torch_npu's op contracts (not the real package)")
    mod.__version__ = "0.0.0+contract-sim"
    # importlib.util.find_spec("torch_npu") must not crash on the stand-in
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None, origin="fx_fp8 contract simulator")
    mod.chip = chip
    mod.calls = Counter()
    mod.last_kwargs = {}
    mod.pad_output_rows = None
    mod.SimulatedContractError = SimulatedContractError
    mod.hifloat8, mod.float8_e5m2, mod.float8_e4m3fn, mod.float8_e8m0fnu = HIFLOAT8, FLOAT8_E5M2, FLOAT8_E4M3FN, FLOAT8_E8M0FNU
    mod.npu = types.SimpleNamespace(get_device_name=lambda device=None: mod.chip, is_available=lambda: True,
                                    device_count=lambda: 1)
    mod.npu_fused_infer_attention_score_v2 = make_attention_op(mod)
    mod.npu_dynamic_quant = make_dynamic_quant_op(mod)
    mod.npu_quant_matmul = make_quant_matmul_op(mod)
    return mod


_MISSING = object()


@contextlib.contextmanager
def installed(chip: str = "Ascend950PR"):
    """sys.modules["torch_npu"] = a simulator for the duration; restored afterwards."""
    mod = make_torch_npu(chip)
    saved = sys.modules.get("torch_npu", _MISSING)
    sys.modules["torch_npu"] = mod
    try:
        yield mod
    finally:
        if saved is _MISSING:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = saved
