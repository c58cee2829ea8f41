"""MXFP8 attention numerics (attention.granularity "mx", fx_fp8.ops.mx) next to the per-block recipe.

Same harness and shapes as test_attention_numerics.py (B1 H8 S1024 D128, SQNR
in dB against float64 attention); "xN outliers" = channels 3, 17, 64, 100 of
Q and K scaled by N. Run with -s to print the table.
"""

import math

import pytest
import torch

import fx_fp8  # noqa: F401  registers torch.ops.fx_fp8.*
from fx_fp8.config.attention import AttentionQuantConfig
from fx_fp8.ops import mx, quant

pytestmark = pytest.mark.slow  # SQNR over B1 H8 S1024 D128 tensors: the full suite (CI) runs it

B, H, S, D = 1, 8, 1024, 128
OUTLIER_CHANNELS = [3, 17, 64, 100]


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref = ref.double()
    return 10 * math.log10(float((ref**2).sum() / ((ref - x.double()) ** 2).sum()))


def attention64(q, k, v):
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, -1) @ v.double()


def fp8_attention(q, k, v, granularity, *, hadamard=True, quantize_p=True):
    return torch.ops.fx_fp8.fp8_attention(
        q,
        k,
        v,
        None,
        1 / math.sqrt(q.shape[-1]),
        granularity=granularity,
        q_block=128,
        kv_block=256,
        hadamard=hadamard,
        smooth_k=True,
        quantize_p=quantize_p,
        p_scale=448.0,
        attention_kernel="auto",
        lowering="reference",
    )


def with_outliers(x, factor):
    x = x.clone()
    x[..., OUTLIER_CHANNELS] *= factor
    return x


@pytest.fixture(scope="module")
def qkv():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, S, D, generator=g) for _ in range(3))


@pytest.fixture(scope="module")
def table(qkv):
    """{(case, granularity, hadamard): SQNR dB} for Gaussian, x5 and x20 outlier channels."""
    q, k, v = qkv
    out = {}
    for case, factor in (("gaussian", 1.0), ("x5", 5.0), ("x20", 20.0)):
        qo, ko = with_outliers(q, factor), with_outliers(k, factor)
        ref = attention64(qo, ko, v)
        for granularity in ("block", "mx"):
            for hadamard in (True, False):
                out[case, granularity, hadamard] = sqnr_db(
                    ref, fp8_attention(qo, ko, v, granularity, hadamard=hadamard)
                )
    lines = ["", "SQNR dB (B1 H8 S1024 D128, P quantized)  block 128/256 | mx 32, with / without Hadamard"]
    for case in ("gaussian", "x5", "x20"):
        lines.append(
            f"  {case:9s} block {out[case, 'block', True]:6.2f} / {out[case, 'block', False]:6.2f}"
            f"   mx {out[case, 'mx', True]:6.2f} / {out[case, 'mx', False]:6.2f}"
        )
    print("\n".join(lines))
    return out


# -- the bars (measured: see the printed table) -------------------------------------------------
def test_gaussian_sqnr(table):
    assert table["gaussian", "mx", True] >= 24.0
    assert table["gaussian", "mx", True] >= table["gaussian", "block", True] - 1.5  # within 1.5 dB of per-block


def test_outlier_sqnr_needs_hadamard(table):
    assert table["x5", "mx", True] >= 23.0
    assert table["x5", "mx", False] < 16.0
    assert table["x20", "mx", True] >= 16.0
    assert table["x20", "mx", True] > table["x20", "mx", False] + 6.0


# -- the format --------------------------------------------------------------------------------
def test_cann_doc_example():
    """aclnnDynamicMxQuant's example: bf16 (0, 8, 64, 512) -> e4m3 (0, 4, 32, 256), scale 2 (e8m0 128)."""
    x = torch.tensor([[0.0, 8.0, 64.0, 512.0]]).bfloat16()
    xq, scale = mx.quantize_mx(x, -1)
    assert xq.float().tolist() == [[0.0, 4.0, 32.0, 256.0]]
    assert scale.tolist() == [[2.0]] and mx.e8m0_bytes(scale).tolist() == [[128]]


def test_scale_exponent_rule():
    """shared_exp = floor(log2(amax)) - 8 exactly, also just below a power of two; e8m0 range clamp."""
    amax = torch.tensor([1.0, 1.9999999, 2.0, 447.0, 448.0, 511.9, 512.0, 0.0, 1e-45, 3e38])
    exp = mx.shared_exponent(amax).tolist()
    assert exp == [-8, -8, -7, 0, 0, 0, 1, -127, -127, 119]
    # the block max lands in [256, 512): values above 448 saturate
    xq, scale = mx.quantize_mx(torch.tensor([[500.0] + [1.0] * 31]), -1)
    assert float(scale) == 1.0 and float(xq[0, 0]) == 448.0


def test_blocks_and_round_trip():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 70, 96, generator=g)
    x[0, 0, 5, 40] = 300.0  # one outlier: only its block of 32 along D gets a large scale
    xq, s = mx.quantize_mx(x, -1)
    assert xq.dtype == quant.FP8_DTYPE and xq.shape == x.shape and s.shape == (2, 3, 70, 3)
    assert float(s[0, 0, 5, 1]) >= 0.5 and float(s[0, 0, 5, 0]) < 0.05
    assert torch.equal(torch.log2(s), torch.log2(s).round())  # powers of two
    back = mx.dequantize_mx(xq, s, -1)
    assert float((back - x).norm() / x.norm()) < 0.04
    vq, vs = mx.quantize_mx(x, 2)  # V: blocks along the sequence, last block partial (70 = 2 x 32 + 6)
    assert vs.shape == (2, 3, 3, 96)
    assert float((mx.dequantize_mx(vq, vs, 2) - x).norm() / x.norm()) < 0.04
    assert torch.equal(mx.from_e8m0(mx.e8m0_bytes(vs)), vs)


def test_reference_qkv_is_the_dequantized_mx_values():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 40, 64, generator=g) for _ in range(3))
    qq, sq, kq, sk, vq, sv = quant.prepare_qkv(
        q, k, v, granularity="mx", q_block=128, kv_block=256, hadamard=False, smooth_k=False
    )
    assert sq.shape == sk.shape == sv.shape == (1, 1, 1) and float(sq) == 1.0
    assert torch.equal(qq, mx.dequantize_mx(*mx.quantize_mx(q, -1), -1))
    assert torch.equal(vq, mx.dequantize_mx(*mx.quantize_mx(v, 2), 2))


def test_mx_is_a_config_granularity():
    assert AttentionQuantConfig(granularity="mx").granularity == "mx"
    assert fx_fp8.FP8Config.from_kwargs(attention={"granularity": "MX"}).attention.granularity == "mx"
