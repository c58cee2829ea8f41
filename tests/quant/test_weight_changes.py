"""Weights written after compiling are honoured: re-quantized once per change, never per call,
or (a prepared layer, whose original is gone) refused naming the layer. A write the per-call
fingerprint sees (the Parameter's version counter or storage moved) is followed on the next
call; a write through the `.data` alias in place is not (nothing cheap shows it), and
fx_fp8.refresh_weights (compile_pipeline runs it once per pipeline call) finds it by digest."""

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import fx_fp8
from fx_fp8.tools.model_zoo.registry import MODELS as ZOO
from fx_fp8.tools.model_zoo.registry import build, build_tiny_transformer, example_inputs, make_inputs, output_tensor
from fx_fp8.quant.weight_state import compile_quantizations

TARGET = "transformer_blocks.0.ff.net.2"  # a quantized linear of the tiny Flux (a feed-forward output)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _flux():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny_transformer("flux")
    return model, example_inputs("flux", model)


def _write(model, kind: str, delta_scale: float = 0.5):
    """Change TARGET's weight (or every weight, for load_state_dict) the way `kind` does."""
    w = model.get_submodule(TARGET).weight
    gen = torch.Generator().manual_seed(1)
    delta = torch.randn(w.shape, generator=gen) * w.detach().std() * delta_scale * 4
    if kind == "no_grad_inplace":
        with torch.no_grad():
            w.add_(delta)
    elif kind == "data_assign":
        w.data = w.detach() + delta
    elif kind == "data_add":
        w.data.add_(delta)
    elif kind == "data_copy":
        w.data.copy_(w.detach() + delta)
    elif kind == "data_iadd":  # PEFT's merge: base_layer.weight.data += delta_weight
        w.data += delta
    elif kind == "load_state_dict":
        sd = {
            k: v + torch.randn(v.shape, generator=gen) * v.std() * delta_scale if v.dim() == 2 else v
            for k, v in model.state_dict().items()
        }
        model.load_state_dict(sd)
    else:
        raise AssertionError(kind)


SLOW = pytest.mark.slow
#: writes the per-call fingerprint sees / writes through the `.data` alias in place, which need refresh_weights
SEEN_PER_CALL = ("no_grad_inplace", "data_assign", "load_state_dict")
SEEN_BY_REFRESH = ("data_add", "data_copy", "data_iadd")


@pytest.mark.parametrize("kind", ["no_grad_inplace", *(pytest.param(k, marks=SLOW) for k in SEEN_PER_CALL[1:])])
def test_weight_writes_after_torch_compile_are_seen(kind):
    model, kw = _flux()
    compiled = torch.compile(model, backend="fp8", options={"quantization": "fp8"})
    with torch.no_grad():
        before = output_tensor(compiled(**kw))
        assert type(model.get_submodule(TARGET).weight) is torch.nn.Parameter, "the user's Parameter is untouched"
        frames = counters["stats"]["unique_graphs"]
        report = fx_fp8.get_reports(compiled)[0]  # the weight-only (sensitive) linears' copies count too
        fp8_linears = report.count("linear", "fp8") + report.count("linear", "weight-only")
        _write(model, kind)
        native = output_tensor(model(**kw))
        n0 = compile_quantizations(model)
        after = output_tensor(compiled(**kw))
        requantized = compile_quantizations(model) - n0
        again = output_tensor(compiled(**kw))
    assert _rel(native, before) > 0.05, "the write must change the model's output visibly"
    assert _rel(after, native) < 0.05, f"{kind}: the compiled model did not follow the new weights"
    assert requantized == (fp8_linears if kind == "load_state_dict" else 1)
    assert compile_quantizations(model) - n0 == requantized, "re-quantized again on a call without a change"
    torch.testing.assert_close(again, after)
    assert counters["stats"]["unique_graphs"] == frames, "a weight write must not recompile"


@pytest.mark.parametrize("kind", ["data_add", *(pytest.param(k, marks=SLOW) for k in SEEN_BY_REFRESH[1:])])
def test_writes_through_data_are_found_by_refresh_weights(kind):
    model, kw = _flux()
    compiled = torch.compile(model, backend="fp8", options={"quantization": "fp8"})
    with torch.no_grad():
        before = output_tensor(compiled(**kw))
        _write(model, kind)
        native = output_tensor(model(**kw))
        n0 = compile_quantizations(model)
        assert fx_fp8.refresh_weights(model) == [TARGET]
        assert compile_quantizations(model) - n0 == 1, "only the written weight is re-quantized"
        after = output_tensor(compiled(**kw))
        assert fx_fp8.refresh_weights(model) == [], "nothing changed since"
    assert _rel(native, before) > 0.05
    assert _rel(after, native) < 0.05, f"{kind}: the compiled model did not follow the new weights"


def test_reading_data_requantizes_nothing_and_changes_nothing():
    model, kw = _flux()
    compiled = torch.compile(model, backend="fp8", options={"quantization": "fp8"})
    with torch.no_grad():
        before = output_tensor(compiled(**kw))
        _ = model.get_submodule(TARGET).weight.data.abs().max()  # a read through .data
        n0 = compile_quantizations(model)
        after = output_tensor(compiled(**kw))
        assert fx_fp8.refresh_weights(model) == []
    assert compile_quantizations(model) == n0
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.parametrize("compiled_call", [False, pytest.param(True, marks=SLOW)], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", ["data_copy", "no_grad_inplace", "data_assign"])
def test_prepared_weight_written_after_prepare_is_refused_naming_the_layer(kind, compiled_call):
    """Refused on the next call, or (written in place through `.data`) by refresh_weights."""
    model, kw = _flux()
    fx_fp8.prepare_model(model, quantization="fp8")
    run = torch.compile(model, backend="fp8", options={"quantization": "fp8"}) if compiled_call else model
    with torch.no_grad():
        run(**kw)
        layer = model.get_submodule(TARGET)
        w = layer.weight
        if kind == "data_copy":
            w.data.copy_(torch.randn(w.shape).to(w.dtype))
        elif kind == "no_grad_inplace":
            w.copy_(torch.randn(w.shape).to(w.dtype))
        else:
            w.data = torch.randn(w.shape)  # full precision values into a prepared layer
        with pytest.raises(RuntimeError, match=TARGET.replace(".", r"\.")):
            if kind == "data_copy":
                fx_fp8.refresh_weights(model)
            else:
                run(**kw)


def test_prepared_weight_read_through_data_and_moved_still_runs():
    model, kw = _flux()
    fx_fp8.prepare_model(model, quantization="fp8")
    compiled = torch.compile(model, backend="fp8", options={"quantization": "fp8"})
    with torch.no_grad():
        before = output_tensor(compiled(**kw))
        _ = model.get_submodule(TARGET).weight.data.float().abs().max()
        model.to("cpu")  # a move re-wraps the prepared weights: their accepted digest moves with them
        after = output_tensor(compiled(**kw))
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@SLOW
def test_second_model_of_one_class_has_its_own_record_and_copies():
    """Compiled on its own, a second instance traces once more (its weights were not watched
    yet) and from then on has its own reports; its weights are its own."""
    models = [build_tiny_transformer("flux", seed=s) for s in (0, 1)]
    kw = example_inputs("flux", models[0])
    compiled = [torch.compile(m, backend="fp8", options={"quantization": "fp8"}) for m in models]
    with torch.no_grad():
        outs = [output_tensor(c(**kw)) for c in compiled]
        natives = [output_tensor(m(**kw)) for m in models]
    for out, native in zip(outs, natives):
        assert 1e-5 < _rel(out, native) < 0.05
    assert len(fx_fp8.get_reports(compiled[0])) == 1 and len(fx_fp8.get_reports(compiled[1])) == 1


def test_swap_based_module_conversion_works_after_compiling():
    """torch's swap-based conversion (the path FSDP2, DTensor and tensor subclasses take) swaps
    parameter objects in place: nothing of fx_fp8's may hold a weakref on, or have changed the
    class of, a user's parameter."""
    model, kw = _flux()
    compiled = torch.compile(model, backend="fp8", options={"quantization": "fp8"})
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with torch.no_grad():
            before = output_tensor(compiled(**kw))
            state = {k: v.clone() for k, v in model.state_dict().items()}
            model.to(torch.float64)
            assert model.get_submodule(TARGET).weight.dtype == torch.float64
            model.to(torch.float32)
            model.load_state_dict(state)
            after = output_tensor(compiled(**kw))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)


def _hooked_zoo_model(name):
    """Zoo model `name` with a forward pre-hook on every linear that counts its calls in a tensor
    (`hook_calls`, a non-persistent buffer: counted in the graph, nothing for Dynamo to guard on)."""
    model = build(name)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_buffer("hook_calls", torch.zeros((), dtype=torch.int64), persistent=False)
            module.register_forward_pre_hook(_count_call)
    return model


def _count_call(module, args):
    module.hook_calls.add_(1)


def _add_noise(model, layers):
    """Add twice the weight's spread in seeded noise to each layer's weight, in place."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in layers:
            w = model.get_submodule(layer).weight
            w.add_(torch.randn(w.shape, generator=gen) * w.std() * 2)


@SLOW
@pytest.mark.parametrize("name", list(ZOO))
def test_weight_writes_are_followed_across_the_zoo_with_dynamic_shapes_and_hooks(name):
    """Every zoo model (graph breaks included, where its notes say graphs=2) with a forward pre-hook
    on each linear, compiled with dynamic=True: after writing every linear's weight in place, the
    compiled model gives at two sizes what a fresh compile of the written weights gives, bit for
    bit; each written quantized weight is re-quantized once; nothing recompiles. Zoo widths that
    are not multiples of 16 have no FP8 linears: their native linears must follow the writes too.
    (Hooks are registered before compiling: Dynamo does not guard on hooks added later, whatever
    the backend: torch._dynamo.config.skip_nnmodule_hook_guards.)"""
    import diffusers

    if not hasattr(diffusers, ZOO[name].class_name):
        pytest.skip(f"{ZOO[name].class_name} is not in diffusers {diffusers.__version__}")
    options = {"quantization": "fp8", "quantization_config": {"min_features": 1}}  # the zoo is 16-32 wide
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _hooked_zoo_model(name)
        sizes = [make_inputs(name, model, variant=v) for v in (0, 2)]
        compiled = torch.compile(model, backend="fp8", dynamic=True, options=options)
        with torch.no_grad():
            before = [output_tensor(compiled(**kw)) for kw in sizes]
        linears = [e for r in fx_fp8.get_reports(compiled) for e in r.entries if e.op == "linear"]
        quantized = {e.module for e in linears if e.action in ("fp8", "weight-only")}  # both hold a copy
        written = sorted({e.module for e in linears})
        calls = {
            layer: int(model.get_submodule(layer).hook_calls)
            for layer in written
            if isinstance(model.get_submodule(layer), torch.nn.Linear)
        }  # (HiDream's MoE gate is not)
        assert min(calls.values()) >= len(sizes), f"the hooks ran in the compiled model on each call: {calls}"
        frames = counters["stats"]["unique_graphs"]
        _add_noise(model, written)
        n0 = compile_quantizations(model)
        with torch.no_grad():
            after = [output_tensor(compiled(**kw)) for kw in sizes]
        requantized = compile_quantizations(model) - n0
        recompiled = counters["stats"]["unique_graphs"] - frames
        fresh_model = _hooked_zoo_model(name)
        _add_noise(fresh_model, written)
        fresh = torch.compile(fresh_model, backend="fp8", dynamic=True, options=options)
        with torch.no_grad():
            expected = [output_tensor(fresh(**kw)) for kw in sizes]
    for b, a, e in zip(before, after, expected):
        assert _rel(e, b) > 0.05, "the writes must change the model's output visibly"
        torch.testing.assert_close(a, e, rtol=0, atol=0, msg=f"{name}: not what a compile of the new weights gives")
    assert requantized == len(quantized), (requantized, sorted(quantized))
    assert recompiled == 0, "a weight write must not recompile"
