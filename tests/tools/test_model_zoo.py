"""One registry of tiny models (fx_fp8.tools.model_zoo): each diffusers class declared once, and the
zoo, the families, model_source and the tiny pipelines all build a family from its one entry."""

from __future__ import annotations

import warnings

import pytest
import torch

from fx_fp8.tools import model_source
from fx_fp8.tools.model_zoo import registry as model_zoo
from fx_fp8.tools.model_zoo.entry import TinyModel
from fx_fp8.tools.model_zoo.registry import _table

FAMILIES = model_zoo.FAMILIES
#: what diffusers adds to a config on its own (versions, the class name, where it was loaded from)
_PRIVATE = ("_class_name", "_diffusers_version", "_name_or_path", "_use_default_values")


def _config(model: torch.nn.Module) -> dict:
    return {k: v for k, v in dict(model.config).items() if k not in _PRIVATE}


def _plain(value):
    """Tuples as lists, as a config saved and loaded has them."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def test_each_class_and_config_declared_once():
    classes = [e.class_name for e in model_zoo.MODELS.values()]
    assert len(classes) == len(set(classes)) == len(model_zoo.MODELS) >= 63
    configs = [(e.class_name, repr(sorted(e.config.items()))) for e in model_zoo.MODELS.values()]
    assert len(configs) == len(set(configs))
    # the thin modules show the registry's objects, not copies


def test_every_diffusers_transformer_class_is_in_the_zoo_or_listed_with_its_reason():
    in_zoo = {e.class_name for e in model_zoo.MODELS.values()}
    exported = model_zoo.diffusers_transformer_classes()
    assert len(exported) >= 75 and "LongCatAudioDiTVae" not in exported
    assert {"MiniMaxH3Transformer3DModel", "Flux3Transformer2DModel", "QwenImage21Transformer2DModel"} <= in_zoo
    assert [c for c in exported if c not in in_zoo and c not in model_zoo.NOT_IN_ZOO] == []
    assert not in_zoo & set(model_zoo.NOT_IN_ZOO), "listed both in the zoo and as not in it"
    assert set(model_zoo.NOT_IN_ZOO) <= set(exported), "a listed class diffusers no longer exports"
    assert all(reason.strip() for reason in model_zoo.NOT_IN_ZOO.values())


def test_the_supported_models_page_has_every_zoo_class_and_each_reason_for_the_others():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "supported_models.md").read_text(encoding="utf-8")
    rows = {line.split(" | ")[0].strip("| `") for line in page.splitlines() if line.startswith("| `")}
    assert rows == {e.class_name for e in model_zoo.MODELS.values()}, "regenerate: benchmarks/supported_models.py"
    for cls, reason in model_zoo.NOT_IN_ZOO.items():
        assert f"- `{cls}`: {reason}" in page


def test_a_second_declaration_is_refused():
    entry = model_zoo.MODELS["dit"]
    twin = TinyModel("dit-again", entry.class_name, entry.kind, entry.config, entry.inputs)
    with pytest.raises(ValueError, match="DiTTransformer2DModel is declared twice: 'dit' and 'dit-again'"):
        _table([entry, twin])
    with pytest.raises(ValueError, match="tiny model 'dit' is declared twice"):
        _table([entry, TinyModel("dit", "OtherModel", "image", {}, entry.inputs)])
    with pytest.raises(ValueError, match="kind 'sound' is not one of image, video, audio"):
        TinyModel("x", "X", "sound", {}, entry.inputs)


def test_each_family_and_alias_resolves_to_its_zoo_entry():
    assert FAMILIES == ("flux", "qwen-image", "wan", "z-image", "sd3")
    for name in FAMILIES:
        entry = model_zoo.lookup(name)
        assert entry is model_zoo.MODELS[name] and entry.family is not None
        assert model_source.resolve_model(name).class_name == entry.class_name
        for alias in entry.family.aliases:
            assert model_zoo.lookup(alias) is entry and model_zoo.canonical_family(alias.upper()) == name
    assert {e.name for e in model_zoo.MODELS.values() if e.family} == set(FAMILIES)
    assert model_zoo.ALIASES == {
        "qwen": "qwen-image",
        "qwenimage": "qwen-image",
        "wan2.1": "wan",
        "wan2.2": "wan",
        "zimage": "z-image",
    }
    assert model_zoo.TINY_PIPELINES == ("flux", "qwen-image", "wan2.1", "wan2.2", "z-image", "sd3")


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_zoo_families_model_source_and_pipelines_build_one_config(family):
    """The family's transformer has the same config whichever module builds it."""
    expected = dict(model_zoo.MODELS[family].config)
    built = {
        "zoo": _quiet(model_zoo.build, family),
        "families": _quiet(model_zoo.build_tiny_transformer, family),
        "model_source": model_source.resolve_model(family).load_transformer(),
        "tiny_pipelines": _quiet(model_zoo.build_tiny_pipeline, family)[0].transformer,
    }
    reference = _config(built["families"])
    assert {k: _plain(reference[k]) for k in expected} == _plain(expected)
    for who, model in built.items():
        assert type(model).__name__ == model_zoo.MODELS[family].class_name, who
        assert _config(model) == reference, who


def test_family_inputs_come_from_one_maker():
    """model_source shapes a folder's transformer with the family's maker: the same kwargs as
    example_inputs wherever the sizes agree (Flux folders get the shipped model's 16x16 tokens)."""
    for name in FAMILIES:
        model = _quiet(model_zoo.build_tiny_transformer, name, layers=1)
        src = model_source.ModelSource(
            spec="folder", kind="transformer_dir", class_name=model_zoo.MODELS[name].class_name
        )
        ours, theirs = (
            model_zoo.example_inputs(name, model, batch=2, seed=1),
            src.example_inputs(model, batch=2, seed=1),
        )
        if name == "flux":
            assert theirs["hidden_states"].shape == (2, 256, 32) and ours["hidden_states"].shape == (2, 64, 32)
            continue
        assert set(ours) == set(theirs), name
        for key, value in ours.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, theirs[key]), (name, key)
            elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
                assert value  # not vacuous: all() of nothing is True
                assert all(torch.equal(a, b) for a, b in zip(value, theirs[key])), (name, key)
            else:
                assert value == theirs[key], (name, key)


def test_bad_names_sizes_and_layers_are_named():
    with pytest.raises(ValueError, match="unknown zoo model 'nope': expected one of auraflow, "):
        model_zoo.lookup("nope")
    with pytest.raises(ValueError, match="unknown model family 'dit'"):
        model_zoo.build_tiny_transformer("dit")
    with pytest.raises(ValueError, match="unknown kind 'sound'"):
        model_zoo.names("sound")
    with pytest.raises(ValueError, match="layers must be an int >= 1, got 0"):
        model_zoo.build_tiny_transformer("flux", layers=0)
    with pytest.raises(ValueError, match="layers=1 for 'dit': only a family"):
        model_zoo.config("dit", layers=1)
    with pytest.raises(ValueError, match="unknown tiny pipeline 'wan3'"):
        model_zoo.build_tiny_pipeline("wan3")
    model = model_zoo.build("dit")
    with pytest.raises(ValueError, match="variant must be an int in 0..3, got 4"):
        model_zoo.make_inputs("dit", model, variant=4)


def test_layers_set_the_family_layer_keys():
    assert model_zoo.config("flux", layers=3)["num_single_layers"] == 3
    assert model_zoo.config("z-image", layers=1)["n_layers"] == 1
    assert model_zoo.config("z-image", layers=1)["n_refiner_layers"] == 1  # not a layer key
    assert model_zoo.MODELS["flux"].config["num_layers"] == 2  # the entry is read-only
    with pytest.raises(TypeError):
        model_zoo.MODELS["flux"].config["num_layers"] = 3


def test_the_registry_is_packaged():
    """A wheel carries only the packages pyproject.toml lists."""
    import pathlib
    import tomllib

    pyproject = tomllib.loads((pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert "fx_fp8.tools.model_zoo" in pyproject["tool"]["setuptools"]["packages"]
