"""A model quantized at load (fx_fp8.DiffusersConfig) compiles as it was loaded with plain
torch.compile(backend="fp8") and compile_pipeline(pipe): its stored config supplies the attention
and linear settings, an option that agrees changes nothing, one that contradicts it is an error
naming both values."""

from __future__ import annotations

import warnings

import pytest
import torch

import fx_fp8
from fx_fp8.compile.stored_config import StoredConfigConflict, settle, stored_config
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.ops.formats import WEIGHT_ONLY
from fx_fp8.quant.quantized_linear import QuantizedLinear
from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs, output_tensor

import diffusers  # the test extra installs it: a missing one is an error, not a skip


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux")
    build_tiny_transformer("flux").save_pretrained(folder)
    return folder


def _load(folder, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return diffusers.FluxTransformer2DModel.from_pretrained(
            folder, quantization_config=fx_fp8.DiffusersConfig(**options)
        ).eval()


def _actions(compiled, model) -> dict:
    fx_fp8.clear_reports()
    with torch.no_grad():
        compiled(**example_inputs("flux", model))
    out = {"attention": set(), "linear": set()}
    for r in fx_fp8.get_reports(compiled):
        for e in r.entries:
            out[e.op].add(e.action)
    return out


@pytest.mark.parametrize(
    "options, attention, linear",
    [
        ({"quantization": "int8"}, {"native"}, {"int8", "weight-only", "native"}),  # INT8 linears only
        ({}, {"fp8"}, {"fp8", "weight-only", "native"}),  # the default: both
        (
            {"quantization": "fp8", "diffusion_kv_cache_dtype": None, "quantization_config": {"sensitive": "native"}},
            {"native"},
            {"fp8", "native"},
        ),  # no weight-only layers
    ],
)
def test_plain_torch_compile_compiles_as_loaded(flux_folder, options, attention, linear):
    model = _load(flux_folder, **options)
    assert stored_config(model) == FP8Config.load(None, **options)
    got = _actions(torch.compile(model, backend="fp8"), model)
    assert got["attention"] == attention and got["linear"] <= linear and got["linear"] & {"fp8", "int8"}


def test_an_agreeing_option_changes_nothing_and_a_contradicting_one_names_both(flux_folder):
    model = _load(flux_folder, quantization="int8")
    got = _actions(
        torch.compile(model, backend="fp8", options={"quantization": "int8", "lowering": "reference"}), model
    )
    assert got["attention"] == {"native"} and "int8" in got["linear"]
    torch._dynamo.reset()
    with pytest.raises(
        Exception,
        match=r"quantization: the model was quantized at load with 'int8', the options "
        r"ask for 'fp8'",
    ):
        _actions(torch.compile(model, backend="fp8", options={"quantization": "fp8"}), model)


def test_settle_keeps_where_the_kernels_run_free():
    stored = FP8Config.load(None, quantization="int8")
    assert settle(stored) is stored
    assert settle(stored, lowering="reference", downstream="eager").lowering == "reference"
    with pytest.raises(StoredConfigConflict, match="diffusion_kv_cache_dtype: .* None, the options ask for 'fp8'"):
        settle(stored, diffusion_kv_cache_dtype="fp8")
    # a step policy is the run's, on top of the loaded weights (a model folder's own fx_fp8.yaml)
    assert str(settle(stored, quantization_skip_steps="first:1").quantization_config.skip_steps) == "first:1"
    # a base config is compared whole: attention selectors next to int8 switch attention on
    with pytest.raises(StoredConfigConflict, match="diffusion_kv_cache_dtype"):
        settle(stored, {"quantization": "int8", "diffusion_kv_cache_skip_steps": "0"})


@pytest.mark.slow
def test_compile_pipeline_compiles_a_transformer_loaded_quantized_as_loaded(flux_folder):
    from fx_fp8.tools.model_zoo.registry import build_tiny_pipeline

    pipe, kwargs = build_tiny_pipeline("flux")
    pipe.transformer = _load(flux_folder, quantization="int8")
    layers = {n: type(m) for n, m in pipe.transformer.named_modules()}
    with pytest.raises(StoredConfigConflict, match=r"pipe.transformer: .*quantization: .*'int8'.*'fp8'"):
        fx_fp8.compile_pipeline(pipe, quantization="fp8")
    assert {n: type(m) for n, m in pipe.transformer.named_modules()} == layers  # nothing changed
    fx_fp8.compile_pipeline(pipe)  # no refusal: prepare is not asked of a model quantized at load
    with torch.no_grad():
        pipe(**kwargs, num_inference_steps=1)
    rows = {r.component: r for r in fx_fp8.summary(pipe)}
    assert rows["transformer"].attention_fp8 == 0 < rows["transformer"].attention_total
    assert any(isinstance(m, QuantizedLinear) and m.method == "int8" for m in pipe.transformer.modules())


# -- a weight-only load: no W8A8 layer ---------------------------------------------------------------
#: the blocks' linears kept native, so the load's quantized layers are the sensitive ones, weight-only
#: (sensitive: weight_only, the default); the config has no key that makes every linear weight-only
BLOCK_LINEARS = r"re:.*transformer_blocks\.\d+\.(attn|ff|ff_context|proj_mlp|proj_out)\b.*"
FP8_ATTENTION = "fx_fp8.fp8_attention.default"


def _weight_only_load(folder, attention):
    model = _load(folder, ignored_layers=[BLOCK_LINEARS], diffusion_kv_cache_dtype=attention)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and {m.act_granularity for m in layers} == {WEIGHT_ONLY}  # a weight-only-only load
    return model, len(layers)


def _rel(out, ref) -> float:
    return float((out - ref).norm() / ref.norm())


@pytest.mark.parametrize("attention", [None, "fp8"])
def test_plain_torch_compile_compiles_a_weight_only_load_as_loaded(flux_folder, downstream_graphs, attention):
    model, weight_only = _weight_only_load(flux_folder, attention)
    kw = example_inputs("flux", model)
    with torch.no_grad():
        eager = output_tensor(model(**kw))
        out = output_tensor(torch.compile(model, backend="fp8")(**kw))
    targets = [str(n.target) for gm in downstream_graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("fx_fp8.weight_only_linear.default") == weight_only
    assert targets.count("fx_fp8.scaled_mm.default") == 0
    assert targets.count(FP8_ATTENTION) == (4 if attention else 0)  # the tiny Flux's four attention calls
    if attention:
        assert 0 < _rel(out, eager) < 0.05  # FP8 attention's error; the linears are the loaded ones
    else:
        assert torch.equal(out, eager)  # the compiled weight-only linears are the eager ones


@pytest.mark.slow
@pytest.mark.parametrize("attention", [None, "fp8"])
def test_compile_pipeline_compiles_a_weight_only_load_as_loaded(flux_folder, attention):
    from fx_fp8.tools.model_zoo.registry import build_tiny_pipeline

    pipe, kwargs = build_tiny_pipeline("flux")
    pipe.transformer, weight_only = _weight_only_load(flux_folder, attention)
    layers = {n: id(m) for n, m in pipe.transformer.named_modules()}
    loaded = pipe.transformer

    def images():
        torch.manual_seed(0)  # the pipeline draws its latents from the global generator
        with torch.no_grad():
            return pipe(**kwargs, num_inference_steps=1, output_type="pt").images

    eager = images()
    fx_fp8.compile_pipeline(pipe)
    compiled = getattr(pipe.transformer, "_orig_mod", pipe.transformer)
    assert compiled is loaded and {n: id(m) for n, m in compiled.named_modules()} == layers  # not prepared again
    out = images()
    row = {r.component: r for r in fx_fp8.summary(pipe)}["transformer"]
    assert (row.linear_w8a8, row.linear_weight_only) == (0, weight_only)
    assert row.attention_fp8 == (row.attention_total if attention else 0) and row.attention_total == 4
    if attention:
        assert 0 < _rel(out, eager) < 0.05
    else:
        assert torch.equal(out, eager)
