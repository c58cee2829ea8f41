"""MindIE-SD (the `mindiesd` package), looked up lazily: the FP8 attention entry points fx_fp8 calls.

MindIE-SD is Huawei's diffusion inference library for Ascend; vLLM-Omni runs
its FP8 attention through it since CANN stopped accepting the per-block FP8
case (quant mode 7) of its own fused attention. Read from the mindiesd 3.1.0
wheel (Python sources; the compiled kernels are only seen through their
schemas and op-info files):

* `mindiesd.layers.quant.block_quant.fa_block_quant_preprocess(input_tensor,
  block_size=128, dst_type=torch_npu.float8_e4m3fn, layout="BNSD"|"BSND")`:
  docstring "Support 128/256/512"; calls
  `torch_npu.npu_dynamic_block_quant(x.squeeze(0), dst_type=..., row_block_size=block_size,
  col_block_size=128)` and unsqueezes the results, so it takes one sample at a
  time (batch 1) and returns BNSD data with fp32 scales (1, N, ceil(S/block), ceil(D/128)).
* `mindiesd.layers.flash_attn.fused_infer_attention_score.fused_infer_attention_score_v2(
  query, key, value, **kwargs)`: validates layout (BNSD/BSND/BSH), head counts,
  shapes and equal q/k/v dtypes, maps torch_npu's int pseudo dtypes of the
  `*_dtype` arguments to CANN codes and drops torch.dtype ones, silently drops
  `quant_scale_p` (`_IGNORED_COMPAT_KWARGS`), then calls
  `torch.ops.mindiesd.fused_infer_attention_score_v2` (its own kernel,
  aclnnEagleFusedInferAttentionScoreV5, shipped for ascend950 only in
  mindiesd/ops/vendors/aie_ascendc). That schema takes the P scale as
  `quant_scale1` (the slot CANN's per-block spec reads it from).
* MindIE-SD's own FP8 attention (mindiesd/quantization/layer.py,
  FP8RotateQuantFA.forward) = rotate Q/K, fa_block_quant_preprocess Q with
  block 128 and K/V with 256, fused_infer_attention_score_v2 with
  input_layout "BNSD", query/key/value_quant_mode 7, out_dtype = model dtype,
  then crop the sequence axis. fx_fp8's "mindiesd" attention path is that call sequence.
* Its torch plugin exists for torch 2.7 and 2.9-2.13 (mindiesd/_torch_variants.py):
  `import mindiesd` fails on an NPU machine with any other torch.

Never imported when fx_fp8 is imported (it imports torch_npu).
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional

BLOCK_QUANT_MODULE = "mindiesd.layers.quant.block_quant"
ATTENTION_MODULE = "mindiesd.layers.flash_attn.fused_infer_attention_score"
#: fa_block_quant_preprocess block sizes (its docstring)
BLOCK_SIZES = (128, 256, 512)
#: the releases whose sources the calls were written from
TESTED_VERSIONS = ("3.1.0",)


def entry_points():
    """(fa_block_quant_preprocess, fused_infer_attention_score_v2); raises when mindiesd is not importable."""
    block_quant = importlib.import_module(BLOCK_QUANT_MODULE)
    attention = importlib.import_module(ATTENTION_MODULE)
    return block_quant.fa_block_quant_preprocess, attention.fused_infer_attention_score_v2


def import_problem() -> Optional[str]:
    """None when MindIE-SD's entry points import, else why not."""
    try:
        entry_points()
    except Exception as e:  # ImportError, or RuntimeError/OSError from a broken CANN / torch_npu / plugin
        return f"mindiesd not importable ({type(e).__name__}: {e})"
    return None


def version() -> str:
    """The installed MindIE-SD version ("unknown" when it cannot be read)."""
    mod = sys.modules.get("mindiesd")
    v = getattr(mod, "__version__", None) if mod is not None else None
    if v:
        return str(v)
    try:
        from importlib.metadata import version as dist_version

        return dist_version("mindiesd")
    except Exception:
        return "unknown"
