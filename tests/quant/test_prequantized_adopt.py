"""fx_fp8.adopt_prequantized: pre-quantized FP8 layers (diffusers' BFL fp8r modules, a ModelOpt FP8
export's tensors) become QuantizedLinear modules that hold the very same weight tensors."""

import warnings

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

import fx_fp8
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.passes.base import WEIGHT_ORIGIN
from fx_fp8.quant.prequantized import weight_origin
from fx_fp8.quant.weight_state import compile_quantizations
from fx_fp8.quant.quantized_linear import QuantizedLinear
from graph_capture import Capture, compile_stored, graph_module_of
from prequantized_layouts import FP8, bfl_checkpoint, bfl_stack, float_stack, modelopt_stack, modelopt_state_dict

DIMS = (64, 96, 64)
SCALED_MM = torch.ops.fx_fp8.scaled_mm.default


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_bfl_modules_become_quantized_linears_sharing_their_tensors():
    sd = bfl_checkpoint(float_stack(DIMS))
    model = bfl_stack(sd, 2, DIMS)
    x = torch.randn(3, 5, DIMS[0], dtype=torch.bfloat16)
    with torch.no_grad():
        before = model(x)
    scales = [layer.weight_scale for layer in model.layers]
    result = fx_fp8.adopt_prequantized(model)
    assert result == {
        "adopted": {
            "layers.0": "BFL fp8r checkpoint (per-channel weight scales)",
            "layers.1": "BFL fp8r checkpoint (per-channel weight scales)",
        },
        "weight_only": [],
        "kept": {},
        "state_dict_keys": [],
    }
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, QuantizedLinear) and layer.weight_granularity == "channel"
        assert layer.weight.data_ptr() == sd[f"layers.{i}.weight"].data_ptr() and layer.weight.dtype == FP8
        assert layer.weight_scale.data_ptr() == scales[i].data_ptr() and layer.weight_scale.shape == (DIMS[i + 1], 1)
        assert layer.input_scale is None and layer.act_granularity == "token"
        assert weight_origin(layer) == result["adopted"][f"layers.{i}"]
    with torch.no_grad():
        after = model(x)
    assert rel(after, before) < 0.08  # per-token FP8 activations against the bf16 dequantized forward


def test_compiled_adopted_layers_read_the_adopted_weights_and_name_their_origin():
    sd = bfl_checkpoint(float_stack(DIMS))
    model = bfl_stack(sd, 2, DIMS)
    fx_fp8.adopt_prequantized(model)
    x = torch.randn(3, 5, DIMS[0], dtype=torch.bfloat16)
    cap = Capture()
    with torch.no_grad():
        torch.compile(model, backend=cap, fullgraph=True)(x)
    ((gm, inputs),) = cap.graphs
    made = compile_quantizations(model)
    fn, report = compile_stored(gm, inputs, FP8Config.from_kwargs(quantization="fp8"))
    placeholders = [n for n in graph_module_of(fn).graph.nodes if n.op == "placeholder"]
    mm = [n for n in graph_module_of(fn).graph.nodes if n.op == "call_function" and n.target == SCALED_MM]
    assert [inputs[placeholders.index(n.args[2])].data_ptr() for n in mm] == [
        sd[f"layers.{i}.weight"].data_ptr() for i in range(2)
    ]
    assert all(n.meta[WEIGHT_ORIGIN] == "BFL fp8r checkpoint (per-channel weight scales)" for n in mm)
    assert [e.action for e in report.entries if e.op == "linear"] == ["fp8", "fp8"]
    with torch.no_grad():
        fn(*inputs)
    assert compile_quantizations(model) == made


@pytest.mark.parametrize(
    "per_channel,static,scale_shape",
    [(False, True, ()), (False, False, (1,)), (True, False, None), (True, True, (-1, 1))],
)
def test_modelopt_export_becomes_quantized_linears_holding_its_tensors(tmp_path, per_channel, static, scale_shape):
    """A ModelOpt FP8 export written to safetensors and read back: the model built in bf16 gets
    QuantizedLinear layers holding the file's tensors; its output equals the export's own eager
    forward (a module that dequantizes the same tensors) within FP8 activation error."""
    x = torch.randn(2, 5, DIMS[0], dtype=torch.bfloat16)
    reference = float_stack(DIMS)
    export = modelopt_state_dict(
        reference, per_channel=per_channel, static_x=x if static else None, scale_shape=scale_shape
    )
    save_file(export, tmp_path / "model.safetensors")
    sd = load_file(tmp_path / "model.safetensors")
    model = float_stack(DIMS, seed=1)  # other weights: everything comes from the file
    result = fx_fp8.adopt_prequantized(model, state_dict=sd)
    model.load_state_dict({k: v for k, v in sd.items() if k not in result["state_dict_keys"]}, strict=False)
    granularity = "channel" if per_channel else "tensor"
    suffix = ", static input scale" if static else ""
    assert result["adopted"] == {
        f"layers.{i}": f"ModelOpt FP8 checkpoint (per-{granularity} weight scales{suffix})" for i in range(2)
    }
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, QuantizedLinear) and layer.weight_granularity == granularity
        assert layer.weight.data_ptr() == sd[f"layers.{i}.weight"].data_ptr()
        assert torch.equal(layer.weight.view(torch.uint8), export[f"layers.{i}.weight"].view(torch.uint8))
        assert layer.weight_scale.data_ptr() == sd[f"layers.{i}.weight_scale"].data_ptr()
        assert (layer.input_scale is not None) == static
        if static:
            assert layer.input_scale.item() == sd[f"layers.{i}.input_scale"].item()
    keys = {f"layers.{i}.{k}" for i in range(2) for k in ("weight", "weight_scale", "bias")}
    assert set(result["state_dict_keys"]) == keys | ({f"layers.{i}.input_scale" for i in range(2)} if static else set())
    with torch.no_grad():
        own = modelopt_stack(export, 2)(x)
        out = model(x)
    assert rel(out, own) < 0.08


def test_only_the_layers_the_export_quantizes_are_adopted():
    model = float_stack(DIMS)
    sd = modelopt_state_dict(model, per_channel=True, names={"layers.1"})  # layers.0 excluded from quantization
    result = fx_fp8.adopt_prequantized(model, state_dict=sd)
    assert list(result["adopted"]) == ["layers.1"]
    assert type(model.layers[0]) is nn.Linear and isinstance(model.layers[1], QuantizedLinear)


def _export(**change):
    sd = modelopt_state_dict(float_stack(DIMS), per_channel=True)
    sd.update(change)
    return {k: v for k, v in sd.items() if v is not None}


@pytest.mark.parametrize(
    "change,message",
    [
        ({"layers.1.weight_scale_2": torch.tensor(1.0)}, "layers.1: NVFP4 layout"),
        ({"layers.0.weight_scale": torch.rand(48)}, "layers.0: weight_scale torch.float32 [48]"),
        ({"layers.0.weight_scale": torch.rand(2, 1, 2, 1)}, "block scales are not supported"),
        (
            {"layers.1.weight": torch.randn(64, 96)},
            "layers.1: weight torch.float32 [64, 96], expected torch.float8_e4m3fn",
        ),
        ({"layers.1.weight": None}, "layers.1: no weight"),
        ({"layers.0.input_scale": torch.rand(2)}, "layers.0: input_scale torch.float32 [2]"),
        (
            {"blocks.3.weight_scale": torch.rand(()), "blocks.3.weight": torch.zeros(4, 4).to(FP8)},
            "blocks.3: the checkpoint quantizes it but the model has no module of that name",
        ),
        (
            {"layers.weight_scale": torch.rand(()), "layers.weight": torch.zeros(4, 4).to(FP8)},
            "layers: the checkpoint quantizes it but the model has a ModuleList there",
        ),
    ],
)
def test_bad_entries_are_named_and_change_nothing(change, message):
    model = float_stack(DIMS)
    weights = [layer.weight for layer in model.layers]
    with pytest.raises(ValueError, match="nothing was changed") as err:
        fx_fp8.adopt_prequantized(model, state_dict=_export(**change))
    assert message in str(err.value)
    assert [type(layer) for layer in model.layers] == [nn.Linear, nn.Linear]
    assert [layer.weight for layer in model.layers] == weights
    assert "save_pretrained" not in model.__dict__


def test_a_linear_with_its_own_forward_is_refused():
    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    model = float_stack(DIMS)
    model.layers[1] = Scaled(DIMS[1], DIMS[2]).to(torch.bfloat16)
    with pytest.raises(
        ValueError, match="layers.1: the checkpoint quantizes it but the model has a Scaled there with its own forward"
    ):
        fx_fp8.adopt_prequantized(model, state_dict=modelopt_state_dict(model, per_channel=True))
    assert type(model.layers[0]) is nn.Linear


def test_a_hooked_module_is_kept_and_said_so():
    model = bfl_stack(bfl_checkpoint(float_stack(DIMS)), 2, DIMS)
    model.layers[0]._hf_hook = object()  # accelerate's offload hook lives on the module object
    result = fx_fp8.adopt_prequantized(model)
    assert list(result["adopted"]) == ["layers.1"]
    assert result["kept"]["layers.0"].startswith("carries an accelerate hook (object): not replaced")
    assert type(model.layers[0]).__name__ == "BFLFP8RLinear" and isinstance(model.layers[1], QuantizedLinear)


def test_unloaded_bfl_module_is_refused():
    from diffusers.quantizers.bfl.utils import BFLFP8RLinear

    with torch.device("meta"):
        model = nn.Sequential(BFLFP8RLinear(64, 32, compute_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"0: BFLFP8RLinear whose weights were never loaded"):
        fx_fp8.adopt_prequantized(model)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"model": "not a model"}, "expects a torch.nn.Module, got str"),
        ({"state_dict": [1, 2]}, "state_dict must be a mapping of tensors"),
        ({"config": {"layers.0.weight": torch.zeros(1)}}, "pass a checkpoint's tensors as state_dict="),
        ({"quantization_config": {"activation_granularity": "group"}}, "activation_granularity"),
    ],
)
def test_bad_arguments(kwargs, message):
    args = {"model": float_stack(DIMS), **kwargs}
    with pytest.raises(ValueError, match=message):
        fx_fp8.adopt_prequantized(args.pop("model"), **args)


def test_a_model_without_prequantized_layers_is_left_alone():
    model = float_stack(DIMS)
    assert fx_fp8.adopt_prequantized(model, state_dict={}) == {
        "adopted": {},
        "weight_only": [],
        "kept": {},
        "state_dict_keys": [],
    }
    assert [type(layer) for layer in model.layers] == [nn.Linear, nn.Linear]
    assert "save_pretrained" not in model.__dict__ and "_fx_fp8_prepared" not in model.__dict__


def test_adopted_weights_written_later_are_caught():
    """The adopted bytes are accepted with their scales, as prepare_model's are: a write afterwards
    raises naming the layer instead of running with stale scales (on the next call; through the
    `.data` alias in place, at fx_fp8.refresh_weights, which compile_pipeline runs per call)."""
    model = bfl_stack(bfl_checkpoint(float_stack(DIMS)), 2, DIMS)
    fx_fp8.adopt_prequantized(model)
    with torch.no_grad():
        model.layers[1].weight.copy_(torch.zeros(DIMS[2], DIMS[1]).to(FP8))
    with pytest.raises(RuntimeError, match="prepared layer layers.1 was written"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(torch.randn(2, DIMS[0], dtype=torch.bfloat16))
    model = bfl_stack(bfl_checkpoint(float_stack(DIMS)), 2, DIMS)
    fx_fp8.adopt_prequantized(model)
    with torch.no_grad():
        model.layers[1].weight.data.copy_(torch.zeros(DIMS[2], DIMS[1]).to(FP8))
    with pytest.raises(RuntimeError, match="prepared layer layers.1 was written"):
        fx_fp8.refresh_weights(model)


class WithProjOut(nn.Module):
    """A block linear and a final projection (a sensitive layer by name)."""

    def __init__(self, block, proj_out):
        super().__init__()
        self.block, self.proj_out = block, proj_out

    def forward(self, x):
        return self.proj_out(self.block(x))


def test_the_config_decides_as_for_prepare_model():
    """A sensitive layer runs weight-only on the stored weight (the default), or is kept native;
    ignored_layers and quantization off keep layers as they are."""
    stack = bfl_stack(bfl_checkpoint(float_stack(DIMS)), 2, DIMS)
    model = WithProjOut(stack.layers[0], stack.layers[1])
    weight = model.proj_out.weight
    result = fx_fp8.adopt_prequantized(model)
    assert result["weight_only"] == ["proj_out"] and set(result["adopted"]) == {"block", "proj_out"}
    assert model.proj_out.weight_only and model.proj_out.weight.data_ptr() == weight.data_ptr()
    assert not model.block.weight_only

    for options, kept in [
        ({"quantization_config": {"sensitive": "native"}}, {"proj_out"}),
        ({"ignored_layers": ["block"]}, {"block"}),
        ({"quantization": None}, {"block", "proj_out"}),
    ]:
        stack = bfl_stack(bfl_checkpoint(float_stack(DIMS)), 2, DIMS)
        model = WithProjOut(stack.layers[0], stack.layers[1])
        result = fx_fp8.adopt_prequantized(model, **options)
        assert set(result["kept"]) == kept, options
        assert {n for n, m in model.named_children() if type(m).__name__ == "BFLFP8RLinear"} == kept


def test_an_export_layer_kept_native_gets_its_dequantized_weight():
    model = float_stack(DIMS)
    sd = modelopt_state_dict(model, per_channel=True)
    result = fx_fp8.adopt_prequantized(model, state_dict=sd, ignored_layers=["layers.0"])
    assert list(result["adopted"]) == ["layers.1"] and "layers.0.weight" in result["state_dict_keys"]
    assert result["kept"]["layers.0"] == (
        "ignored_layers pattern 'layers.0' (remove it from quantization_config.ignored_layers to quantize "
        "this layer); ModelOpt FP8 checkpoint (per-channel "
        "weight scales) dequantized into its weight (torch.bfloat16)"
    )
    layer = model.layers[0]
    assert type(layer) is nn.Linear and layer.weight.dtype == torch.bfloat16
    expected = (sd["layers.0.weight"].float() * sd["layers.0.weight_scale"][:, None]).to(torch.bfloat16)
    assert torch.equal(layer.weight, expected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bfl_layers_and_adopted_layers():
    """On a GPU with FP8 tensor cores BFLFP8RLinear.forward runs its own torch._scaled_mm (no linear
    in the graph: nothing for fx_fp8 to see); adopted, the same weights run fx_fp8's CUDA GEMMs and
    agree with BFL's own FP8 path. Without FP8 tensor cores the pass rewrites them (weight-only)."""
    sd = {k: v.cuda() for k, v in bfl_checkpoint(float_stack(DIMS)).items()}
    model = bfl_stack(sd, 2, DIMS).cuda()
    x = torch.randn(4, 33, DIMS[0], dtype=torch.bfloat16, device="cuda")
    fp8_cores = torch.cuda.get_device_capability() >= (8, 9)
    compiled = torch.compile(model, backend="fp8")
    with torch.no_grad():
        own = model(x)
        bare = compiled(x)
    rows = [e for e in fx_fp8.get_reports(compiled)[-1].entries if e.op == "linear"]
    assert [e.action for e in rows] == ([] if fp8_cores else ["weight-only", "weight-only"])
    assert rel(bare, own) < 0.02
    torch._dynamo.reset()
    fx_fp8.adopt_prequantized(model)
    assert [layer.weight.data_ptr() for layer in model.layers] == [
        sd[f"layers.{i}.weight"].data_ptr() for i in range(2)
    ]
    compiled = torch.compile(model, backend="fp8")
    with torch.no_grad():
        adopted = compiled(x)
    rows = [e for e in fx_fp8.get_reports(compiled)[-1].entries if e.op == "linear"]
    assert [e.action for e in rows] == (["fp8", "fp8"] if fp8_cores else ["weight-only", "weight-only"])
    assert rel(adopted, own) < 0.05  # both per-row FP8 activations (BFL's own path, or its dequantized forward)
