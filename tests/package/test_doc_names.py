"""Every name the docs cite exists: README.md and docs/*.md cite `fx_fp8.x.y`
modules, functions and constants, file paths (fx_fp8/..., tests/..., benchmarks/..., examples/...)
and `fx-fp8 <command> --flag` lines; a renamed or removed one would send a reader nowhere
(docs/diffusers_quantization.md cited fx_fp8.quant.quantized_linear.QUANTIZATIONS, which never existed)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: a dotted fx_fp8 name not preceded by a word, a dot, a colon or a slash (torch.ops.fx_fp8.x, fx_fp8::x,
#: a path) and not a file name (fx_fp8.yaml)
DOTTED = re.compile(r"(?<![\w.:/-])fx_fp8(?:\.[A-Za-z_]\w*)+")
FILE_SUFFIXES = {"yaml", "yml", "json", "py", "md", "png", "txt", "sh", "safetensors"}
PATH = re.compile(r"(?<![\w/.-])((?:fx_fp8|tests|benchmarks|examples)/[\w/.-]*\w)")
CLI = re.compile(r"fx-fp8 (inspect|dump|compare|sensitivity)\b([^`\n|#]*)")


def _text(path: Path) -> str:
    return path.read_text()


def resolves(name: str) -> bool:
    """`name` is an importable module, or an attribute chain on the longest importable prefix."""
    parts = name.split(".")
    if parts[-1] in FILE_SUFFIXES:
        return True
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def cited_names(text: str) -> set[str]:
    return {m.group(0) for m in DOTTED.finditer(text)}


def cli_flags(text: str) -> list[tuple[str, str]]:
    """[(command, --flag)] of every `fx-fp8 <command> ... --flag` the text shows."""
    out = []
    for m in CLI.finditer(text):
        for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", m.group(2)):
            out.append((m.group(1), flag))
    return out


def _parser_flags() -> dict:
    from fx_fp8.tools.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices
    return {cmd: {s for a in p._actions for s in a.option_strings} for cmd, p in sub.items()}


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_dotted_fx_fp8_name_a_doc_cites_exists(path):
    missing = sorted(n for n in cited_names(_text(path)) if not resolves(n))
    assert not missing, f"{path.name} cites names that do not exist: {missing}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_file_path_a_doc_cites_exists(path):
    missing = sorted(
        {
            p
            for p in PATH.findall(_text(path))
            if "*" not in p and not (ROOT / p).exists() and not (ROOT / p.rstrip("/")).exists()
        }
    )
    assert not missing, f"{path.name} cites paths that do not exist: {missing}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_cli_flag_a_doc_shows_exists(path):
    known = _parser_flags()
    unknown = sorted({f"fx-fp8 {cmd} {flag}" for cmd, flag in cli_flags(_text(path)) if flag not in known[cmd]})
    assert not unknown, f"{path.name} shows flags the CLI does not take: {unknown}"


def test_the_checks_see_what_they_check():
    """Not vacuously green: each extractor finds known citations and refuses invented ones."""
    text = (
        "`fx_fp8.quant.quantized_linear.QUANTIZATIONS` `fx_fp8.prepare_model` `torch.ops.fx_fp8.scaled_mm` "
        "`fx_fp8.yaml` see fx_fp8/report.py and `fx-fp8 inspect --summary --no-such-flag`"
    )
    assert cited_names(text) == {"fx_fp8.quant.quantized_linear.QUANTIZATIONS", "fx_fp8.prepare_model", "fx_fp8.yaml"}
    assert not resolves("fx_fp8.quant.quantized_linear.QUANTIZATIONS")
    assert resolves("fx_fp8.prepare_model") and resolves("fx_fp8.yaml")
    assert PATH.findall(text) == ["fx_fp8/report.py"]
    assert cli_flags(text) == [("inspect", "--summary"), ("inspect", "--no-such-flag")]
    assert "--no-such-flag" not in _parser_flags()["inspect"]
    assert sum(len(cited_names(_text(p))) for p in DOCS) > 50
