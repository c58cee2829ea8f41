"""`fx-fp8` and the examples open folders whose transformer is already quantized: written by
save_pretrained of a model loaded with fx_fp8.DiffusersConfig, or by fx_fp8.save_quantized
(which diffusers' from_pretrained cannot read: "no file named diffusion_pytorch_model.bin")."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

import fx_fp8
from fx_fp8.quant.checkpoint import QUANT_NAME, WEIGHTS_NAME
from fx_fp8.quant.state_guard import quantized_layers
from fx_fp8.tools.model_source import ModelSourceError, resolve_model
from fx_fp8.tools.quantized_folders import folder_quantization, load_pipeline_folder, prepared_transformers
from fx_fp8.tools.tiny_model import TINY_MODEL_DIR, TinyShapesPipeline

from cli_runs import cli

from diffusers import FluxTransformer2DModel  # noqa: E402


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """Copies of the shipped tiny model whose transformer/ is quantized: "diffusers" (save_pretrained
    of a model loaded with DiffusersConfig) and "save_quantized"."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for kind in ("diffusers", "save_quantized"):
        folder = root / kind
        shutil.copytree(TINY_MODEL_DIR, folder, ignore=shutil.ignore_patterns("transformer"))
        out[kind] = folder
    loaded = quiet(
        FluxTransformer2DModel.from_pretrained,
        TINY_MODEL_DIR / "transformer",
        quantization_config=fx_fp8.DiffusersConfig(),
    )
    loaded.save_pretrained(out["diffusers"] / "transformer")
    prepared = quiet(FluxTransformer2DModel.from_pretrained, TINY_MODEL_DIR / "transformer")
    fx_fp8.prepare_model(prepared)
    fx_fp8.save_quantized(prepared, out["save_quantized"] / "transformer")
    return out


@pytest.fixture
def marked(tmp_path) -> dict:
    """Copies of the tiny model whose transformer/ only says it is quantized (config.json's
    quantization_config, or a save_quantized record): what is decided before anything loads."""
    out = {}
    for kind in ("fx_fp8", "save_quantized"):
        folder = tmp_path / kind
        shutil.copytree(TINY_MODEL_DIR, folder)
        if kind == "fx_fp8":
            config = json.loads((folder / "transformer" / "config.json").read_text())
            config["quantization_config"] = {"quant_method": "fx_fp8"}
            (folder / "transformer" / "config.json").write_text(json.dumps(config))
        else:
            (folder / "transformer" / QUANT_NAME).write_text(
                json.dumps({"format": "fx_fp8.quantized_checkpoint", "version": 1, "layers": {}})
            )
        out[kind] = folder
    return out


def test_the_folders_are_told_apart(marked, tmp_path):
    assert folder_quantization(marked["fx_fp8"] / "transformer") == "fx_fp8"
    assert folder_quantization(marked["save_quantized"] / "transformer") == "save_quantized"
    assert folder_quantization(TINY_MODEL_DIR / "transformer") == ""
    for kind, folder in marked.items():
        source = resolve_model(str(folder))  # a copy of the tiny model: its pipeline, its sizes
        assert source.kind == "tiny" and source.quantized == folder_quantization(folder / "transformer")
        assert resolve_model(str(folder / "transformer")).quantized == source.quantized
        assert "quantized weights" in source.describe()
    # a pipeline's transformers written by save_quantized (no pipeline around them) get a one-line pointer
    pipe_dir = tmp_path / "pipe_saved"
    (pipe_dir / "transformer").mkdir(parents=True)
    (pipe_dir / QUANT_NAME).write_text(
        json.dumps(
            {
                "format": "fx_fp8.quantized_checkpoint",
                "version": 1,
                "pipeline": "FluxPipeline",
                "components": ["transformer"],
            }
        )
    )
    with pytest.raises(ModelSourceError, match="holds only a pipeline's transformers .* give one of them"):
        resolve_model(str(pipe_dir))


def test_both_kinds_load_as_the_same_quantized_transformer(folders):
    models = {kind: quiet(resolve_model(str(f / "transformer")).load_transformer) for kind, f in folders.items()}
    a, b = models["diffusers"], models["save_quantized"]
    assert quantized_layers(a) == quantized_layers(b) and quantized_layers(a)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(
        torch.equal(
            sa[k].view(torch.uint8) if sa[k].dtype.itemsize == 1 else sa[k],
            sb[k].view(torch.uint8) if sb[k].dtype.itemsize == 1 else sb[k],
        )
        for k in sa
    )
    # and diffusers alone still cannot read the save_quantized one (why load_quantized is needed)
    with pytest.raises(OSError, match="diffusion_pytorch_model"):
        quiet(FluxTransformer2DModel.from_pretrained, folders["save_quantized"] / "transformer")


def test_pipelines_load_with_their_quantized_transformer(folders):
    for folder in folders.values():
        pipe = quiet(load_pipeline_folder, folder, pipeline_class=TinyShapesPipeline)
        assert prepared_transformers(pipe) == ["transformer"]
    assert prepared_transformers(quiet(load_pipeline_folder, TINY_MODEL_DIR, pipeline_class=TinyShapesPipeline)) == []


def test_inspect_a_quantized_transformer_folder(folders, capsys):
    for folder in folders.values():
        code, out, err = cli(capsys, "inspect", "--model", folder / "transformer", "--format", "json")
        assert code == 0, err
        nodes = json.loads(out)["summary"]["nodes"]["linear"]
        assert nodes["fp8"] > 10 and nodes["weight-only"] > 0


def test_compare_runs_a_quantized_pipeline_against_its_stored_weights(folders, capsys):
    # --library-default: the tiny model's own config keeps attention native on the first 2 and last 2
    # steps, which at 2 steps is every step (both runs would then be the same stored linears, exactly)
    code, out, err = cli(
        capsys,
        "compare",
        "--model",
        folders["save_quantized"],
        "--prompts",
        "1",
        "--steps",
        "2",
        "--library-default",
        "--format",
        "json",
    )
    assert code == 0, err
    result = json.loads(out)
    assert result["reference"].startswith("the quantized weights as stored in transformer")
    assert result["latents_max_abs_error"] > 0  # FP8 attention ran against the reference's native one
    assert result["psnr_db"] > 20


def test_sensitivity_refuses_a_quantized_model_before_any_work(marked, capsys, tmp_path, monkeypatch):
    from fx_fp8.tools.model_source import ModelSource

    monkeypatch.setattr(ModelSource, "load_pipeline", lambda *a, **k: pytest.fail("loaded before refusing"))
    for kind, folder in marked.items():
        code, out, err = cli(capsys, "sensitivity", "--model", folder, "--out", tmp_path / "s")
        assert code == 2 and out == ""
        assert "sensitivity needs full-precision weights" in err and f"already quantized ({kind})" in err


def test_text_to_image_example_on_a_quantized_copy_of_the_tiny_model(folders, tmp_path, monkeypatch, capsys):
    from example_scripts import load_example

    monkeypatch.chdir(tmp_path)
    argv = ["--model", str(folders["diffusers"]), "--compare", "--num-inference-steps", "2", "--output", "img.png"]
    assert load_example("text_to_image").main(argv) == 0
    out = capsys.readouterr().out
    assert "transformer already quantized (loaded from a quantized folder): compiled as it is" in out
    assert "stored quantized" in out and (tmp_path / "img.png").is_file()
    assert WEIGHTS_NAME not in {p.name for p in (folders["diffusers"] / "transformer").iterdir()}
