"""Round five of hostile use, the config side: `re:` patterns cut at their commas, unmatched
ignored_layers that said nothing outside the backend, inductor_options that crashed or were read
loosely, and a YAML alias bomb that became a giant error message."""

from __future__ import annotations

import argparse
import warnings

import pytest
import torch
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

    def forward(self, x):
        for block in self.transformer_blocks:
            x = x + block["proj"](x)
        return self.proj_out(x)


# -- item 7: a `re:` pattern given as a string keeps its commas ------------------------------------
BLOCKS_RE = r"re:transformer_blocks\.[0-9]{1,2}\..*"


def _messages(record) -> list[str]:
    return [str(w.message) for w in record]


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
            tmp_path, f"quantization_config:\n  method: fp8\n  ignored_layers: 'proj_out, {BLOCKS_RE}'\n"
        ),
        "keyword": lambda: FP8Config.load(quantization="fp8", ignored_layers=f"proj_out, {BLOCKS_RE}"),
    }[way]()
    assert config.quantization_config.ignored_layers == ("proj_out", BLOCKS_RE)


def test_prepare_model_keeps_the_blocks_a_re_string_names_native():
    model = Blocks()
    result = fx_fp8.prepare_model(model, quantization="fp8", ignored_layers=BLOCKS_RE)
    assert result["quantized"] == ["proj_out"]
    assert len(model.transformer_blocks) > 0
    assert all(type(b["proj"]) is nn.Linear for b in model.transformer_blocks)


@pytest.mark.parametrize(
    "text, piece", [("a, re:x{1,2", "re:x{1,2"), ("re:(a|b, c", "re:(a|b, c"), ("re:[a-z,, b", "re:[a-z,, b")]
)
def test_an_unclosed_bracket_is_refused_naming_the_pattern(text, piece):
    with pytest.raises(ValueError, match="never closed") as e:
        FP8Config.load(quantization="fp8", ignored_layers=text)
    assert repr(piece) in str(e.value)


def test_commas_outside_brackets_still_separate_patterns():
    cfg = FP8Config.load(quantization="fp8", ignored_layers=r"a, re:x[,}]y{1,3} ,b,re:(p|q\,r)")
    assert cfg.quantization_config.ignored_layers == ("a", "re:x[,}]y{1,3}", "b", r"re:(p|q\,r)")


# -- item 8: an ignored_layers pattern that matches nothing warns at every entry point --------------
def _unmatched_warnings(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fn()
    return [m for m in _messages(record) if "matched no linear" in m]


@pytest.mark.parametrize("example_inputs", [None, (torch.randn(2, 64),)])
def test_prepare_model_warns_about_a_pattern_that_matches_nothing(example_inputs):
    model = Blocks(n=3)
    found = _unmatched_warnings(
        lambda: fx_fp8.prepare_model(
            model,
            quantization="fp8",
            ignored_layers=["proj_outt", "re:transformer_block\\..*"],
            example_inputs=example_inputs,
        )
    )
    assert len(found) == 1 and "prepare_model" in found[0]
    assert "'proj_outt' (closest: 'proj_out'" in found[0]
    assert "'re:transformer_block\\\\..*' (closest: 'transformer_blocks." in found[0]


def test_prepare_model_is_quiet_when_every_pattern_matches():
    assert (
        _unmatched_warnings(
            lambda: fx_fp8.prepare_model(Blocks(n=3), quantization="fp8", ignored_layers=["proj_out", BLOCKS_RE])
        )
        == []
    )


def test_adopt_prequantized_warns_about_a_pattern_that_matches_nothing():
    from prequantized_layouts import float_stack, modelopt_state_dict

    model = float_stack((64, 96, 64))
    sd = modelopt_state_dict(model, per_channel=True)
    found = _unmatched_warnings(
        lambda: fx_fp8.adopt_prequantized(model, state_dict=sd, quantization="fp8", ignored_layers=["layer.1"])
    )
    assert len(found) == 1 and "adopt_prequantized" in found[0] and "'layer.1' (closest: 'layers.1'" in found[0]


def test_diffusers_config_loading_warns_about_a_pattern_that_matches_nothing(tmp_path):
    from diffusers import ModelMixin
    from diffusers.configuration_utils import ConfigMixin, register_to_config

    class TinyTransformer(ModelMixin, ConfigMixin):
        @register_to_config
        def __init__(self, dim: int = 64):
            super().__init__()
            self.blocks = nn.ModuleList(
                nn.ModuleDict({"to_q": nn.Linear(dim, dim), "to_k": nn.Linear(dim, dim)}) for _ in range(2)
            )

    TinyTransformer().save_pretrained(tmp_path)
    config = fx_fp8.DiffusersConfig(ignored_layers=["to_qq", "to_k"])
    found = _unmatched_warnings(
        lambda: TinyTransformer.from_pretrained(tmp_path, torch_dtype=torch.bfloat16, quantization_config=config)
    )
    assert len(found) == 1 and "DiffusersConfig" in found[0]
    assert "'to_qq' (closest: 'blocks.0.to_q', 'blocks.1.to_q'" in found[0] and "'to_k' (" not in found[0]


# -- item 10: inductor_options={"cpp_wrapper": True} compiles an unprepared model ------------------
def test_cpp_wrapper_inductor_sees_the_models_inputs_and_the_appended_weights(monkeypatch):
    """Under a C++ wrapper Inductor reads its inputs from the placeholders' meta["val"] where any
    placeholder has one: the model's own inputs then were None. What it would read must be real."""
    import torch._inductor.compile_fx as cfx
    import torch._inductor.config as inductor_config
    from toy_models import TwoLinears

    seen = []

    def reading_compile_fx(gm, example_inputs, config_patches=None, **kw):
        with inductor_config.patch(config_patches):
            seen.append(cfx._extract_inputs_from_exported_gm(gm, example_inputs))
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", reading_compile_fx)
    torch._dynamo.reset()
    model = TwoLinears().eval()
    compiled = torch.compile(
        model,
        backend="fp8",
        options={"diffusion_kv_cache_dtype": None, "quantization": "fp8", "inductor_options": {"cpp_wrapper": True}},
    )
    with torch.no_grad():
        compiled(torch.randn(4, 64))
    assert len(seen) == 1 and len(seen[0]) > 2
    assert all(v is not None for v in seen[0])


@pytest.mark.parametrize("dynamic", [False, True])
def test_cpp_wrapper_compiles_and_runs_an_unprepared_model(dynamic):
    from toy_models import TwoLinears

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TwoLinears().eval()
    compiled = torch.compile(
        model,
        backend="fp8",
        dynamic=dynamic,
        options={"diffusion_kv_cache_dtype": None, "quantization": "fp8", "inductor_options": {"cpp_wrapper": True}},
    )
    with torch.no_grad():
        for rows in (4, 6):
            x = torch.randn(rows, 64)
            assert ((compiled(x) - model(x)).norm() / model(x).norm()).item() < 0.1  # FP8 quantization error only


# -- item 11: a YAML alias bomb is refused naming the file; every quoted value is abbreviated -------
def _alias_bomb(levels: int) -> str:
    """The round's 539-byte bomb shape: each level a list of nine uses of the level below."""
    lines = [
        "ignored_layers:",
        '  - &l0 ["xxxxxxxx", "xxxxxxxx", "xxxxxxxx", "xxxxxxxx", "xxxxxxxx", "xxxxxxxx", '
        '"xxxxxxxx", "xxxxxxxx", "xxxxxxxx"]',
    ]
    lines += [f"  - &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("levels", [7, 9])
def test_a_yaml_alias_bomb_is_refused_naming_the_file(levels, tmp_path):
    from fx_fp8.pipeline.options import PipelineOptions

    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb(levels))
    assert len(path.read_bytes()) < 1000
    for load in (FP8Config.load, PipelineOptions.load):
        with pytest.raises(ValueError, match="expands to more than 100,000 YAML nodes") as e:
            load(path)
        assert str(path) in str(e.value) and len(str(e.value)) < 400


def test_an_alias_inside_itself_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("ignored_layers: &a [proj_out, *a]\n")
    with pytest.raises(ValueError, match="an alias refers to a node that contains it") as e:
        FP8Config.load(path)
    assert str(path) in str(e.value)


def test_a_config_using_aliases_as_intended_still_loads(tmp_path):
    path = tmp_path / "aliases.yaml"
    path.write_text(
        "quantization: fp8\nignored_layers: &keep [proj_out, 're:transformer_blocks\\.0\\..*']\n"
        "quantization_config: {method: fp8, ignored_layers: *keep}\n"
    )
    assert FP8Config.load(path).quantization_config.ignored_layers == ("proj_out", r"re:transformer_blocks\.0\..*")


BIG = [["x" * 50] * 9] * 10_000  # what a smaller alias bomb, or a generated config, hands over


@pytest.mark.parametrize(
    "options",
    [
        {"quantization": "fp8", "ignored_layers": BIG},
        {"quantization": "x" * 1_000_000},
        {"quantization": "fp8", "quantization_config": {"weight_block_size": BIG}},
        {"quantization": "fp8", "quantization_config": {"min_features": BIG}},
        {"diffusion_kv_cache_dtype": "fp8", "diffusion_kv_cache_skip_steps": BIG},
        {"diffusion_kv_cache_dtype": "fp8", "attention": BIG},
        {"k" * 1_000_000: 1},
    ],
)
def test_config_errors_quote_an_abbreviated_value(options):
    with pytest.raises(ValueError) as e:
        FP8Config.load(**options)
    assert len(str(e.value)) < 1500, str(e.value)[:2000]


def test_pipeline_and_backend_option_errors_quote_an_abbreviated_value():
    from fx_fp8.compile.backend import config_from_options
    from fx_fp8.pipeline.options import PipelineOptions

    with pytest.raises(ValueError) as e:
        PipelineOptions.load(cache_backend="first_block_cache", cache_config={"threshold": BIG})
    assert "threshold" in str(e.value) and len(str(e.value)) < 1500
    for bad in ({"mode": BIG}, {"inductor_options": {"freezing": BIG}}):
        with pytest.raises(ValueError) as e:
            config_from_options(bad)
        assert len(str(e.value)) < 1500
    with pytest.raises(ValueError) as e:
        fx_fp8.compile_pipeline(_ToyPipe(), mode="x" * 1_000_000)
    assert len(str(e.value)) < 1500


# -- item 13: inductor_options values are checked against Inductor's own setting types --------------
@pytest.mark.parametrize(
    "options, expected",
    [
        ({"freezing": "no"}, "'freezing' 'no' (str): expected bool"),
        ({"max_autotune": "x"}, "'max_autotune' 'x' (str): expected bool"),
        ({"cpp_wrapper": "banana"}, "'cpp_wrapper' 'banana' (str): expected bool"),
        ({"size_asserts": 1}, "'size_asserts' 1 (int): expected bool"),
        ({"triton.multi_kernel": "1"}, "'triton.multi_kernel' '1' (str): expected one of 0, 1, 2, 3"),
        ({"triton.multi_kernel": 7}, "'triton.multi_kernel' 7 (int): expected one of 0, 1, 2, 3"),
        ({"compile_threads": "4"}, "'compile_threads' '4' (str): expected int | None"),
    ],
)
def test_an_inductor_option_of_the_wrong_type_is_refused_by_name(options, expected):
    from fx_fp8.compile.downstream import check_inductor_options

    with pytest.raises(ValueError, match="invalid inductor_options ") as e:
        check_inductor_options(options)
    assert expected in str(e.value) and "torch._inductor.config." + next(iter(options)) in str(e.value)


def test_inductor_options_of_the_right_types_pass():
    from fx_fp8.compile.downstream import check_inductor_options

    good = {
        "freezing": False,
        "cpp_wrapper": True,
        "triton.multi_kernel": 1,
        "compile_threads": None,
        "max_autotune_gemm_backends": "ATEN,TRITON",
        "size_asserts": False,
    }
    assert check_inductor_options(good) == good


def test_a_wrong_type_is_refused_through_torch_compile_and_compile_pipeline():
    from toy_models import TwoLinears

    torch._dynamo.reset()
    compiled = torch.compile(TwoLinears().eval(), backend="fp8", options={"inductor_options": {"freezing": "no"}})
    with pytest.raises(Exception, match="invalid inductor_options 'freezing' 'no'"):
        compiled(torch.randn(2, 64))
    with pytest.raises(ValueError, match="invalid inductor_options 'cpp_wrapper' 'banana'"):
        fx_fp8.compile_pipeline(_ToyPipe(), inductor_options={"cpp_wrapper": "banana"})


class _ToyPipe:
    def __init__(self):
        from toy_models import ToyDiT, ToyScheduler

        self.transformer, self.scheduler = ToyDiT().eval(), ToyScheduler()

    def __call__(self):
        raise AssertionError("not run: the options are refused first")
