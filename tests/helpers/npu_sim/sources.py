"""Rule by rule, the vendor source each simulator rule follows (the rule names are those the
simulators raise: SimulatedContractError.rule, ParametersInvalid's rule). tests/ops/test_npu_vendor_rules.py
reads the rule names from the simulators' source and fails on a rule without a source here.
Where one rule name serves several ops, each op's source is named."""

from __future__ import annotations

# the documents (stored copies: the search tool; summaries: /work/shared/reference/torch_npu.md)
FIA_V2 = "op-plugin docs torch_npu-npu_fused_infer_attention_score_v2.md"
FIA_V5 = "CANN ops-transformer attention/fused_infer_attention_score/docs/aclnnFusedInferAttentionScoreV5.md"
FIA_CPP = "op-plugin op_plugin/ops/opapi/FusedInferAttentionScoreV2KernelNpuOpApi.cpp"
CANN_MODE7 = "ops-transformer 17e3f5b9d ('per-block场景下线': mode 7 refused from CANN 9.0.0-rc.1)"
DYN_QUANT = "op-plugin docs torch_npu-npu_dynamic_quant.md"
QUANT_MM = "op-plugin docs torch_npu-npu_quant_matmul.md (dtype table per chip)"
WEIGHT_MM = "op-plugin docs torch_npu-npu_weight_quant_batchmatmul.md"
BLOCK_Q = "CANN ops-nn quant/dynamic_block_quant/docs/aclnnDynamicBlockQuant.md; op-plugin torch_npu-npu_dynamic_block_quant.md"
MX_Q = "CANN ops-nn aclnnDynamicMxQuant.md"
SD_WRAPPER = "MindIE-SD 3.1.0 mindiesd/layers/flash_attn/fused_infer_attention_score.py (_validate_fia_inputs)"
SD_BLOCK_Q = "MindIE-SD 3.1.0 mindiesd/layers/quant/block_quant.py (fa_block_quant_preprocess)"
SD_KERNEL = (
    "MindIE-SD 3.1.0 torch.ops.mindiesd.fused_infer_attention_score_v2 (schema: plugin/torch213/"
    "libPTAExtensionOPS.so; ascend950 only: op_impl ops-info.json), called as mindiesd/quantization/"
    "layer.py FP8RotateQuantFA calls it: CANN's per-block case of " + FIA_V5
)
SCOPE = "not a vendor rule: the simulator's scope (what fx_fp8 never calls is refused, not guessed)"

TORCH_NPU = {
    "actual-seq": f"{FIA_V5}: TND needs cumulative actual_seq_qlen / actual_seq_kvlen",
    "axis": f"{MX_Q}: axis, a dimension of the input",
    "bias": f"{QUANT_MM}; {WEIGHT_MM}: bias dtypes per output dtype",
    "block-size": f"{BLOCK_Q}: rowBlockSize 1/64/128/256/512, colBlockSize 64/128/192/256 (A2/A3: 1 x 128)",
    "chip": f"FP8 kernels are Ascend 950 only: {FIA_V5}; {BLOCK_Q}; {MX_Q}; {DYN_QUANT}; {QUANT_MM}",
    "contiguous": f"{FIA_CPP}: the op reads the layout's memory order",
    "dequant-scale-dtype": f"{FIA_V5}: fp32 per-block scales; e8m0 (uint8 + float8_e8m0fnu dtype) MX scales",
    "dequant-scale-missing": f"{FIA_V5}: quantized query/key/value need their dequant scales",
    "dequant-scale-shape": f"{FIA_V5}: [B, N, ceil(S/128 | 256), 1] per-block; MX (T, N, D/64, 2) / (T/64, N, D, 2)",
    "dequant-scale-value": f"{FIA_V5}: a dequantization scale multiplies: finite and positive",
    "device": f"{FIA_CPP}; {QUANT_MM}: all tensors on the NPU of the query",
    "dst-type": f"{DYN_QUANT}; {BLOCK_Q}; {MX_Q}: the documented output dtypes",
    "group-size": f"{WEIGHT_MM}: antiquant_group_size a multiple of 32 in [32, K - 1]",
    "head-dim": f"{FIA_V5}: per-block head dim 1-128; MXFP8 64 or 128",
    "heads": f"{FIA_V2}: num_query_heads > 0, num_key_value_heads >= 0 dividing it; N <= 256",
    "inner-precise": f"{FIA_V5}: innerPrecise values per case",
    "input-dtype": f"{DYN_QUANT}; {BLOCK_Q}; {MX_Q}: float16 / bfloat16 (block quant: float32 too)",
    "input-rank": f"{DYN_QUANT}; {MX_Q}: input of more than one dimension",
    "k-limit": f"{QUANT_MM}: K <= 65535",
    "k-mismatch": f"{QUANT_MM}; {WEIGHT_MM}: x1's K equals x2's K",
    "kv-shape": f"{FIA_V5}: key and value of one shape, batch equal to the query's",
    "layout": f"{FIA_V5}: per-block BNSD / BSND; MXFP8 TND",
    "layout-heads": f"{FIA_V2}: the layout's head axis holds num_query_heads / num_key_value_heads",
    "lse-unsupported": f"{FIA_V5}: per-block case: 不支持SoftmaxLSE场景",
    "mask-unsupported": f"{FIA_V5}: per-block case: 不支持Mask场景; MXFP8 with sparse_mode 0: no attenMask",
    "min-scale": f"{BLOCK_Q}: min_scale 0 (torch_npu: 当前仅支持取值0)",
    "not-simulated": SCOPE,
    "out-dtype": f"{FIA_V5}: FP8 attention outputs float16 / bfloat16; {FIA_V2}: out_dtype defaults to float16",
    "output-dtype": f"{QUANT_MM}: output_dtype per the dtype table",
    "pertoken-scale-dtype": f"{QUANT_MM}: pertoken_scale float32",
    "pertoken-scale-missing": f"{QUANT_MM}: per-token x per-channel needs pertoken_scale",
    "pertoken-scale-shape": f"{QUANT_MM}: pertoken_scale of shape (m,)",
    "qkv-dtype": f"{FIA_V5}: float8_e4m3fn query/key/value in the FP8 full-quant cases",
    "quant-mode": f"{FIA_V5}: per-block modes 7/7/7, MXFP8 6/6/8; {DYN_QUANT}: quant_mode 'pertoken'",
    "quant-mode-refused": CANN_MODE7,
    "quant-mode-unsupported": f"{FIA_V5}: non-paged MXFP8 TND from CANN 9.1.0.pre",
    "quant-scale-p": f"{FIA_V5}: the P scale (quant_scale_p) within [1, 448]",
    "quant-scale-p-missing": f"{FIA_V5}: the full-quant cases need the P scale; {FIA_CPP}: passed as quant_scale_p",
    "query-length": f"{FIA_V2}: query length 1 enters the IncreFlashAttention (decode) branch",
    "round-mode": f"{BLOCK_Q}; {MX_Q}: round mode rint for INT8 / FP8 outputs",
    "scale-dtype": f"{QUANT_MM}; {WEIGHT_MM}: scale dtypes per the dtype table",
    "scale-shape": f"{QUANT_MM}; {WEIGHT_MM}: per-channel scale (n,) or (1,); per-group (ceil(K / g), n)",
    "softmax-scale": f"{FIA_V2}: softmax_scale a float",
    "softmax-scale-default": f"{FIA_V2}: softmax_scale defaults to 1.0: pass 1/sqrt(head_dim) yourself",
    "sparse-mode": f"{FIA_V5}: sparse_mode 0 in the simulated cases",
    "unsupported-argument": f"{FIA_V5}: arguments outside the FP8 full-quant cases; {QUANT_MM}: per-token x per-channel",
    "weight-dtype": f"{WEIGHT_MM}: int8 / int4 weights",
    "weight-rank": f"{WEIGHT_MM}: a 2-D weight",
    "x-dtype": f"{QUANT_MM}; {WEIGHT_MM}: x dtypes per the dtype table",
    "x-rank": f"{BLOCK_Q}: x of 2-3 dimensions; {WEIGHT_MM}: 2-D x",
    "x1-rank": f"{QUANT_MM}: x1 of 2-6 dimensions",
    "x2-layout": f"{QUANT_MM}: x2 (k, n), the transposed weight",
}

MINDIESD = {
    "batch": f"{SD_WRAPPER}: 'The batch size of query/key/value must be same'",
    "block-size": f"{SD_BLOCK_Q}: docstring 'Support 128/256/512'",
    "chip": SD_KERNEL,
    "contiguous": f"{SD_KERNEL}: the layout's memory order",
    "dtype": f"{SD_WRAPPER}: 'The dtype of query/key/value must be same'",
    "head-dim": f"{SD_KERNEL}: head dim 1-128",
    "heads": f"{SD_WRAPPER}: num_query_heads an int > 0, num_key_value_heads an int >= 0 dividing it; "
    f"{SD_KERNEL}: N <= 256, G <= 64",
    "kv-shape": f"{SD_WRAPPER}: 'The sequence length of key/value must be same'",
    "layout": f"{SD_WRAPPER}: input_layout in BNSD/BSND/BSH; {SD_BLOCK_Q}: layout BNSD or BSND; {SD_KERNEL}",
    "layout-heads": f"{SD_WRAPPER}: 'The head num of input ... must be ...'",
    "lse-unsupported": f"{SD_KERNEL}: no softmax_lse",
    "mask-unsupported": f"{SD_KERNEL}: no attention mask",
    "out-dtype": f"{SD_KERNEL}: float16 / bfloat16 output",
    "qkv-dtype": f"{SD_KERNEL}: float8_e4m3fn query/key/value",
    "quant-mode": f"{SD_KERNEL}: modes 7/7/7",
    "query-length": f"{SD_KERNEL}: query length 1 enters the decode branch",
    "rank": f"{SD_BLOCK_Q}: 'fa block quant preprocess only support qkv quant, dim = 4'",
    "softmax-scale": f"{SD_KERNEL}: a positive float",
    "softmax-scale-default": f"{SD_KERNEL}: softmax_scale defaults to 1.0",
    "tensor": f"{SD_WRAPPER}: 'The data type of input ... must be torch.Tensor'",
    "unknown-argument": f"{SD_KERNEL}: the .so's schema",
    "unsupported-argument": f"{SD_KERNEL}: arguments outside the per-block case",
}
