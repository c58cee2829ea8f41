"""restore_pipeline after dtype moves, memory after restore, what restore means by default, and the
one rule (fx_fp8.quant.rules.is_plain_linear) by which calibrate, prepare_model and the backend find linears."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fx_fp8
from fx_fp8 import compile_pipeline, pipeline_state, restore_pipeline
from fx_fp8.quant.rules import is_plain_linear
from fx_fp8.quant.weight_state import quantized_copies_of
from fx_fp8.quant.quantized_linear import QuantizedLinear, reachable_tensor_bytes

from toy_models import ToyScheduler


class SubLinear(nn.Linear):
    """A subclass that keeps nn.Linear.forward: a linear by the rule."""


class ScaledLinear(nn.Linear):
    """A subclass with its own forward: not a plain linear (replacing it would drop the scaling)."""

    def forward(self, x):
        return 2.0 * super().forward(x)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_qkv = SubLinear(32, 96)
        self.mid = nn.Linear(32, 32)
        self.scaled = ScaledLinear(32, 32)
        self.to_out = nn.Linear(32, 32)

    def forward(self, x):
        q, k, v = self.to_qkv(x).view(1, -1, 3, 2, 16).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, -1, 32)
        return self.to_out(self.scaled(self.mid(o)))


class Pipe:
    def __init__(self):
        torch.manual_seed(0)
        self.transformer = Toy()
        self.scheduler = ToyScheduler()

    def __call__(self, num_inference_steps=2):
        dtype = next(self.transformer.parameters()).dtype
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):  # a prepared linear's weight first
            dtype = next(
                p for p in self.transformer.parameters() if p.is_floating_point() and p.element_size() > 1
            ).dtype
        x = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
        with torch.no_grad():
            for i in range(num_inference_steps):
                x = self.scheduler.step(self.transformer(x), i, x)
        return x


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# -- dtype moves and restore ----------------------------------------------------------------
def test_restore_after_dtype_move_puts_back_linears_in_the_new_dtype():
    native = Pipe()
    native.transformer.to(torch.bfloat16)
    ref = native()
    pipe = Pipe()
    compile_pipeline(pipe, keep_weights=True)
    pipe()  # prepares (quantizes) on the first call
    pipe.transformer.to(torch.bfloat16)
    assert pipe().dtype == torch.bfloat16
    restore_pipeline(pipe)
    t = pipe.transformer
    assert type(t.to_qkv) is SubLinear and type(t.mid) is nn.Linear
    assert {p.dtype for p in t.parameters()} == {torch.bfloat16}
    out = pipe()  # crashed with a dtype mismatch when the kept fp32 linears came back
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)


def test_quantized_restore_after_dtype_move_runs_in_the_new_dtype():
    pipe = Pipe()
    compile_pipeline(pipe)
    pipe()
    pipe.transformer.to(torch.bfloat16)
    restore_pipeline(pipe, linears="quantized")
    assert isinstance(pipe.transformer.to_qkv, QuantizedLinear)
    assert pipe.transformer.to_qkv.weight.dtype == torch.float8_e4m3fn  # the quantized data is untouched
    assert pipe().dtype == torch.bfloat16


# -- what restore_pipeline means -----------------------------------------------------------
def test_restore_refuses_to_return_a_silently_quantized_model():
    pipe = Pipe()
    ref = pipe()
    compile_pipeline(pipe)
    pipe()
    compiled = pipe.transformer
    with pytest.raises(ValueError, match=r"pipe.transformer .*were freed.*linears='quantized'.*keep_weights=True"):
        restore_pipeline(pipe)
    assert pipe.transformer is compiled and pipeline_state(pipe) is not None  # nothing changed
    restore_pipeline(pipe, linears="quantized")
    assert isinstance(pipe.transformer.to_qkv, QuantizedLinear)
    assert 0 < _rel(pipe(), ref) < 0.15  # FP8, on purpose


def test_restore_before_the_first_call_and_after_prepare_false_gives_the_originals():
    pipe = Pipe()
    ref = pipe()
    compile_pipeline(pipe)
    restore_pipeline(pipe)  # nothing was prepared yet
    assert type(pipe.transformer.mid) is nn.Linear and torch.equal(pipe(), ref)
    compile_pipeline(pipe, prepare=False)
    pipe()
    restore_pipeline(pipe)
    assert torch.equal(pipe(), ref)


def test_keep_weights_without_prepare_is_refused():
    with pytest.raises(ValueError, match="keep_weights=True with prepare=False"):
        compile_pipeline(Pipe(), prepare=False, keep_weights=True)


# -- memory: the compile path's FP8 copies go with restore ------------------------------------
def test_restore_releases_the_quantized_copies_of_prepare_false():
    pipe = Pipe()
    model = pipe.transformer
    native = reachable_tensor_bytes(model)
    compile_pipeline(pipe, prepare=False)
    pipe()
    compiled = pipe.transformer
    with_copies = reachable_tensor_bytes(model)
    copies = [weakref.ref(t) for t in quantized_copies_of(model) if t.dtype == torch.float8_e4m3fn]
    assert with_copies > native and copies
    restore_pipeline(pipe)
    assert reachable_tensor_bytes(model) == native
    assert not [t for t in quantized_copies_of(model) if t.dtype == torch.float8_e4m3fn]
    torch._dynamo.reset()
    assert reachable_tensor_bytes(model) == native
    del compiled
    gc.collect()
    assert all(r() is None for r in copies), "a quantized copy is still alive after restore, reset and del"
    pipe()  # the restored model still runs


# -- one rule for linears --------------------------------------------------------------------
def test_one_linear_rule():
    assert is_plain_linear(nn.Linear(4, 4)) and is_plain_linear(SubLinear(4, 4))
    assert not is_plain_linear(ScaledLinear(4, 4))
    assert not is_plain_linear(nn.MultiheadAttention(4, 1).out_proj)  # MHA reads its weight, never calls it
    assert not is_plain_linear(nn.Conv1d(4, 4, 1))


def test_calibration_of_a_linear_subclass_is_accepted_by_prepare_and_backend():
    torch.manual_seed(0)
    model = Toy()
    x = torch.randn(1, 16, 32)
    scales = fx_fp8.calibrate(model, [(x,)])
    assert set(scales) == {"to_qkv", "mid", "to_out"}  # the subclass with its own forward is not recorded
    options = {"quantization_config": {"activation_scheme": "static", "activation_scales": scales}}
    with torch.no_grad():
        ref = model(x)
        out = torch.compile(model, backend="fp8", options=options)(x)  # the backend's name check agrees
    assert 0 < _rel(out, ref) < 0.15
    result = fx_fp8.prepare_model(model, options)  # rejected the calibration ("names no linear") before
    assert "to_qkv" in result["quantized"] and isinstance(model.to_qkv, QuantizedLinear)
    assert type(model.scaled) is ScaledLinear


def test_calibrating_or_preparing_a_prepared_model_says_so():
    torch.manual_seed(0)
    model = Toy()
    fx_fp8.prepare_model(model)
    before = dict(model.named_modules())
    with pytest.raises(ValueError, match="already prepared by fx_fp8.prepare_model.*cannot be calibrated"):
        fx_fp8.calibrate(model, [(torch.randn(1, 16, 32),)])
    with pytest.raises(ValueError, match="already prepared by fx_fp8.prepare_model.*cannot be prepared again"):
        fx_fp8.prepare_model(model)
    assert dict(model.named_modules()) == before
    pipe = Pipe()
    pipe.transformer = model
    with pytest.raises(ValueError, match="pipe.transformer: this model was already prepared.*prepare=False"):
        compile_pipeline(pipe)
    compile_pipeline(pipe, prepare=False)  # a prepared model compiles as it is
    pipe()


def test_a_write_through_data_between_pipeline_calls_is_followed():
    """compile_pipeline checks, once per pipeline call, the bytes of every weight the compile path
    quantized (a write through the `.data` alias in place bumps nothing a per-call check sees)."""
    pipe = Pipe()
    model = pipe.transformer
    compile_pipeline(pipe, prepare=False)
    first = pipe()
    with torch.no_grad():
        model.mid.weight.data.mul_(-3.0)
    native = Pipe()
    native.transformer.load_state_dict(model.state_dict())
    expected = native()
    after = pipe()
    assert _rel(first, expected) > 0.05, "the write must change the result visibly"
    assert _rel(after, expected) < 0.05
