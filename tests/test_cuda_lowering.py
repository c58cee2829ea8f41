"""The CUDA lowering: its decisions on CPU (fake CUDA tensors), its kernels on a GPU (marked cuda)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from fx_fp8.config import FP8Config
from fx_fp8.ops import quant
from fx_fp8.ops.cuda import CudaLowering, is_key_padding_mask
from fx_fp8.ops.lowering import get_lowering

CUDA = torch.cuda.is_available()
cuda = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]
ATT = FP8Config().attention
QCFG = FP8Config().quantization_config


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def fake_cuda(*shapes, dtype=torch.bfloat16):
    with FakeTensorMode():
        return [torch.empty(*s, device="cuda", dtype=dtype) for s in shapes]


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


# -- CPU: decisions --------------------------------------------------------------
def test_registry_returns_cuda_lowering():
    low = get_lowering("cuda")
    assert isinstance(low, CudaLowering) and low.name == "cuda"


def test_cpu_tensors_are_refused_with_reason():
    q = torch.empty(1, 2, 64, 128)
    low = get_lowering("cuda")
    assert "CUDA tensors" in low.attention_reason(q, q, q, ATT)
    assert "CUDA tensors" in low.linear_reason(torch.empty(4, 64), torch.empty(32, 64), QCFG)


def test_attention_reasons_on_hopper(hopper):
    import triton  # noqa: F401  a test dependency (pyproject [test]); must not skip silently
    low = get_lowering("cuda")
    q, q80 = fake_cuda((1, 2, 64, 128), (1, 2, 64, 80))
    assert low.attention_reason(q, q, q, ATT) is None
    assert "head dim 80" in low.attention_reason(q80, q80, q80, ATT)
    assert "kv_block=96" in low.attention_reason(q, q, q, FP8Config.load(None, attention={"kv_block": 96}).attention)
    key_mask, full_mask = fake_cuda((1, 1, 1, 64), (1, 1, 64, 64), dtype=torch.bool)
    assert low.attention_reason(q, q, q, ATT, key_mask) is None
    assert "mask not supported" in low.attention_reason(q, q, q, ATT, full_mask)


def test_pre_ada_gpu_has_no_fp8_tensor_cores(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    low = get_lowering("cuda")
    q, w = fake_cuda((1, 2, 64, 128), (64, 64))
    assert "sm80 has no FP8 tensor cores" in low.attention_reason(q, q, q, ATT)
    assert low.weight_only(w) == "GPU sm80 has no FP8 tensor cores"


def test_linear_reasons(hopper):
    low = get_lowering("cuda")
    x, w, w_odd = fake_cuda((8, 64), (64, 64), (40, 64))
    assert low.weight_only(w) is None
    assert low.linear_reason(x, w, QCFG) is None
    assert "not multiples of 16" in low.linear_reason(x, w_odd, QCFG)


@pytest.mark.parametrize("shape,ok", [((2, 1, 1, 77), True), ((77,), True), ((2, 77), False), ((1, 3, 1, 77), True),
                                      ((1, 1, 50, 77), False), ((3, 1, 1, 77), False), ((1, 1, 1, 76), False)])
def test_key_padding_mask_shapes(shape, ok):
    assert is_key_padding_mask(shape, b=2, h=3, s_k=77) is ok


def test_key_bias_from_bool_and_float_masks():
    import triton  # noqa: F401  a test dependency (pyproject [test]); must not skip silently
    from fx_fp8.ops.triton_fp8_attention import LOG2E, key_bias

    keep = torch.ones(2, 1, 1, 130, dtype=torch.bool)
    keep[1, ..., 100:] = False
    bias = key_bias(keep, 2, 4, 130)
    assert bias.shape == (2, 1, 256)
    assert torch.all(bias[0, 0, :130] == 0) and torch.all(torch.isinf(bias[1, 0, 100:]))
    assert torch.all(torch.isinf(bias[:, :, 130:]))  # padding keys
    add = torch.randn(1, 1, 1, 130)
    assert torch.allclose(key_bias(add, 2, 4, 130)[1, 0, :130], add[0, 0, 0] * LOG2E)
    with pytest.raises(ValueError, match="key-padding"):
        key_bias(torch.ones(1, 1, 5, 130, dtype=torch.bool), 2, 4, 130)


def test_cuda_attention_on_cpu_tensors_raises_clearly():
    import triton  # noqa: F401  a test dependency (pyproject [test]); must not skip silently
    q = torch.randn(1, 1, 16, 64)
    with pytest.raises(RuntimeError, match="lowering='reference'"):
        torch.ops.fx_fp8.fp8_attention(q, q, q, None, 0.125, "block", 128, 256, True, True, True, 448.0, "cuda")


# -- GPU: numerics ---------------------------------------------------------------
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_attention_matches_sdpa_and_reference(d, masked):
    torch.manual_seed(0)
    b, h, s = 2, 3, 1000
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    v = v + 0.5  # zero-mean V averages to ~0 under flat attention, inflating any relative error to ~5%
    mask = None
    if masked:
        mask = torch.ones(b, 1, 1, s, dtype=torch.bool, device="cuda")
        mask[1, ..., 700:] = False
    kw = dict(attn_mask=mask, softmax_scale=1 / math.sqrt(d), granularity="block", q_block=128, kv_block=256,
              hadamard=True, smooth_k=True, quantize_p=True, p_scale=448.0)
    out = get_lowering("cuda").attention(q, k, v, **kw)
    ref = get_lowering("reference").attention(q, k, v, **kw)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.shape == sdpa.shape and out.dtype == torch.bfloat16
    assert rel(out, sdpa) < 3e-2
    assert rel(out, ref) < 3e-2


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_quantization_kernels_match_reference():
    from fx_fp8.ops import triton_quant as tq

    torch.manual_seed(0)
    x = torch.randn(512, 3072, device="cuda", dtype=torch.bfloat16) * 3
    xq, xs = tq.quantize_rows_fp8(x)
    rq, rs = quant.quantize_per_row(x)
    assert torch.equal(xs, rs) and torch.equal(xq.view(torch.uint8), rq.view(torch.uint8))
    q, k, v = (torch.randn(1, 4, 700, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ours = tq.prepare_qkv_blocks(q, k, v, q_block=128, kv_block=256, hadamard=True, smooth_k=True)
    ref = quant.prepare_qkv(q, k, v, granularity="block", q_block=128, kv_block=256, hadamard=True, smooth_k=True)
    codes = (ours[0][:, :, :700], ours[2][:, :, :700], ours[4][..., :700].transpose(-1, -2))
    for a, r in zip(codes, ref[0::2]):  # fp32 summation order may move a rare value across a rounding boundary
        assert (a.float() != r.float()).float().mean().item() < 1e-4
    for a, r in zip(ours[1::2], ref[1::2]):
        assert torch.allclose(a, r, rtol=1e-5, atol=0)


@pytest.mark.parametrize("granularity,block,act", [("channel", None, "token"), ("tensor", None, "tensor"),
                                                   ("channel", None, "tensor"), ("block", (128, 128), "token")])
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_linear_matches_reference(granularity, block, act):
    torch.manual_seed(0)
    x = torch.randn(3, 100, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(768, 512, device="cuda", dtype=torch.bfloat16) / 20
    bias = torch.randn(768, device="cuda", dtype=torch.bfloat16)
    wq, ws = quant.quantize_weight(w, granularity, block)
    kw = dict(weight_granularity=granularity, weight_block=block, act_granularity=act, weight_only=False)
    out = get_lowering("cuda").linear(x, wq, ws, bias, None, **kw)
    ref = get_lowering("reference").linear(x, wq, ws, bias, None, **kw)
    assert out.shape == (3, 100, 768) and out.dtype == torch.bfloat16
    assert rel(out, ref) < 1e-2
    assert rel(out, F.linear(x, w, bias)) < 6e-2
    wo = get_lowering("cuda").linear(x, wq, ws, bias, None, **{**kw, "weight_only": True})
    assert rel(wo, F.linear(x, quant.dequantize_weight(wq, ws, granularity, block).to(x.dtype), bias)) < 1e-2


def _flux_head_dim_64():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                             attention_head_dim=64, num_attention_heads=2, joint_attention_dim=128,
                                             pooled_projection_dim=128, axes_dims_rope=(16, 24, 24))
    model = model.to("cuda", torch.bfloat16).eval()
    img, txt = 256, 32
    g = torch.Generator(device="cuda").manual_seed(0)
    kwargs = dict(hidden_states=torch.randn(1, img, 64, device="cuda", generator=g, dtype=torch.bfloat16),
                  encoder_hidden_states=torch.randn(1, txt, 128, device="cuda", generator=g, dtype=torch.bfloat16),
                  pooled_projections=torch.randn(1, 128, device="cuda", generator=g, dtype=torch.bfloat16),
                  timestep=torch.full((1,), 0.5, device="cuda", dtype=torch.bfloat16),
                  img_ids=torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(16.0), torch.arange(16.0),
                                                     indexing="ij"), -1).reshape(-1, 3).cuda(),
                  txt_ids=torch.zeros(txt, 3, device="cuda"), return_dict=False)
    return model, kwargs


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_backend_fp8_on_flux_with_inductor(mode):
    import fx_fp8

    model, kwargs = _flux_head_dim_64()
    with torch.no_grad():
        expected = model(**kwargs)[0]
        compiled = torch.compile(model, backend="fp8", fullgraph=True, mode=mode)  # mode: CUDA graphs via Inductor
        outs = []
        for _ in range(3):
            torch.compiler.cudagraph_mark_step_begin()
            outs.append(compiled(**kwargs)[0].clone())  # CUDA-graph outputs are overwritten by the next replay
    report = fx_fp8.get_reports()[-1]
    assert report.lowering == "cuda" and report.downstream == "inductor"
    actions = {(e.op, e.action) for e in report.entries}
    assert ("attention", "fp8") in actions and ("linear", "fp8") in actions
    for out in outs:
        assert torch.isfinite(out).all()
        assert rel(out, expected) < 0.1
    assert torch.equal(outs[1], outs[2])  # replays are deterministic
