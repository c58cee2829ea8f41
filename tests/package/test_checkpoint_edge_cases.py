"""Round five of hostile use, checkpoints and pre-quantized weights: what adopt_prequantized keeps
survives save_quantized, config.json is digested and written last, bad dtypes and hand-edited records are refused by name, tied parameters round
trip, suspicious pre-quantized scales warn, and single-file / dtype-move limits of the diffusers
backend are said up front."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.nn as nn

import fx_fp8
from fx_fp8.quant.checkpoint import CONFIG_NAME, QUANT_NAME, WEIGHTS_NAME
from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs, output_tensor
from prequantized_layouts import bfl_checkpoint, bfl_stack, float_stack

DIMS = (64, 96, 64)


def same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    as_bytes = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
    return sa.keys() == sb.keys() and all(
        sa[k].dtype == sb[k].dtype and torch.equal(as_bytes(sa[k]), as_bytes(sb[k])) for k in sa
    )


def flux(seed=0, dtype=torch.float32):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_tiny_transformer("flux", layers=1, seed=seed, dtype=dtype)


def prepared_flux(seed=0, dtype=torch.float32):
    model = flux(seed, dtype)
    fx_fp8.prepare_model(model)
    return model


def run(model, kw):
    with torch.no_grad():
        return output_tensor(model(**kw))


# -- item 4: BFL layers adopt_prequantized keeps are saved with a record and rebuilt -----------
def test_bfl_layers_kept_by_adopt_prequantized_round_trip_bit_exact(tmp_path):
    from diffusers.quantizers.bfl.utils import BFLFP8RLinear

    model = bfl_stack(bfl_checkpoint(float_stack(DIMS)), 2, DIMS)
    result = fx_fp8.adopt_prequantized(model, ignored_layers=["layers.1"])
    assert list(result["kept"]) == ["layers.1"] and isinstance(model.layers[1], BFLFP8RLinear)
    x = torch.randn(3, 5, DIMS[0], dtype=torch.bfloat16)
    with torch.no_grad():
        ref = model(x)
    fx_fp8.save_quantized(model, tmp_path)
    loaded = fx_fp8.load_quantized(tmp_path, model=float_stack(DIMS))
    kept = loaded.layers[1]
    assert type(kept) is BFLFP8RLinear and kept.compute_dtype == torch.bfloat16
    assert same_state(loaded, model)
    with torch.no_grad():
        assert torch.equal(loaded(x), ref)
    # saved again from the loaded model: the same record (the kept layer's reason travels)
    fx_fp8.save_quantized(loaded, tmp_path / "again")
    first, second = (json.loads((p / QUANT_NAME).read_text()) for p in (tmp_path, tmp_path / "again"))
    assert first["bfl_fp8r_native"] == second["bfl_fp8r_native"]
    assert first["bfl_fp8r_native"]["layers.1"]["reason"] == result["kept"]["layers.1"]
    # dtype= casts the bias and the compute dtype, never the fp8r weight or its scale
    cast = fx_fp8.load_quantized(tmp_path, model=float_stack(DIMS), dtype=torch.float32).layers[1]
    assert cast.weight.dtype == torch.float8_e4m3fn and cast.weight_scale.dtype == torch.float32
    assert cast.bias.dtype == torch.float32 and cast.compute_dtype == torch.float32


# -- item 9: config.json is digested, and written last -----------------------------------------
def _flux_pair():
    """(A, B): prepared tiny Fluxes with the same weights and structure, configs differing only in
    their rotary axes (a config.json of one builds a model that computes something else)."""
    from diffusers import FluxTransformer2DModel

    a = flux()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        b = FluxTransformer2DModel.from_config({**a.config, "axes_dims_rope": (16, 8, 8)}).eval()
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        fx_fp8.prepare_model(m)
    return a, b


def test_a_config_json_of_another_save_is_refused_naming_it(tmp_path):
    a, b = _flux_pair()
    fx_fp8.save_quantized(a, tmp_path / "a")
    fx_fp8.save_quantized(b, tmp_path / "b")
    record = json.loads((tmp_path / "a" / QUANT_NAME).read_text())
    assert record["config_digest"]["algorithm"] == "blake2b-128"
    # reformatting config.json (key order, spacing) keeps its content: it still loads
    config = json.loads((tmp_path / "a" / CONFIG_NAME).read_text())
    (tmp_path / "a" / CONFIG_NAME).write_text(json.dumps(dict(reversed(list(config.items())))))
    kw = example_inputs("flux", a)
    assert torch.equal(run(fx_fp8.load_quantized(tmp_path / "a"), kw), run(a, kw))
    (tmp_path / "a" / CONFIG_NAME).write_bytes((tmp_path / "b" / CONFIG_NAME).read_bytes())
    with pytest.raises(ValueError, match=rf"{str(tmp_path / 'a' / CONFIG_NAME)!r} is not the config.json saved"):
        fx_fp8.load_quantized(tmp_path / "a")
    fx_fp8.load_quantized(tmp_path / "a", verify=False)  # the user's call: not checked


def test_a_save_that_fails_part_way_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    import safetensors.torch

    a, b = _flux_pair()
    kw = example_inputs("flux", a)
    fx_fp8.save_quantized(a, tmp_path)
    before = sorted(os.listdir(tmp_path))

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError, match=rf"could not write {str(tmp_path / WEIGHTS_NAME)!r}.*No space left"):
        fx_fp8.save_quantized(b, tmp_path)
    assert sorted(os.listdir(tmp_path)) == before  # no temporary left behind either
    assert torch.equal(run(fx_fp8.load_quantized(tmp_path), kw), run(a, kw))


# -- item 6: load_quantized's dtype is checked before anything is read ---------------------------
@pytest.mark.parametrize(
    "dtype,says",
    [
        pytest.param(torch.int8, "dtype=torch.int8 is not a dtype the model can compute in", id="int8"),
        pytest.param(
            torch.float8_e4m3fn, "dtype=torch.float8_e4m3fn is not a dtype the model can compute in", id="fp8"
        ),
        pytest.param("bfloat16", "dtype='bfloat16' is a string: pass torch.bfloat16", id="a dtype's name"),
        pytest.param("cuda", "dtype='cuda' is a str, not a torch.dtype", id="a device"),
    ],
)
def test_load_quantized_refuses_a_dtype_it_cannot_cast_to_up_front(tmp_path, dtype, says):
    # a folder that does not exist: the dtype is refused before any file is looked at
    with pytest.raises(TypeError, match=f"load_quantized: {says}"):
        fx_fp8.load_quantized(tmp_path / "not-there", dtype=dtype)


# -- item 14: tied parameters are saved once and tied again on load -----------------------------
class TiedNorms(nn.Module):
    """Two linears between layer norms: one LayerNorm under two names, and a second norm whose
    weight is the first's (ties as embeddings and shared norms make them)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)
        self.norm_again = self.norm
        self.out_norm = nn.LayerNorm(64)
        self.out_norm.weight = self.norm.weight

    def forward(self, x):
        return self.out_norm(self.b(torch.relu(self.a(self.norm_again(self.norm(x))))))


def test_tied_parameters_are_saved_once_and_tied_again_on_load(tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = TiedNorms().eval()
    with torch.no_grad():
        model.norm.weight.normal_()
        model.out_norm.bias.normal_()
    fx_fp8.prepare_model(model, quantization="fp8")
    x = torch.randn(4, 64)
    with torch.no_grad():
        ref = model(x)
    fx_fp8.save_quantized(model, tmp_path)
    record = json.loads((tmp_path / QUANT_NAME).read_text())
    assert record["tied"] == {
        "norm_again.weight": "norm.weight",
        "norm_again.bias": "norm.bias",
        "out_norm.weight": "norm.weight",
    }
    assert not set(record["tied"]) & set(load_file(tmp_path / WEIGHTS_NAME))  # each tied tensor stored once
    fresh = TiedNorms()
    fresh.out_norm.weight = nn.Parameter(torch.ones(64))  # untied: loading ties it as it was saved
    loaded = fx_fp8.load_quantized(tmp_path, model=fresh, dtype=torch.bfloat16)
    assert loaded.out_norm.weight is loaded.norm.weight and loaded.norm.weight.dtype == torch.bfloat16
    loaded = fx_fp8.load_quantized(tmp_path, model=TiedNorms())
    assert loaded.out_norm.weight is loaded.norm.weight and loaded.norm_again is loaded.norm
    with torch.no_grad():
        assert torch.equal(loaded(x), ref)
        loaded.norm.weight.mul_(2)  # still one tensor: a write reaches every name
    assert torch.equal(loaded.out_norm.weight, loaded.norm.weight)


def test_overlapping_views_are_refused_naming_their_keys(tmp_path):
    model = TiedNorms().eval()
    fx_fp8.prepare_model(model, quantization="fp8")
    both = torch.zeros(128)
    model.out_norm.weight = nn.Parameter(both[:64])
    model.out_norm.bias = nn.Parameter(both[64:])
    with pytest.raises(ValueError, match=r"'out_norm.weight', 'out_norm.bias' share memory without being the same"):
        fx_fp8.save_quantized(model, tmp_path)
    assert not os.listdir(tmp_path)


# -- item 15: hand-edited descriptions are ValueErrors naming the file and the field ------------
@pytest.fixture(scope="module")
def saved_pipeline(tmp_path_factory):
    """(folder, pipe): a stand-in pipeline's prepared tiny Flux transformer, saved as a pipeline."""
    import types

    pipe = types.SimpleNamespace(transformer=prepared_flux())
    folder = tmp_path_factory.mktemp("saved-pipe")
    fx_fp8.save_quantized(pipe, folder)
    return folder, pipe


def _edited(src, dst, edit, name=QUANT_NAME):
    """A copy of the checkpoint folder `src` with `edit(json)` applied to `name`."""
    import shutil

    shutil.copytree(src, dst)
    data = json.loads((dst / name).read_text())
    edit(data)
    (dst / name).write_text(json.dumps(data))
    return dst / name


@pytest.mark.parametrize("with_pipe", [False, True])
def test_an_index_without_components_names_the_file_and_field(saved_pipeline, tmp_path, with_pipe):
    folder, pipe = saved_pipeline
    index = _edited(folder, tmp_path / "c", lambda d: d.update(components=[]))
    with pytest.raises(ValueError, match=rf"{str(index)!r} is damaged: components is \[\], expected a non-empty list"):
        fx_fp8.load_quantized(tmp_path / "c", pipe=pipe if with_pipe else None)


DAMAGED_RECORDS = {
    "a pipeline class": (
        lambda d: d.update(model_class="DiffusionPipeline"),
        "model_class is 'DiffusionPipeline', which is not a diffusers model class",
    ),
    "a layer without its method": (
        lambda d: next(iter(d["layers"].values())).pop("method"),
        r"layers\['.*'\] is .*missing \['method'\]",
    ),
    "a size as a string": (
        lambda d: next(iter(d["layers"].values())).update(in_features="64"),
        r"layers\['.*'\].in_features is '64', expected a positive integer",
    ),
    "an unknown act granularity": (
        lambda d: next(iter(d["layers"].values())).update(act_granularity="row"),
        r"layers\['.*'\].act_granularity is 'row', expected one of",
    ),
    "a tie to itself": (
        lambda d: d.update(tied={"x_embedder.bias": "x_embedder.bias"}),
        r"tied\['x_embedder.bias'\] is 'x_embedder.bias', expected the key of a tensor",
    ),
    "a native reason as a number": (lambda d: d.update(native={"proj_out": 3}), r"native\['proj_out'\] is 3"),
    "a tie to a key the file lacks": (
        lambda d: d.update(tied={"x_embedder.bias": "x_embedder.gone"}),
        r"tied\['x_embedder.bias'\] is 'x_embedder.gone', but .* holds no 'x_embedder.gone'",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGED_RECORDS))
def test_a_hand_edited_description_names_the_file_and_field(saved_pipeline, tmp_path, case):
    folder, _ = saved_pipeline
    edit, says = DAMAGED_RECORDS[case]
    path = _edited(folder / "transformer", tmp_path / "t", edit)
    with pytest.raises(ValueError, match=rf"{str(path)!r}.*{says}"):
        fx_fp8.load_quantized(tmp_path / "t")


# -- item 18: NaN, infinite, zero or negative pre-quantized scales warn once, naming the layers ---
def _bfl_stack_with_bad_scales():
    model = bfl_stack(bfl_checkpoint(float_stack(DIMS)), 2, DIMS)
    model.layers[0].weight_scale[3] = float("nan")
    model.layers[1].weight_scale[:2] = torch.tensor([0.0, -1.0])
    return model


BAD_BFL = r"layers\.0 \(weight_scale: 1 of 96 not finite\), layers\.1 \(weight_scale: 2 of 64 not positive\)"


def test_adopting_bad_scales_warns_once_naming_the_layers():
    from prequantized_layouts import modelopt_state_dict

    with pytest.warns(
        UserWarning,
        match=rf"adopt_prequantized: pre-quantized scales that are not finite and positive "
        rf"in {BAD_BFL}",
    ) as record:
        fx_fp8.adopt_prequantized(_bfl_stack_with_bad_scales())
    assert len([w for w in record if "pre-quantized scales" in str(w.message)]) == 1
    sd = modelopt_state_dict(
        float_stack(DIMS), per_channel=False, static_x=torch.randn(2, DIMS[0], dtype=torch.bfloat16)
    )
    sd["layers.1.input_scale"] = torch.tensor(float("inf"))
    with pytest.warns(UserWarning, match=r"in layers\.1 \(input_scale: 1 of 1 not finite\):"):
        fx_fp8.adopt_prequantized(float_stack(DIMS), state_dict=sd)
    with warnings.catch_warnings():  # good scales: silent
        warnings.simplefilter("error")
        fx_fp8.adopt_prequantized(
            float_stack(DIMS), state_dict=modelopt_state_dict(float_stack(DIMS), per_channel=True)
        )


def test_compiling_bad_scales_warns_naming_the_layers():
    model = _bfl_stack_with_bad_scales()
    with pytest.warns(UserWarning, match=rf"torch.compile\(backend='fp8'\): pre-quantized scales .* in {BAD_BFL}"):
        with torch.no_grad():
            torch.compile(model, backend="fp8")(torch.randn(3, DIMS[0], dtype=torch.bfloat16))


# -- item 12: from_single_file(..., quantization_config=fx_fp8.DiffusersConfig()) quantizes ------
def test_from_single_file_quantizes_while_loading_as_from_pretrained_does(tmp_path):
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    from fx_fp8.quant.quantized_linear import QuantizedLinear

    model = flux(dtype=torch.bfloat16)
    model.save_config(tmp_path)
    single = tmp_path / "flux-tiny.safetensors"  # a full-precision single file, in diffusers' key layout
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, single)
    model.save_pretrained(tmp_path / "folder")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from_file = FluxTransformer2DModel.from_single_file(
            str(single), config=str(tmp_path), torch_dtype=torch.bfloat16, quantization_config=fx_fp8.DiffusersConfig()
        )
        from_folder = FluxTransformer2DModel.from_pretrained(
            tmp_path / "folder", torch_dtype=torch.bfloat16, quantization_config=fx_fp8.DiffusersConfig()
        )
    assert any(isinstance(m, QuantizedLinear) for m in from_file.modules())
    assert same_state(from_file, from_folder)
    kw = example_inputs("flux", model, dtype=torch.bfloat16)
    assert torch.equal(run(from_file, kw), run(from_folder, kw))
    # and it saves as a model loaded with from_pretrained does: config.json records its layers
    from_file.save_pretrained(tmp_path / "saved")
    reloaded = FluxTransformer2DModel.from_pretrained(tmp_path / "saved", torch_dtype=torch.bfloat16)
    assert same_state(reloaded, from_file)


# -- item 16: dtype moves of a DiffusersConfig-loaded model: refused by diffusers, as documented --
def test_dtype_moves_of_a_loaded_model_are_refused_and_torch_dtype_sets_it(tmp_path):
    from pathlib import Path

    from diffusers import DiffusionPipeline, FluxTransformer2DModel

    doc = (Path(__file__).resolve().parents[2] / "docs" / "diffusers_quantization.md").read_text()
    assert "Except dtype moves: diffusers refuses them" in doc and "Pick the dtype at load time instead" in doc

    class TransformerOnly(DiffusionPipeline):
        def __init__(self, transformer):
            super().__init__()
            self.register_modules(transformer=transformer)

    flux(dtype=torch.bfloat16).save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FluxTransformer2DModel.from_pretrained(
            tmp_path, torch_dtype=torch.bfloat16, quantization_config=fx_fp8.DiffusersConfig()
        )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pipe = TransformerOnly(model)
    for move in (
        lambda: model.to(torch.float16),
        lambda: model.to(dtype=torch.float32),
        model.half,
        model.float,
        lambda: pipe.to(torch.float16),
    ):
        with pytest.raises(
            ValueError,
            match=r"Casting a quantized model to a new `dtype` is unsupported|"
            r"is not supported for quantized model",
        ):
            move()
    after = model.state_dict()
    assert before.keys() == after.keys() and before  # the same state, and some of it
    assert all(
        after[k].dtype == v.dtype and torch.equal(after[k].view(torch.uint8), v.view(torch.uint8))
        for k, v in before.items()
    )
    assert model.to("cpu") is model  # device moves work
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        half = FluxTransformer2DModel.from_pretrained(
            tmp_path, torch_dtype=torch.float16, quantization_config=fx_fp8.DiffusersConfig()
        )
    kw = example_inputs("flux", half, dtype=torch.float16)
    assert half.x_embedder.bias.dtype == torch.float16 and run(half, kw).dtype == torch.float16
