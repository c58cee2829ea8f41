"""Numerics of the fp8_attention op (reference lowering) and of FP8 weight quantization.

SQNR in dB against float64 math, as in /work/shared/DESIGN.md's table
(B1 H8 S1024 D128; "outliers" = four channels of Q and K scaled by 5).
"""

import math

import pytest
import torch
import torch.nn.functional as F

import fx_fp8  # noqa: F401  registers torch.ops.fx_fp8.*
from fx_fp8.ops import quant

B, H, S, D = 1, 8, 1024, 128
OUTLIER_CHANNELS = [3, 17, 64, 100]


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref = ref.double()
    return 10 * math.log10(float((ref**2).sum() / ((ref - x.double()) ** 2).sum()))


def attention64(q, k, v, mask=None):
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ v.double()


def attention_kwargs(granularity="block", hadamard=True, smooth_k=True, quantize_p=True):
    return dict(
        granularity=granularity,
        q_block=128,
        kv_block=256,
        hadamard=hadamard,
        smooth_k=smooth_k,
        quantize_p=quantize_p,
        p_scale=448.0,
        attention_kernel="auto",
        lowering="reference",
    )


def fp8_attention(q, k, v, mask=None, **kw):
    return torch.ops.fx_fp8.fp8_attention(q, k, v, mask, 1 / math.sqrt(q.shape[-1]), **attention_kwargs(**kw))


@pytest.fixture(scope="module")
def qkv():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    return q, k, v


def with_outliers(x, factor=5.0):
    x = x.clone()
    x[..., OUTLIER_CHANNELS] *= factor
    return x


def test_gaussian_sqnr(qkv):
    q, k, v = qkv
    db = sqnr_db(attention64(q, k, v), fp8_attention(q, k, v))
    print(f"\nfp8_attention SQNR, Gaussian Q/K/V, block 128/256 + Hadamard + P quant: {db:.2f} dB")
    assert db >= 25.0


def test_outlier_sqnr_needs_hadamard(qkv):
    q, k, v = qkv
    q5, k5 = with_outliers(q), with_outliers(k)
    ref = attention64(q5, k5, v)
    with_h = sqnr_db(ref, fp8_attention(q5, k5, v))
    without_h = sqnr_db(ref, fp8_attention(q5, k5, v, hadamard=False))
    print(f"\nfp8_attention SQNR, x5 outlier channels: with Hadamard {with_h:.2f} dB, without {without_h:.2f} dB")
    assert with_h >= 25.0
    assert without_h < 20.0


@pytest.mark.parametrize("granularity", ["tensor", "head", "block"])
def test_granularities_close_to_exact(qkv, granularity):
    q, k, v = (t[:, :2, :512] for t in qkv)
    out = fp8_attention(q, k, v, granularity=granularity)
    assert out.shape == q.shape and out.dtype == q.dtype
    db = sqnr_db(attention64(q, k, v), out)
    assert 22.0 < db < 40.0  # close, but not exact: the quantization ran


def test_p_quantization_costs_under_1_db_with_its_fixed_scale():
    """P in [0, 1] is scaled by p_scale (448) before the e4m3 cast: without the scale, probabilities
    below e4m3's smallest subnormal (2^-9) flush to zero and a long row of peaked scores loses 3 dB."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 2048, 64, generator=g) for _ in range(3))
    q, v = q * 1.6, v + 0.5  # scores of std 1.6: many small probabilities; V's mean makes lost mass show
    ref = attention64(q, k, v)
    with_p = sqnr_db(ref, fp8_attention(q, k, v))
    without_p = sqnr_db(ref, fp8_attention(q, k, v, quantize_p=False))
    assert 30.0 < with_p and without_p - with_p < 1.0, (with_p, without_p)


def test_key_padding_mask_matches_sdpa():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 300, 64, generator=g) for _ in range(3))
    keep = torch.ones(2, 1, 1, 300, dtype=torch.bool)
    keep[0, ..., 200:] = False
    keep[1, ..., 37:] = False
    out = fp8_attention(q, k, v, keep)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    assert sqnr_db(ref, out) > 22.0
    # the mask really applies: without it the output is far from the masked reference
    assert sqnr_db(ref, fp8_attention(q, k, v)) < 10.0


def test_float_mask_matches_sdpa():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 128, 64, generator=g) for _ in range(3))
    bias = torch.randn(1, 1, 128, 128, generator=g)
    assert sqnr_db(F.scaled_dot_product_attention(q, k, v, attn_mask=bias), fp8_attention(q, k, v, bias)) > 22.0


def test_cross_attention_lengths_and_bf16():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 200, 64, generator=g).bfloat16()
    k, v = (torch.randn(1, 2, 77, 64, generator=g).bfloat16() for _ in range(2))
    out = fp8_attention(q, k, v)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 2, 200, 64)
    assert sqnr_db(attention64(q, k, v), out) > 20.0


def test_fully_masked_rows_give_zero_like_sdpa():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=g) for _ in range(3))
    keep = torch.ones(1, 1, 64, 64, dtype=torch.bool)
    keep[..., :3, :] = False  # three query rows see no key at all (padding)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    out = fp8_attention(q, k, v, keep)
    assert torch.isfinite(out).all() and torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    assert torch.equal(ref[:, :, :3], out[:, :, :3]) and sqnr_db(ref[:, :, 3:], out[:, :, 3:]) > 22.0
    bias = torch.zeros(1, 1, 64, 64).masked_fill(~keep, float("-inf"))  # the same as an additive mask
    assert torch.equal(fp8_attention(q, k, v, bias)[:, :, :3], out[:, :, :3])


def test_lse_op_matches_float64_logsumexp():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 3, 200, 64, generator=g) for _ in range(3))
    keep = torch.ones(2, 1, 1, 200, dtype=torch.bool)
    keep[1, ..., 150:] = False
    scale = 1 / math.sqrt(64)
    out, lse = torch.ops.fx_fp8.fp8_attention_lse(q, k, v, keep, scale, **attention_kwargs())
    scores = (q.double() @ k.double().transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))
    ref_lse = torch.logsumexp(scores, -1)
    assert lse.dtype == torch.float32 and lse.shape == (2, 3, 200)
    assert float((lse.double() - ref_lse).abs().max()) < 0.05  # FP8 scores, exact softmax sums
    torch.testing.assert_close(out, fp8_attention(q, k, v, keep), atol=0, rtol=0)


def test_hadamard_is_orthonormal():
    x = torch.randn(3, 96)  # 96 = 3 blocks of 32: block-diagonal rotation
    y = torch.randn(5, 96)
    assert quant.hadamard_block_size(96) == 32
    rx, ry = quant.hadamard_rotate(x), quant.hadamard_rotate(y)
    torch.testing.assert_close(rx @ ry.T, x @ y.T, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(rx, x)


@pytest.mark.parametrize(
    "granularity, block, scale_shape",
    [
        ("tensor", None, ()),
        ("channel", None, (96, 1)),
        ("block", (32, 64), (3, 2)),
        ("block", (128, 128), (1, 1)),
        ("block", (16, 16), (6, 8)),
    ],
)
def test_weight_quantization_round_trip(granularity, block, scale_shape):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(96, 128, generator=g) * 0.02
    wq, ws = quant.quantize_weight(w, granularity, block)
    assert wq.dtype == torch.float8_e4m3fn and wq.shape == w.shape
    assert ws.dtype == torch.float32 and tuple(ws.shape) == scale_shape
    back = quant.dequantize_weight(wq, ws, granularity, block)
    rel = float((back - w).norm() / w.norm())
    assert 1e-4 < rel < 0.04, rel  # e4m3 has a 3-bit mantissa: ~2-3% error
    # the largest element of each scale group maps to the top of the e4m3 range
    assert float(wq.float().abs().max()) == quant.FP8_MAX


def test_block_scales_follow_outliers():
    w = torch.randn(64, 64) * 0.01
    w[0, 0] = 10.0  # one outlier: only its block gets a large scale
    _, ws = quant.quantize_weight(w, "block", (32, 32))
    assert ws[0, 0] > 100 * ws[1, 1]
    back = quant.dequantize_weight(*quant.quantize_weight(w, "block", (32, 32)), "block", (32, 32))
    assert float((back[32:, 32:] - w[32:, 32:]).norm() / w[32:, 32:].norm()) < 0.04


def test_rows_in_blocks_scale_shapes():
    x = torch.randn(2, 3, 300, 64)
    for gran, shape in [("tensor", (1, 1, 1)), ("head", (2, 3, 1)), ("block", (2, 3, 3))]:
        xq, s = quant.quantize_rows_in_blocks(x, gran, 128)
        assert xq.shape == x.shape and tuple(s.shape) == shape
        back = xq.float() * quant.expand_row_scale(s, 300, 128)
        assert float((back - x).norm() / x.norm()) < 0.04
