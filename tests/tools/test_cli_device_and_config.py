"""`fx-fp8 --device / --dtype` and the one config rule: every command loads and
runs the model where --device / --dtype say (CPU float32 by default), prints where it ran and the
config it used, and inspect / dump / sensitivity start from the model's own fx_fp8.yaml as compare
does (--config, else the model's own, else the library default)."""

from __future__ import annotations

import pytest
import torch

from fx_fp8.tools import cli_inspect
from fx_fp8.tools.cli import build_parser
from fx_fp8.tools.model_source import resolve_model
from fx_fp8.tools.tiny_model import TINY_MODEL_DIR

from cli_runs import cli, no_work, one_error_line, strict_json  # noqa: F401 (no_work: a fixture)

COMMANDS = ("inspect", "dump", "compare", "sensitivity")
OWN = TINY_MODEL_DIR / "fx_fp8.yaml"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_device_and_dtype_with_cpu_float32_defaults(command):
    extra = ["--out", "x"] if command == "dump" else []
    args = build_parser().parse_args([command, *extra])
    assert (args.device, args.dtype, args.library_default) == ("cpu", "float32", False)
    args = build_parser().parse_args([command, *extra, "--device", "cuda:1", "--dtype", "bfloat16"])
    assert (args.device, args.dtype) == ("cuda:1", "bfloat16")
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    text = " ".join(sub.format_help().split())
    assert "--device" in text and "cpu (default)" in text and "default float32" in text


@pytest.mark.parametrize("command", COMMANDS)
def test_a_device_this_torch_cannot_use_is_one_line_before_any_work(command, capsys, no_work, tmp_path):
    extra = ["--out", tmp_path / "o"] if command in ("dump", "sensitivity") else []
    device = "cuda" if torch.version.cuda is None else "cuda:99"
    code, _, err = cli(capsys, command, *extra, "--device", device)
    assert code == 2 and f"--device '{device}'" in one_error_line(err)
    code, _, err = cli(capsys, command, *extra, "--device", "no-such-device")
    assert code == 2 and "invalid --device 'no-such-device'" in one_error_line(err)


class _Stop(Exception):
    pass


def _capture_inspect(monkeypatch) -> dict:
    seen = {}

    def fake(source, config, **kw):
        seen.update(config=config, **kw)
        raise _Stop

    monkeypatch.setattr(cli_inspect, "compile_and_report", fake)
    return seen


@pytest.mark.parametrize("command", ["inspect", "dump"])
def test_inspect_and_dump_start_from_the_models_own_config(command, monkeypatch, tmp_path):
    from fx_fp8.tools.cli import main

    seen = _capture_inspect(monkeypatch)
    extra = ["--out", str(tmp_path / "d")] if command == "dump" else []
    with pytest.raises(_Stop):
        main([command, *extra, "--dtype", "bfloat16"])
    assert str(seen["config"].diffusion_kv_cache_skip_steps) == "first:2,last:2"  # the tiny model's own
    assert seen["config_source"].startswith(f"{OWN} (the model's own")
    assert (seen["placement"].device, seen["placement"].dtype) == ("cpu", torch.bfloat16)
    with pytest.raises(_Stop):
        main([command, *extra, "--library-default"])
    assert not seen["config"].diffusion_kv_cache_skip_steps
    assert seen["config_source"] == "the library default (--library-default)"


def test_sensitivity_starts_from_the_models_own_config(capsys, no_work, tmp_path):
    # the tiny model's own config holds a step policy, which --step-policy would search itself
    code, _, err = cli(capsys, "sensitivity", "--step-policy", "--out", tmp_path / "s")
    line = one_error_line(err)
    assert code == 2 and "drop --diffusion-kv-cache-skip-steps 'first:2,last:2'" in line
    assert "--library-default" in line


@pytest.mark.slow
def test_inspect_loads_and_runs_the_model_in_the_dtype_asked_and_says_so(capsys):
    from fx_fp8.tools.model_zoo.registry import build_tiny_transformer

    float32_bytes = sum(p.numel() * 4 for p in build_tiny_transformer("flux").parameters())
    code, out, err = cli(capsys, "inspect", "--model", "flux", "--dtype", "bfloat16", "--format", "json")
    assert code == 0, err
    data = strict_json(out)
    assert (data["device"], data["dtype"], data["config_source"]) == ("cpu", "bfloat16", "the library default")
    assert data["summary"]["weights"]["model_bytes_before"] * 2 == float32_bytes
    code, out, err = cli(capsys, "inspect", "--model", "flux", "--dtype", "bfloat16")
    assert code == 0, err
    assert out.splitlines()[1] == "ran on: device cpu, dtype bfloat16; config: the library default"


@pytest.mark.slow
def test_a_pipeline_loads_in_the_dtype_asked_and_its_outputs_come_back_on_cpu():
    run = resolve_model("flux").load_pipeline(prompts=1, height=16, width=16, dtype=torch.bfloat16, device="cpu")
    assert run.pipe.transformer.dtype == torch.bfloat16 and run.pipe.vae.dtype == torch.bfloat16
    assert all(v.dtype == torch.bfloat16 for v in run.calls[0].values() if isinstance(v, torch.Tensor))
    latents, _ = run.run(1)
    assert latents.dtype == torch.float32 and latents.device.type == "cpu"
