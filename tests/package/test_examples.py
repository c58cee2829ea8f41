"""The example stage configs, the shared CLI flags, and the two examples (in-process through their
main(argv)): end to end on tiny models, and their --output handling."""

from __future__ import annotations

import argparse
import glob
import os
import re

import numpy as np
import pytest

import fx_fp8
from fx_fp8.tools.cli_flags import add_fp8_flags, config_from_args, overrides_from_args

from example_scripts import load_example

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "examples", "configs", "*.yaml")))


def test_configs_are_shipped():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"fp8_flat.yaml", "vllm_omni_stage.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_example_config_loads(path):
    cfg = fx_fp8.FP8Config.load(path)
    assert cfg.attention_enabled and cfg.linear_enabled
    assert cfg.diffusion_kv_cache_skip_steps == {0, 1}


def test_flat_and_stage_configs_agree():
    flat, stage = (
        fx_fp8.FP8Config.load(os.path.join(ROOT, "examples", "configs", n))
        for n in ("fp8_flat.yaml", "vllm_omni_stage.yaml")
    )
    assert flat == stage


def _parse(*argv):
    return add_fp8_flags(argparse.ArgumentParser()).parse_args(list(argv))


def test_unset_flags_do_not_override_the_yaml():
    path = os.path.join(ROOT, "examples", "configs", "vllm_omni_stage.yaml")
    assert overrides_from_args(_parse("--config", path)) == {}
    assert config_from_args(_parse("--config", path)) == fx_fp8.FP8Config.load(path)
    cfg = config_from_args(_parse("--config", path, "--diffusion-kv-cache-skip-steps", "0-3", "--quantization", "none"))
    assert cfg.diffusion_kv_cache_skip_steps == {0, 1, 2, 3} and not cfg.linear_enabled and cfg.attention_enabled


def test_flags_without_yaml_follow_vllm_omni_opt_ins():
    assert config_from_args(_parse()) == fx_fp8.FP8Config()  # nothing said: both features on
    only_attn = config_from_args(_parse("--diffusion-kv-cache-dtype", "fp8"))
    assert only_attn.attention_enabled and not only_attn.linear_enabled
    cfg = config_from_args(_parse("--quantization", "fp8", "--ignored-layers", "@defaults,proj_mlp"))
    assert (
        cfg.quantization_config.ignored_layers == ("proj_mlp",) and not cfg.attention_enabled
    )  # "@defaults" is implied
    assert config_from_args(_parse("--ignored-layers", "")).quantization_config.ignored_layers == ()


def test_bad_flag_values_fail_clearly():
    with pytest.raises(ValueError, match="invalid token 'x'"):
        config_from_args(_parse("--diffusion-kv-cache-skip-steps", "0,x"))
    with pytest.raises(SystemExit):
        _parse("--quantization", "fp4")


def _run_example(script, *argv, tmp_path, monkeypatch, capsys):
    """Run examples/<script> in-process (cwd = tmp_path); its stdout."""
    monkeypatch.chdir(tmp_path)
    assert load_example(script.removesuffix(".py")).main(list(argv)) == 0
    return capsys.readouterr().out


@pytest.mark.slow
def test_text_to_image_compare_on_the_tiny_model(tmp_path, monkeypatch, capsys):
    out = _run_example(
        "text_to_image.py",
        "--compare",
        "--num-inference-steps",
        "3",
        "--diffusion-kv-cache-skip-steps",
        "0",
        "--output",
        "img.png",
        tmp_path=tmp_path,
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    assert (
        "PSNR vs native" in out and "step variants (step:variant per transformer call): 0:native, 1:fp8, 2:fp8" in out
    )
    assert (tmp_path / "img.png").is_file() and (tmp_path / "img_compare.png").is_file()


@pytest.mark.slow
def test_text_to_video_on_a_tiny_random_wan(tmp_path, monkeypatch, capsys):
    out = _run_example(
        "text_to_video.py",
        "--num-frames",
        "3",
        "--num-inference-steps",
        "2",
        "--output",
        "v.gif",
        tmp_path=tmp_path,
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    assert "RANDOM-weight" in out
    from PIL import Image

    gif = Image.open(tmp_path / "v.gif")
    assert gif.n_frames == 3


# -- --output: a file or a folder, checked before any model loads ---------------------------------------
@pytest.fixture
def no_model(monkeypatch):
    """Both examples with their model work stubbed out (a fixed image, or 3 frames): only their
    argument and output handling runs."""
    from PIL import Image

    image, video = load_example("text_to_image"), load_example("text_to_video")
    pipe = object()

    def fake_run(pipe, run, cfg, *, backend, device, compare, metrics):
        out = np.zeros((3, 8, 8, 3), dtype=np.float32) if metrics is video.video_metrics else Image.new("RGB", (8, 8))
        return (out if compare else None), out, [dict(run="fp8", first=0.0)]

    monkeypatch.setattr(image, "load_pipeline", lambda *a, **k: pipe)
    monkeypatch.setattr(video, "load", lambda *a, **k: (pipe, {}, "stub"))
    monkeypatch.setattr(image._common, "run_native_and_fp8", fake_run)  # one _common module for both
    monkeypatch.setattr(image._common, "print_fp8_summary", lambda pipe: None)
    return image, video


@pytest.mark.parametrize("output", ["existing_dir", "new_dir/", "nested/new_dir/"])
def test_examples_accept_a_folder_as_output(output, tmp_path, monkeypatch, no_model, capsys):
    image, video = no_model
    monkeypatch.chdir(tmp_path)
    (tmp_path / "existing_dir").mkdir()
    folder = tmp_path / output.rstrip("/")
    assert image.main(["--output", output, "--compare"]) == 0
    assert (folder / "text_to_image.png").is_file() and (folder / "text_to_image_compare.png").is_file()
    assert video.main(["--output", output]) == 0
    assert (folder / "text_to_video.gif").is_file()
    out = capsys.readouterr().out
    assert f"saved {os.path.join(output.rstrip('/'), 'text_to_image.png')}" in out
    assert f"saved {os.path.join(output.rstrip('/'), 'text_to_video.gif')}" in out


def test_examples_output_file_names_still_work(tmp_path, monkeypatch, no_model):
    image, video = no_model
    monkeypatch.chdir(tmp_path)
    assert image.main(["--output", "a/b.png"]) == 0 and (tmp_path / "a" / "b.png").is_file()
    assert video.main(["--output", "strip.png"]) == 0 and (tmp_path / "strip.png").is_file()
    assert image.main([]) == 0 and (tmp_path / "outputs" / "text_to_image.png").is_file()


def _fails(module, argv, capsys) -> str:
    """The one line an example prints for bad input (exit status 2, as fx-fp8 does)."""
    assert module.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


@pytest.fixture
def refuse_loading(monkeypatch):
    image, video = load_example("text_to_image"), load_example("text_to_video")

    def refuse(*a, **k):
        raise AssertionError("loaded a model before checking its input")

    monkeypatch.setattr(image, "load_pipeline", refuse)
    monkeypatch.setattr(video, "load", refuse)
    return image, video


def test_examples_reject_an_unwritable_output_before_loading(tmp_path, refuse_loading, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for module, name in zip(refuse_loading, ("out.png", "out.gif")):
        prog = f"{module.__name__.removeprefix('example_')}.py: error: "
        assert (
            _fails(module, ["--output", str(blocker / name)], capsys)
            == prog + f"cannot write --output '{blocker / name}': '{blocker}' is a file, not a folder"
        )
        assert re.fullmatch(
            re.escape(prog) + "--output '.*out.txt': unsupported image type '.txt'.*",
            _fails(module, ["--output", str(tmp_path / "out.txt")], capsys),
        )
        assert re.match(
            re.escape(prog) + "--output 'new_name' has no file extension: expected an image file name .* or a folder",
            _fails(module, ["--output", "new_name"], capsys),
        )
        assert "invalid token 'x'" in _fails(module, ["--diffusion-kv-cache-skip-steps", "x"], capsys)
        assert (
            _fails(module, ["--no-such-flag"], capsys)
            == prog + f"unrecognized arguments: --no-such-flag (see '{prog.split(':')[0]} --help')"
        )


def test_examples_refuse_cuda_on_a_cpu_build_in_one_line(refuse_loading, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for module in refuse_loading:
        line = _fails(module, ["--device", "cuda"], capsys)
        assert line.endswith(
            f"error: --device 'cuda': this torch ({torch.__version__}) was built without CUDA; use "
            "--device cpu, or install a CUDA build of torch"
        ), line
        assert "invalid --device 'cuda:x'" in _fails(module, ["--device", "cuda:x"], capsys)


def test_examples_refuse_a_size_the_pipeline_cannot_make(refuse_loading, capsys):
    image, video = refuse_loading
    assert _fails(image, ["--height", "30"], capsys).endswith(
        "error: invalid --height 30 for tiny (FluxTransformer2DModel): expected a multiple of 4, at least 16"
    )
    assert _fails(video, ["--width", "30"], capsys).endswith(
        "error: invalid --width 30 for wan (WanTransformer3DModel): expected a multiple of 16, at most 128"
    )
    assert "invalid --num-frames 0: expected a positive integer" in _fails(video, ["--num-frames", "0"], capsys)
    assert "invalid --num-inference-steps 0" in _fails(image, ["--num-inference-steps", "0"], capsys)


def test_text_to_image_names_the_tiny_models_words(refuse_loading, capsys):
    from fx_fp8.tools.tiny_model.shapes import VOCAB

    image, _ = refuse_loading
    line = _fails(image, ["--prompt", "a purple circle on a blue background"], capsys)
    assert line.endswith(
        f"the tiny model does not know 'purple'; its 13 words: {' '.join(VOCAB)} "
        "(e.g. 'a red circle on a blue background')"
    ), line
    assert "takes 1 to 8 words, got 10" in _fails(
        image, ["--prompt", "a red circle on a blue background a a a"], capsys
    )
    help_text = " ".join(image.build_parser().format_help().split())
    assert f"the shipped tiny model knows 13 words, at most 8 a prompt: {' '.join(VOCAB)}" in help_text


def test_examples_name_a_missing_model_or_weight_file(refuse_loading, tmp_path, capsys):
    import shutil

    from fx_fp8.tools.tiny_model import TINY_MODEL_DIR

    image, video = refuse_loading
    missing = tmp_path / "nowhere"
    for module in (image, video):
        assert _fails(module, ["--model", str(missing)], capsys).endswith(
            f"error: --model '{missing}': no such folder (expected a local diffusers pipeline folder)"
        )
    copy = tmp_path / "tiny"
    shutil.copytree(TINY_MODEL_DIR, copy)
    for weights in (copy / "prompt_encoder").glob("*.safetensors"):
        weights.unlink()
    assert _fails(image, ["--model", str(copy)], capsys).endswith(
        f"error: folder '{copy / 'prompt_encoder'}' has config.json but no weights (no *.safetensors or *.bin file)"
    )
