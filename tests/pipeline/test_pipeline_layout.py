"""The diffusers glue's layout and its shared config helpers.

One YAML / stage-config reader and one did-you-mean serve FP8Config, PipelineOptions and the
cache-dit keys; fx_fp8/pipeline/ keeps one concern a file; comments and docstrings say why instead
of citing this project's issue numbers (a number means nothing to a reader of the code).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.config.files import config_keys
from fx_fp8.config.values import did_you_mean
from fx_fp8.pipeline.options import PipelineOptions

ROOT = Path(__file__).resolve().parents[2]


def test_did_you_mean_names_the_closest_key_and_takes_any_key():
    assert did_you_mean("ulysess_degree", ("ulysses_degree", "ring_degree")) == " (did you mean 'ulysses_degree'?)"
    assert did_you_mean("zzz", ("ulysses_degree",)) == ""
    assert did_you_mean(1, ("a",)) == ""  # YAML keys may be numbers


def test_a_number_as_a_nested_key_is_named_not_a_type_error():
    """YAML reads `attention: {1: tensor}` with an int key: a ValueError naming it (difflib alone
    raised TypeError on it)."""
    with pytest.raises(ValueError, match="unknown key 1 in attention"):
        FP8Config.from_mapping({"diffusion_kv_cache_dtype": "fp8", "attention": {1: "tensor"}})


def test_pipeline_options_read_a_malformed_stage_config_as_fp8config_does():
    """One stage-config reader: PipelineOptions refuses what FP8Config refuses (it read a stage
    config without a diffusion stage as "no options")."""
    for data, words in (
        ({"stage_args": {"a": 1}}, "stage_args must be a list"),
        ({"stage_args": [{"stage_type": "llm"}]}, "no stage with stage_type: diffusion"),
        ({"stage_args": [{"stage_type": "diffusion", "engine_args": [1]}]}, "must be a mapping"),
        ([1, 2], "expected a mapping at the top level"),
    ):
        for read in (FP8Config.from_mapping, PipelineOptions.from_mapping):
            with pytest.raises(ValueError, match=words):
                read(data, where="stage.yaml")


def test_stage_config_keys_are_read_once_and_warned_about_once():
    stage = {
        "stage_args": [
            {
                "stage_type": "diffusion",
                "engine_args": {
                    "model": "x",
                    "diffusion_kv_cache_dtype": "fp8",
                    "parallel_config": {"ulysses_degree": 2},
                },
            }
        ]
    }
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert config_keys(stage, "s.yaml", warn=False) == {
            "diffusion_kv_cache_dtype": "fp8",
            "parallel_config": {"ulysses_degree": 2},
        }
        assert not seen
        assert PipelineOptions.from_mapping(stage).parallel.ulysses_degree == 2
        assert not seen  # the keys neither reader uses are FP8Config's warning, given once
        FP8Config.from_mapping(stage)
    assert [str(w.message) for w in seen] == ["config: engine_args keys not used by fx_fp8: ['model']"]


def test_pipeline_package_keeps_one_concern_a_file():
    files = sorted((ROOT / "fx_fp8" / "pipeline").glob("*.py"))
    assert {f.name for f in files} >= {"compile.py", "restore.py", "state.py", "options.py", "cache_hooks.py"}
    long = {f.name: n for f in files if (n := len(f.read_text().splitlines())) > 450}
    assert not long, f"over 450 lines: {long}"
    for old in ("parallel.py", "pipelines.py", "cache_dit.py"):
        assert not (ROOT / "fx_fp8" / old).exists(), f"fx_fp8/{old} moved into fx_fp8/pipeline/"


def test_one_did_you_mean():
    """difflib appears in one place of the library: the shared did_you_mean."""
    users = [
        str(p.relative_to(ROOT)) for p in (ROOT / "fx_fp8").rglob("*.py") if "difflib" in p.read_text(encoding="utf-8")
    ]
    assert users == ["fx_fp8/config/values.py"]


#: this project's issue numbers: the word issue followed by a number, or a bare number after "(#";
#: another project's (vLLM-Omni's, diffusers') name their project first and stay
_ISSUE = re.compile(r"\b[Ii]ssues?\s*#?\d+|\(#\d+\)")


def test_no_comment_cites_an_issue_number():
    paths = [p for d in ("fx_fp8", "passes", "tests", "benchmarks", "examples") for p in (ROOT / d).rglob("*.py")]
    paths += sorted((ROOT / "docs").glob("*.md"))
    cited = []
    for p in paths:
        text = p.read_text(encoding="utf-8")
        if "ssue" not in text and "(#" not in text:  # the regular expression is slow on 2 MB of code
            continue
        cited += [
            f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group()}" for m in _ISSUE.finditer(text)
        ]
    assert not cited, "say why instead of citing an issue:\n" + "\n".join(cited)
