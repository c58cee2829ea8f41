"""Round five of hostile use, the config side: `re:` patterns cut at their commas, unmatched
ignored_layers that said nothing outside the backend, inductor_options that crashed or were read
loosely, and a YAML alias bomb that became a giant error message."""
from __future__ import annotations

import argparse

import pytest
import torch.nn as nn

import fx_fp8
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.tools.cli_flags import add_fp8_flags, config_from_args


class Blocks(nn.Module):
    """transformer_blocks.{0..11}.proj: names a `re:` repeat such as {1,2} selects."""

    def __init__(self, n: int = 12, dim: int = 64):
        super().__init__()
        self.transformer_blocks = nn.ModuleList(nn.ModuleDict({"proj": nn.Linear(dim, dim)}) for _ in range(n))
        self.proj_out = nn.Linear(dim, dim)


# -- item 7: a `re:` pattern given as a string keeps its commas ------------------------------------
BLOCKS_RE = r"re:transformer_blocks\.[0-9]{1,2}\..*"


def _cli_config(*argv) -> FP8Config:
    return config_from_args(add_fp8_flags(argparse.ArgumentParser()).parse_args(list(argv)))


def _yaml_config(tmp_path, text: str) -> FP8Config:
    path = tmp_path / "fp8.yaml"
    path.write_text(text)
    return FP8Config.load(path)


@pytest.mark.parametrize("way", ["cli", "yaml", "yaml_nested", "keyword"])
def test_a_re_pattern_string_is_not_split_at_its_commas(way, tmp_path):
    config = {
        "cli": lambda: _cli_config("--quantization", "fp8", "--ignored-layers", f"proj_out,{BLOCKS_RE}"),
        "yaml": lambda: _yaml_config(tmp_path, f"quantization: fp8\nignored_layers: 'proj_out,{BLOCKS_RE}'\n"),
        "yaml_nested": lambda: _yaml_config(
            tmp_path, f"quantization_config:\n  method: fp8\n  ignored_layers: 'proj_out, {BLOCKS_RE}'\n"),
        "keyword": lambda: FP8Config.load(quantization="fp8", ignored_layers=f"proj_out, {BLOCKS_RE}"),
    }[way]()
    assert config.quantization_config.ignored_layers == ("proj_out", BLOCKS_RE)


def test_prepare_model_keeps_the_blocks_a_re_string_names_native():
    model = Blocks()
    result = fx_fp8.prepare_model(model, quantization="fp8", ignored_layers=BLOCKS_RE)
    assert result["quantized"] == ["proj_out"]
    assert all(type(b["proj"]) is nn.Linear for b in model.transformer_blocks)


@pytest.mark.parametrize("text, piece", [
    ("a, re:x{1,2", "re:x{1,2"), ("re:(a|b, c", "re:(a|b, c"), ("re:[a-z,, b", "re:[a-z,, b")])
def test_an_unclosed_bracket_is_refused_naming_the_pattern(text, piece):
    with pytest.raises(ValueError, match="never closed") as e:
        FP8Config.load(quantization="fp8", ignored_layers=text)
    assert repr(piece) in str(e.value)


def test_commas_outside_brackets_still_separate_patterns():
    cfg = FP8Config.load(quantization="fp8", ignored_layers=r"a, re:x[,}]y{1,3} ,b,re:(p|q\,r)")
    assert cfg.quantization_config.ignored_layers == ("a", "re:x[,}]y{1,3}", "b", r"re:(p|q\,r)")
