"""Offloading with FP8: diffusers' group offload (block / leaf level), model CPU offload and
accelerate's per-module hooks, with compile_pipeline and with prepare_model.

CPU only here: onload and offload devices are both the CPU, so these tests check what does not
need a second device: outputs within FP8 error of the same offload without fx_fp8, that every
quantized weight and scale belongs to the offload group of its module, and that no hook keeps a
replaced (original) weight alive. What only a GPU run shows is listed in docs/lifecycle.md.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import fx_fp8
from fx_fp8 import pipeline_state
from fx_fp8.tools.model_zoo.registry import build_tiny_pipeline
from fx_fp8.quant.quantized_linear import QuantizedLinear

CPU = torch.device("cpu")


def _flux():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_tiny_pipeline("flux")


def _run(pipe, kwargs):
    return pipe(
        **kwargs, num_inference_steps=2, output_type="latent", generator=torch.Generator().manual_seed(0)
    ).images


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _enable(pipe, form: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if form == "model":
            pipe.enable_model_cpu_offload(device="cpu")
        else:
            pipe.transformer.enable_group_offload(
                onload_device=CPU,
                offload_device=CPU,
                offload_type=form,
                num_blocks_per_group=1 if form == "block_level" else None,
            )


def _group_tensors(model: nn.Module) -> dict:
    """{id: tensor} of every tensor diffusers' group offloading hooks move."""
    from diffusers.hooks.group_offloading import _GROUP_OFFLOADING

    out = {}
    for m in model.modules():
        registry = getattr(m, "_diffusers_hook", None)
        hook = registry.get_hook(_GROUP_OFFLOADING) if registry is not None else None
        if hook is None:
            continue
        g = hook.group
        for t in [t for gm in g.modules for t in list(gm.parameters()) + list(gm.buffers())] + g.parameters + g.buffers:
            out[id(t)] = t
    return out


def _check_groups(model: nn.Module) -> None:
    """Every tensor of every QuantizedLinear moves with a group, and no group moves (or keeps
    alive) a tensor the model no longer holds, such as a replaced original weight."""
    moved = _group_tensors(model)
    own = {id(t) for t in list(model.parameters()) + list(model.buffers())}
    quantized = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    assert quantized
    for name, m in quantized:
        for t in list(m.parameters()) + [b for b in m.buffers() if b is not None]:
            assert id(t) in moved, f"{name}: a quantized tensor no offload group moves"
    stale = [t for i, t in moved.items() if i not in own]
    assert not stale, (
        f"{len(stale)} tensors ({sum(t.nbytes for t in stale)} bytes) kept by offload groups, not by the model"
    )


def _native(form: str):
    pipe, kwargs = _flux()
    _enable(pipe, form)
    return _run(pipe, kwargs)


# -- group offloading -----------------------------------------------------------------------
@pytest.mark.parametrize("form", ["leaf_level", "block_level"])
def test_prepare_model_then_group_offload_matches_native_offload(form):
    """block_level: the top-level layers (embedders, proj_out: weight-only by default) are moved by
    their module and listed among the group's parameters too; both must stay the model's tensors."""
    ref = _native(form)
    pipe, kwargs = _flux()
    fx_fp8.prepare_model(pipe.transformer)
    _enable(pipe, form)
    assert 0 < _rel(_run(pipe, kwargs), ref) < 0.05
    _check_groups(pipe.transformer)


def test_moving_a_quantized_linear_keeps_its_parameter_objects():
    """Group offloading (its parameter lists), optimizers and hooks hold parameters by identity:
    .to() moves a QuantizedLinear's weight in place, as nn.Linear's, and keeps its accepted bytes."""
    model = nn.Sequential(nn.Linear(64, 64).to(torch.bfloat16))
    fx_fp8.prepare_model(model)
    q = model[0]
    weight, bias = q.weight, q.bias
    model.to(CPU)
    assert q.weight is weight and q.bias is bias and isinstance(q, QuantizedLinear)
    fresh = nn.Sequential(nn.Linear(64, 64).to(torch.bfloat16))
    fx_fp8.prepare_model(fresh)
    weight = fresh[0].weight
    fresh.to(CPU).half()  # the bias and output dtype change; the quantized weight stays, accepted
    assert fresh[0].weight is weight and weight.dtype == torch.float8_e4m3fn and fresh[0].bias.dtype == torch.float16
    fresh[0].check_weight(check_bytes=True)


@pytest.mark.slow
def test_restore_with_kept_weights_rebuilds_the_groups():
    pipe, kwargs = _flux()
    ref = _run(pipe, kwargs)
    _enable(pipe, "leaf_level")
    fx_fp8.compile_pipeline(pipe, {"lowering": "reference"}, keep_weights=True)
    original = pipeline_state(pipe).originals["transformer"]
    _run(pipe, kwargs)
    assert any(isinstance(m, QuantizedLinear) for m in original.modules())
    fx_fp8.restore_pipeline(pipe)
    assert not any(isinstance(m, QuantizedLinear) for m in original.modules())
    moved = _group_tensors(original)
    assert {id(p) for p in original.parameters()} <= set(moved)  # every original weight is offloaded again
    assert torch.equal(_run(pipe, kwargs), ref)


# -- accelerate: sequential offload keeps weights on the meta device --------------------------
def test_compile_pipeline_refuses_weights_offloaded_to_meta():
    pipe, _ = _flux()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe.enable_sequential_cpu_offload(device="cpu")
    transformer = pipe.transformer
    with pytest.raises(ValueError, match=r"pipe.transformer has \d+ weights on the meta device.*prepare=False"):
        fx_fp8.compile_pipeline(pipe)
    assert pipe.transformer is transformer and not hasattr(pipe, "_fx_fp8")


def test_accelerate_module_hooks_move_quantized_weights_and_scales():
    from accelerate import cpu_offload

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    fx_fp8.prepare_model(model)
    x = torch.randn(4, 64)
    with torch.no_grad():
        ref = model(x)
    cpu_offload(model, execution_device=CPU)  # the hooks pipe.enable_sequential_cpu_offload installs
    q = model[0]
    assert isinstance(q, QuantizedLinear) and q.weight.device.type == "meta"
    stored = q._hf_hook.weights_map
    assert stored["weight"].dtype == torch.float8_e4m3fn and "weight_scale" in stored
    with torch.no_grad():
        assert torch.equal(model(x), ref)  # the quantized data and its scale came back intact


# -- end to end under torch.compile (slow) -------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("form", ["model", "block_level", "leaf_level"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_offload_with_compile_pipeline_matches_native_offload(form, when):
    ref = _native(form)
    pipe, kwargs = _flux()
    if when == "before":
        _enable(pipe, form)
    fx_fp8.compile_pipeline(pipe, {"lowering": "reference"})
    if when == "after":
        _enable(pipe, form)
    original = pipeline_state(pipe).originals["transformer"]
    out = _run(pipe, kwargs)
    assert 0 < _rel(out, ref) < 0.05
    assert pipeline_state(pipe).prepared["transformer"]["quantized"]
    if form == "model":
        assert (
            getattr(pipe.transformer, "_hf_hook", None) is not None or getattr(original, "_hf_hook", None) is not None
        )
    else:
        _check_groups(original)
    fx_fp8.restore_pipeline(pipe, linears="quantized")
    assert 0 < _rel(_run(pipe, kwargs), ref) < 0.05
    if form != "model":
        _check_groups(original)
