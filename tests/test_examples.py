"""The example stage configs, the shared CLI flags, and the two examples end to end (tiny models)."""
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys

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
    assert cfg.quantization_config.ignored_layers == ("@defaults", "proj_mlp") and not cfg.attention_enabled
    assert config_from_args(_parse("--ignored-layers", "")).quantization_config.ignored_layers == ()


def test_bad_flag_values_fail_clearly():
    with pytest.raises(ValueError, match="invalid token 'x'"):
        config_from_args(_parse("--diffusion-kv-cache-skip-steps", "0,x"))
    with pytest.raises(SystemExit):
        _parse("--quantization", "fp4")


def _run_example(script, *argv, tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *argv], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_text_to_image_compare_on_the_tiny_model(tmp_path):
    out = _run_example("text_to_image.py", "--compare", "--num-inference-steps", "3",
                       "--diffusion-kv-cache-skip-steps", "0", "--output", "img.png", tmp_path=tmp_path)
    assert "PSNR vs native" in out and "step variants (step:variant per transformer call): 0:native, 1:fp8, 2:fp8" in out
    assert (tmp_path / "img.png").is_file() and (tmp_path / "img_compare.png").is_file()


def test_text_to_video_on_a_tiny_random_wan(tmp_path):
    out = _run_example("text_to_video.py", "--num-frames", "3", "--num-inference-steps", "2", "--output", "v.gif",
                       tmp_path=tmp_path)
    assert "RANDOM-weight" in out
    from PIL import Image

    gif = Image.open(tmp_path / "v.gif")
    assert gif.n_frames == 3
