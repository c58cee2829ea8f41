"""mode="reduce-overhead" / "max-autotune" through fx_fp8's dispatch: the step-variant and
instance choice happens in Python, outside any compiled (and, on a GPU, captured) graph, and
each step variant is its own Inductor compile (its own cudagraph tree on a GPU). On CPU
Inductor skips the capture itself; what a GPU run must confirm is in the README."""

import pytest
import torch

import fx_fp8
from fx_fp8.compile import backend
from fx_fp8.compile import downstream as downstream_module
from fx_fp8.compile.dispatch import InstanceDispatch, StepDispatch

from checks import rel_err
from toy_models import toy, toy_inputs


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_each_step_variant_is_its_own_inductor_compile_with_the_mode(mode, monkeypatch):
    compiles, returned = [], []
    real_downstream, real_compile_graph = downstream_module.compile_downstream, backend.compile_graph

    def downstream(name, gm, inputs, mode_, inductor_options=None):
        graph = str(gm.graph)  # before Inductor's own passes rewrite it in place
        fn = real_downstream(name, gm, inputs, mode_, inductor_options)
        compiles.append((name, mode_, graph, fn))
        return fn

    def compile_graph(*args, **kwargs):
        returned.append(real_compile_graph(*args, **kwargs))
        return returned[-1]

    monkeypatch.setattr(downstream_module, "compile_downstream", downstream)
    monkeypatch.setattr(backend, "compile_graph", compile_graph)
    model, kw = toy(), toy_inputs()
    compiled = torch.compile(model, backend="fp8", options={"mode": mode, "diffusion_kv_cache_skip_steps": "0"})
    with torch.no_grad():
        native = model(**kw)
        with fx_fp8.denoising_step(0):
            skipped = compiled(**kw)
        with fx_fp8.denoising_step(1):
            fp8 = compiled(**kw)
    # Inductor with the mode's options (cudagraphs for reduce-overhead), once per step variant
    assert [(n, m) for n, m, _, _ in compiles] == [("inductor", mode)] * 2
    native_graph, fp8_graph = (graph for _, _, graph, _ in compiles)
    assert "fx_fp8.fp8_attention" in fp8_graph and "fp8_attention" not in native_graph
    # the choice between the two compiled graphs is a Python call around them
    (dispatch,) = returned
    step = dispatch.first if isinstance(dispatch, InstanceDispatch) else dispatch
    assert isinstance(step, StepDispatch)
    # step 0 ran first: the native variant compiled on its first call, then the FP8 one
    # each variant is its compiled graph, called with the quantized weights its rewrite appended
    unfed = {name: getattr(fn, "fn", fn) for name, fn in step.variants.items()}
    assert unfed == {"native": compiles[0][3], "fp8": compiles[1][3]}
    assert step.calls == {"fp8": 1, "native": 1}
    assert rel_err(skipped, native) < 0.05 and 0 < rel_err(fp8, native) < 0.05


def test_parameters_and_appended_weights_are_static_inputs_of_the_compiled_graph(monkeypatch):
    """CUDA graphs copy every input AOTAutograd does not know keeps its address into their own
    buffers on each replay. The graphs fx_fp8 hands Inductor must still read as Dynamo's (its
    meta, the placeholders' sources), so parameters and the quantized weights fx_fp8 appends are
    static inputs and only activations are copied."""
    import torch.nn as nn
    from torch._functorch import aot_autograd

    seen = []
    real = aot_autograd._try_get_metadata_from_dynamo

    def spy(mod, *args, **kwargs):
        out = real(mod, *args, **kwargs)
        seen.append(([n.name for n in mod.graph.find_nodes(op="placeholder")], list(out[1])))
        return out

    monkeypatch.setattr(aot_autograd, "_try_get_metadata_from_dynamo", spy)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    with torch.no_grad():
        torch.compile(model, backend="fp8", options={"downstream": "inductor"})(torch.randn(4, 64))
    ((names, static),) = seen
    fed = [i for i, n in enumerate(names) if n.startswith("fx_fp8_")]
    params = [i for i, n in enumerate(names) if "weight" in n or "bias" in n and not n.startswith("fx_fp8_")]
    assert len(fed) == 4 and len(params) == 4
    assert sorted(static) == sorted(fed + params), (names, static)
