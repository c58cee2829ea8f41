"""The example stage configs, the shared CLI flags, and the two examples (in-process through their
main(argv)): end to end on tiny models, and their --output handling."""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re

import numpy as np
import pytest

import fx_fp8
from fx_fp8.tools.cli_flags import add_fp8_flags, config_from_args, overrides_from_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    flat, stage = (fx_fp8.FP8Config.load(os.path.join(ROOT, "examples", "configs", n))
                   for n in ("fp8_flat.yaml", "vllm_omni_stage.yaml"))
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
    assert cfg.quantization_config.ignored_layers == ("proj_mlp",) and not cfg.attention_enabled  # "@defaults" is implied
    assert config_from_args(_parse("--ignored-layers", "")).quantization_config.ignored_layers == ()


def test_bad_flag_values_fail_clearly():
    with pytest.raises(ValueError, match="invalid token 'x'"):
        config_from_args(_parse("--diffusion-kv-cache-skip-steps", "0,x"))
    with pytest.raises(SystemExit):
        _parse("--quantization", "fp4")


def load_example(name: str):
    """examples/<name>.py as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_example(script, *argv, tmp_path, monkeypatch, capsys):
    """Run examples/<script> in-process (cwd = tmp_path); its stdout."""
    monkeypatch.chdir(tmp_path)
    assert load_example(script.removesuffix(".py")).main(list(argv)) == 0
    return capsys.readouterr().out


@pytest.mark.slow
def test_text_to_image_compare_on_the_tiny_model(tmp_path, monkeypatch, capsys):
    out = _run_example("text_to_image.py", "--compare", "--num-inference-steps", "3",
                       "--diffusion-kv-cache-skip-steps", "0", "--output", "img.png", tmp_path=tmp_path,
                       monkeypatch=monkeypatch, capsys=capsys)
    assert "PSNR vs native" in out and "step variants (step:variant per transformer call): 0:native, 1:fp8, 2:fp8" in out
    assert (tmp_path / "img.png").is_file() and (tmp_path / "img_compare.png").is_file()


@pytest.mark.slow
def test_text_to_video_on_a_tiny_random_wan(tmp_path, monkeypatch, capsys):
    out = _run_example("text_to_video.py", "--num-frames", "3", "--num-inference-steps", "2", "--output", "v.gif",
                       tmp_path=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
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
    monkeypatch.setattr(image._common, "run_native_and_fp8", fake_run)   # one _common module for both
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


def test_examples_reject_an_unwritable_output_before_loading(tmp_path, monkeypatch):
    image, video = load_example("text_to_image"), load_example("text_to_video")

    def refuse(*a, **k):
        raise AssertionError("loaded a model before checking --output")

    monkeypatch.setattr(image, "load_pipeline", refuse)
    monkeypatch.setattr(video, "load", refuse)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for module, name in ((image, "out.png"), (video, "out.gif")):
        with pytest.raises(SystemExit, match=re.escape(f"cannot write --output '{blocker / name}': '{blocker}' is a file")):
            module.main(["--output", str(blocker / name)])
        with pytest.raises(SystemExit, match="--output '.*out.txt': unsupported image type '.txt'"):
            module.main(["--output", str(tmp_path / "out.txt")])
        with pytest.raises(SystemExit, match="--output 'new_name' has no file extension: expected an image file "
                                             "name .* or a folder"):
            module.main(["--output", "new_name"])
        with pytest.raises(SystemExit, match="invalid token 'x'"):
            module.main(["--diffusion-kv-cache-skip-steps", "x"])
