"""A stand-in `mindiesd` package (MindIE-SD 3.1.0) with the attention entry points fx_fp8 uses.

Written from the mindiesd 3.1.0 wheel's Python sources and op metadata, never
from fx_fp8's code (it imports nothing from fx_fp8):

* mindiesd/layers/quant/block_quant.py, `fa_block_quant_preprocess(input_tensor,
  block_size=128, dst_type=torch_npu.float8_e4m3fn, **kwargs)`: 4-D input only
  (ParametersInvalid otherwise), `layout` kwarg BNSD (default) or BSND
  (transposed to BNSD first), docstring "Support 128/256/512"; then
  `torch_npu.npu_dynamic_block_quant(input.squeeze(0), dst_type=dst_type,
  row_block_size=block_size, col_block_size=128)` and both results unsqueezed:
  a batch above 1 reaches npu_dynamic_block_quant as a 4-D tensor.
* mindiesd/layers/flash_attn/fused_infer_attention_score.py,
  `fused_infer_attention_score_v2(query, key, value, **kwargs)`: `_validate_fia_inputs`
  (layout in BNSD/BSND/BSH, positive int num_query_heads, int >= 0
  num_key_value_heads, ranks, batch, head counts per layout, key/value lengths,
  equal q/k/v dtypes), `*_dtype` kwargs: torch_npu pseudo dtypes -> CANN codes,
  torch.dtype -> None; `quant_scale_p` dropped (`_IGNORED_COMPAT_KWARGS`); then
  `torch.ops.mindiesd.fused_infer_attention_score_v2` (schema from
  mindiesd/plugin/torch213/libPTAExtensionOPS.so; P scale slot `quant_scale1`,
  `ScalarType? out_dtype`), whose kernel EagleFusedInferAttentionScore ships for
  ascend950 only (ops/vendors/aie_ascendc/op_impl/ai_core/tbe/config/*/ *-ops-info.json).
  The kernel's FP8 contract is taken as CANN's per-block one (modes 7/7/7, fp32
  scales [B, N, ceil(S/128 | 256), 1], no mask, no softmax_lse, head dim <= 128,
  P scale in [1, 448]): MindIE-SD itself calls it that way (quantization/layer.py,
  FP8RotateQuantFA) and the kernel is not subject to CANN's removal of mode 7.
* mindiesd/utils/get_platform.py: device kind from torch_npu.npu.get_soc_version()
  (220-225 A2, 250-255 A3, 260 A5).

The source of each rule, by rule name: npu_sim/sources.py (checked complete by a test).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import math
import sys
import types
from collections import Counter

import torch

from npu_sim.torch_npu_sim import modules_installed
from npu_sim.torch_npu_sim import (
    FLOAT8_E8M0FNU,
    FLOAT4_E2M1FN_X2,
    HIFLOAT8,
    FP8,
    KV_BLOCK,
    OUT_DTYPES,
    Q_BLOCK,
    SimulatedContractError,
    _Checker,
    _cdiv,
    _check_block_scale,
    _p_scale,
    _rows,
    _softmax_pv,
    _is_int,
    INT_MAX,
)

VERSION = "3.1.0"
LAYOUTS = ("BNSD", "BSND", "BSH")
BLOCK_SIZES = (128, 256, 512)
_DTYPE_KWARGS = (
    "query_dtype",
    "key_dtype",
    "value_dtype",
    "query_rope_dtype",
    "key_rope_dtype",
    "key_shared_prefix_dtype",
    "value_shared_prefix_dtype",
    "dequant_scale_query_dtype",
    "dequant_scale_key_dtype",
    "dequant_scale_value_dtype",
    "dequant_scale_key_rope_dtype",
)
_CANN_CODES = {HIFLOAT8: 290, FLOAT8_E8M0FNU: 293, FLOAT4_E2M1FN_X2: 296}
# torch.ops.mindiesd.fused_infer_attention_score_v2 keyword arguments (the .so's schema)
_SCHEMA = (
    "query_rope",
    "key_rope",
    "pse_shift",
    "atten_mask",
    "actual_seq_qlen",
    "actual_seq_kvlen",
    "block_table",
    "dequant_scale1",
    "quant_scale1",
    "dequant_scale2",
    "dequant_scale_query",
    "dequant_scale_key",
    "dequant_offset_key",
    "dequant_scale_value",
    "dequant_offset_value",
    "dequant_scale_key_rope",
    "quant_scale_out",
    "quant_offset_out",
    "learnable_sink",
    "num_query_heads",
    "num_key_value_heads",
    "softmax_scale",
    "pre_tokens",
    "next_tokens",
    "input_layout",
    "sparse_mode",
    "block_size",
    "query_quant_mode",
    "key_quant_mode",
    "value_quant_mode",
    "inner_precise",
    "return_softmax_lse",
    *_DTYPE_KWARGS,
    "out_dtype",
)


class ParametersInvalid(SimulatedContractError):
    """mindiesd.utils.exception.ParametersInvalid, carrying the violated rule."""

    def __init__(self, rule: str, detail: str, op: str = "mindiesd"):
        super().__init__(op, rule, detail)


def _torch_npu():
    mod = sys.modules.get("torch_npu")
    if mod is None:  # the real package imports torch_npu at module load and needs it at every call
        raise ImportError("mindiesd needs torch_npu")
    return mod


def make_mindiesd() -> dict:
    """{module name: module} of a fresh simulated mindiesd. State on the top module:
    `calls` (successful calls per entry point), `last_kwargs`."""
    top = types.ModuleType("mindiesd", "fx_fp8 test simulator of MindIE-SD's entry points (not the real package)")
    top.__version__ = VERSION + "+contract-sim"
    top.__path__ = []
    top.__spec__ = importlib.machinery.ModuleSpec("mindiesd", None, origin="fx_fp8 contract simulator", is_package=True)
    top.calls = Counter()
    top.last_kwargs = {}
    top.ParametersInvalid = ParametersInvalid

    def fa_block_quant_preprocess(input_tensor, block_size=128, dst_type=None, **kwargs):
        """Preprocess for FA quant. Input layout must be 'BNSD' or 'BSND' (see module doc)."""
        torch_npu = _torch_npu()
        op = "mindiesd.fa_block_quant_preprocess"
        if dst_type is None:
            dst_type = torch_npu.float8_e4m3fn
        if len(input_tensor.shape) != 4:
            raise ParametersInvalid(
                "rank",
                f"fa block quant preprocess only support qkv quant, dim = 4, but got {len(input_tensor.shape)}.",
                op,
            )
        if block_size not in BLOCK_SIZES:
            raise ParametersInvalid("block-size", f"block_size={block_size}: the docstring supports {BLOCK_SIZES}", op)
        layout = kwargs.get("layout", "BNSD")
        if layout not in ("BNSD", "BSND"):
            raise ParametersInvalid("layout", f"layout {layout!r}: 'BNSD' or 'BSND'", op)
        if layout == "BSND":
            input_tensor = input_tensor.transpose(1, 2)
        # block_quant only supports BNSD; the batch axis is squeezed (batch 1)
        q, s = torch_npu.npu_dynamic_block_quant(
            input_tensor.squeeze(0), dst_type=dst_type, row_block_size=block_size, col_block_size=128
        )
        top.calls["fa_block_quant_preprocess"] += 1
        return q.unsqueeze(0), s.unsqueeze(0)

    def _validate_fia_inputs(query, key, value, kwargs):
        op = "mindiesd.fused_infer_attention_score_v2"
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise ParametersInvalid("tensor", f"The data type of input {name} must be torch.Tensor", op)
        layout = kwargs.get("input_layout", "BSH")
        if layout not in LAYOUTS:
            raise ParametersInvalid("layout", f"The input_layout must in {LAYOUTS}, but got {layout}.", op)
        n_q, n_kv = kwargs.get("num_query_heads", 1), kwargs.get("num_key_value_heads", 0)
        if not _is_int(n_q) or n_q <= 0:
            raise ParametersInvalid("heads", f"num_query_heads must be an int > 0, got {n_q!r}", op)
        if not _is_int(n_kv) or n_kv < 0:
            raise ParametersInvalid("heads", f"num_key_value_heads must be an int >= 0, got {n_kv!r}", op)
        rank = 3 if layout == "BSH" else 4
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() != rank:
                raise ParametersInvalid("layout", f"The dimensional of input {name} must be {rank} for {layout}", op)
        if not query.shape[0] == key.shape[0] == value.shape[0]:
            raise ParametersInvalid("batch", "The batch size of query/key/value must be same", op)
        eff = n_q if n_kv == 0 else n_kv
        if n_q % eff:
            raise ParametersInvalid("heads", f"num_query_heads {n_q} not divisible by num_key_value_heads {eff}", op)
        if layout != "BSH":
            axis = 1 if layout == "BNSD" else 2
            for name, t, want in (("query", query, n_q), ("key", key, eff), ("value", value, eff)):
                if t.shape[axis] != want:
                    raise ParametersInvalid(
                        "layout-heads",
                        f"The head num of input {name} must be {want} for {layout}, but got {t.shape[axis]}.",
                        op,
                    )
        seq = 2 if layout == "BNSD" else 1
        if key.shape[seq] != value.shape[seq]:
            raise ParametersInvalid("kv-shape", "The sequence length of key/value must be same", op)
        if not query.dtype == key.dtype == value.dtype:
            raise ParametersInvalid(
                "dtype",
                f"The dtype of query/key/value must be same, but got {query.dtype}/{key.dtype}/{value.dtype}.",
                op,
            )

    def _normalize(name, value):
        if name not in _DTYPE_KWARGS:
            return value
        if _is_int(value) and value in _CANN_CODES:
            return _CANN_CODES[value]
        return None if isinstance(value, torch.dtype) else value

    def fused_infer_attention_score_v2(query, key, value, **kwargs):
        _validate_fia_inputs(query, key, value, kwargs)
        normalized = {
            n: _normalize(n, v) for n, v in kwargs.items() if n != "quant_scale_p"
        }  # dropped, as MindIE-SD does
        return eagle_fused_infer_attention_score_v2(query, key, value, **normalized)

    def eagle_fused_infer_attention_score_v2(query, key, value, **kw):
        """torch.ops.mindiesd.fused_infer_attention_score_v2, per-block FP8 case."""
        op = "torch.ops.mindiesd.fused_infer_attention_score_v2"
        c = _Checker(op)
        unknown = sorted(set(kw) - set(_SCHEMA))
        c.require(not unknown, "unknown-argument", f"{unknown} are not in the op's schema")
        g = {n: kw.get(n) for n in _SCHEMA}
        defaults = dict(
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
        )
        for n, d in defaults.items():
            if n not in kw:
                g[n] = d
        torch_npu = _torch_npu()
        c.require(
            "950" in torch_npu.npu.get_device_name(),
            "chip",
            f"{torch_npu.npu.get_device_name()}: MindIE-SD's fused attention kernel ships for ascend950 only",
        )
        c.require(
            query.dtype == FP8 and key.dtype == FP8 and value.dtype == FP8,
            "qkv-dtype",
            f"the per-block FP8 case needs float8_e4m3fn query/key/value, got {query.dtype}/{key.dtype}/{value.dtype}",
        )
        modes = (g["query_quant_mode"], g["key_quant_mode"], g["value_quant_mode"])
        c.require(
            modes == (7, 7, 7), "quant-mode", f"query/key/value_quant_mode {modes}: the per-block FP8 case is 7/7/7"
        )
        extras = (
            "query_rope",
            "key_rope",
            "pse_shift",
            "actual_seq_qlen",
            "actual_seq_kvlen",
            "block_table",
            "dequant_scale1",
            "dequant_scale2",
            "dequant_offset_key",
            "dequant_offset_value",
            "dequant_scale_key_rope",
            "quant_scale_out",
            "quant_offset_out",
            "learnable_sink",
        )
        given = sorted(n for n in extras if g[n] is not None)
        c.require(not given, "unsupported-argument", f"{given} are not part of the per-block FP8 case")
        c.require(g["block_size"] == 0, "unsupported-argument", "paged KV is not part of the per-block FP8 case")
        c.require(g["atten_mask"] is None, "mask-unsupported", "the per-block FP8 case takes no attention mask")
        c.require(not g["return_softmax_lse"], "lse-unsupported", "the per-block FP8 case returns no softmax_lse")
        layout = g["input_layout"]
        c.require(layout in ("BNSD", "BSND"), "layout", f"input_layout {layout!r}: BNSD or BSND simulated")
        n_q = g["num_query_heads"]
        n_kv = g["num_key_value_heads"] or n_q
        c.require(n_q <= 256 and n_kv <= 256 and n_q // n_kv <= 64, "heads", "N <= 256, G <= 64")
        for name, t in (("query", query), ("key", key), ("value", value)):
            c.require(t.is_contiguous(), "contiguous", f"{name} must be contiguous ({layout} memory order)")
        seq = 2 if layout == "BNSD" else 1
        b, s_q, s_k, d = query.shape[0], query.shape[seq], key.shape[seq], query.shape[3]
        c.require(1 <= d <= 128 and key.shape[3] == d, "head-dim", f"head dim {d}: 1-128, equal for q/k/v")
        c.require(s_q >= 2, "query-length", "query length 1 enters the decode branch")
        _check_block_scale(
            c, "dequant_scale_query", g["dequant_scale_query"], (b, n_q, _cdiv(s_q, Q_BLOCK), 1), query.device
        )
        _check_block_scale(
            c, "dequant_scale_key", g["dequant_scale_key"], (b, n_kv, _cdiv(s_k, KV_BLOCK), 1), query.device
        )
        _check_block_scale(
            c, "dequant_scale_value", g["dequant_scale_value"], (b, n_kv, _cdiv(s_k, KV_BLOCK), 1), query.device
        )
        p_scale = _p_scale(c, g["quant_scale1"], 1.0)
        scale = g["softmax_scale"]
        c.require(
            isinstance(scale, float) and math.isfinite(scale) and scale > 0,
            "softmax-scale",
            f"softmax_scale must be a positive float, got {scale!r}",
        )
        c.require(
            not (scale == 1.0 and d != 1), "softmax-scale-default", "softmax_scale=1.0 (the default) with head dim > 1"
        )
        out_dtype = g["out_dtype"]
        c.require(
            out_dtype in OUT_DTYPES, "out-dtype", f"out_dtype {out_dtype!r}: float16 or bfloat16 (required for FP8)"
        )
        c.require(
            g["sparse_mode"] == 0 and g["inner_precise"] in (0, 1),
            "unsupported-argument",
            "sparse_mode 0 and inner_precise 0/1 only",
        )
        q, k, v = (t.float() for t in (query, key, value))
        if layout == "BSND":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        group = n_q // n_kv
        sk = _rows(g["dequant_scale_key"], KV_BLOCK, s_k).repeat_interleave(group, dim=1)
        sv = _rows(g["dequant_scale_value"], KV_BLOCK, s_k).repeat_interleave(group, dim=1)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out, _ = _softmax_pv(q, k, v, _rows(g["dequant_scale_query"], Q_BLOCK, s_q), sk, sv, scale, p_scale)
        if layout == "BSND":
            out = out.transpose(1, 2)
        top.calls["fused_infer_attention_score_v2"] += 1
        top.last_kwargs["fused_infer_attention_score_v2"] = dict(
            input_layout=layout,
            num_query_heads=n_q,
            softmax_scale=scale,
            quant_scale1=p_scale,
            out_dtype=out_dtype,
            head_dim=d,
        )
        return out.to(out_dtype).contiguous(), torch.zeros(1, dtype=torch.float32)

    def get_npu_device():
        soc = _torch_npu().npu.get_soc_version()
        if 220 <= soc <= 225:
            return "A2"
        if 250 <= soc <= 255:
            return "A3"
        if soc == 260:
            return "A5"
        return "UNDEFINED"

    def package(name, **attrs):
        m = types.ModuleType(name)
        m.__path__ = []
        m.__spec__ = importlib.machinery.ModuleSpec(name, None, origin="fx_fp8 contract simulator", is_package=True)
        m.__dict__.update(attrs)
        return m

    modules = {
        "mindiesd": top,
        "mindiesd.layers": package("mindiesd.layers"),
        "mindiesd.layers.quant": package("mindiesd.layers.quant"),
        "mindiesd.layers.quant.block_quant": package(
            "mindiesd.layers.quant.block_quant", fa_block_quant_preprocess=fa_block_quant_preprocess
        ),
        "mindiesd.layers.flash_attn": package("mindiesd.layers.flash_attn"),
        "mindiesd.layers.flash_attn.fused_infer_attention_score": package(
            "mindiesd.layers.flash_attn.fused_infer_attention_score",
            fused_infer_attention_score_v2=fused_infer_attention_score_v2,
        ),
        "mindiesd.utils": package("mindiesd.utils", ParametersInvalid=ParametersInvalid),
        "mindiesd.utils.get_platform": package(
            "mindiesd.utils.get_platform", get_npu_device=get_npu_device, is_a5_device=lambda: get_npu_device() == "A5"
        ),
    }
    # the attribute chain import machinery and getattr users walk
    for name, mod in modules.items():
        if "." in name:
            parent, child = name.rsplit(".", 1)
            setattr(modules[parent], child, mod)
    top.eagle_fused_infer_attention_score_v2 = eagle_fused_infer_attention_score_v2
    return modules


@contextlib.contextmanager
def installed_mindiesd():
    """The simulated mindiesd package in sys.modules for the duration (torch_npu must be simulated too)."""
    if not isinstance(sys.modules.get("torch_npu"), types.ModuleType):
        raise RuntimeError("install the torch_npu simulator first: mindiesd imports torch_npu")
    modules = make_mindiesd()
    with modules_installed(modules):
        yield modules["mindiesd"]


@contextlib.contextmanager
def blocked():
    """`import mindiesd` raises ImportError for the duration (whatever is installed in the venv)."""
    saved = {n: m for n, m in sys.modules.items() if n == "mindiesd" or n.startswith("mindiesd.")}
    for n in saved:
        del sys.modules[n]
    sys.modules["mindiesd"] = None
    try:
        yield
    finally:
        sys.modules.pop("mindiesd", None)
        sys.modules.update(saved)
