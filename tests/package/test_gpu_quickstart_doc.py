"""docs/gpu_quickstart.md against the code: its snippets parse and name what exists (fx_fp8 names,
config keys, CLI and benchmark flags, extras, pytest markers, gpu_run.sh steps), its links resolve,
and the report reasons it quotes are what the CUDA lowering writes. Nothing here runs a model."""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import re
import shlex
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "gpu_quickstart.md"


def _fences(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _flat(text: str) -> str:
    return " ".join(text.split())


# -- Python: fx_fp8 names and the configs the snippets build ----------------------------------------
def _chain(node) -> list[str]:
    """['fx_fp8', 'a', 'b'] for the expression fx_fp8.a.b; [] for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else []


def _lazy_names(module) -> set[str]:
    """Names a module's own __getattr__ serves on first use (`if name == "X":`)."""
    getter = vars(module).get("__getattr__")
    return set(re.findall(r"name == [\"'](\w+)[\"']", inspect.getsource(getter))) if getter else set()


def _resolves(chain: list[str], lazy: bool) -> Optional[bool]:
    """Whether the dotted name exists; None where a module would serve it through its own
    __getattr__ and `lazy` is false (fx_fp8.DiffusersConfig imports diffusers: the slow test's)."""
    obj = importlib.import_module(chain[0])
    for i, part in enumerate(chain[1:], 1):
        if inspect.ismodule(obj) and part not in vars(obj):
            try:
                obj = importlib.import_module(".".join(chain[: i + 1]))
                continue
            except ImportError:
                pass
            if not lazy and part in _lazy_names(obj):
                return None
        try:
            obj = getattr(obj, part)
        except AttributeError:
            return False
    return True


def _literal(node, what: str):
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise ValueError(f"{what} is not a literal ({ast.unparse(node)}): the test cannot check it") from None


def _entry_point_backends() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    block = text.split("[project.entry-points.torch_dynamo_backends]")[1].split("\n[")[0]
    return set(re.findall(r"^(\w+)\s*=", block, flags=re.M))


def _check_call(call: ast.Call) -> None:
    """Builds the FP8Config a call of the page would build (raises what fx_fp8 raises)."""
    import fx_fp8
    from fx_fp8.compile.backend import MODES, config_from_options
    from fx_fp8.config.fp8_config import FP8Config

    chain = _chain(call.func)
    kwargs = {k.arg: k.value for k in call.keywords if k.arg is not None}
    if "backend" in kwargs and _literal(kwargs["backend"], "backend") not in _entry_point_backends():
        raise ValueError(f"backend {ast.unparse(kwargs['backend'])} is not a torch_dynamo_backends entry point")
    if "mode" in kwargs and _literal(kwargs["mode"], "mode") not in MODES:
        raise ValueError(f"mode {ast.unparse(kwargs['mode'])} is none of {MODES}")
    if "options" in kwargs:  # torch.compile / compile_repeated_blocks
        config_from_options(_literal(kwargs["options"], "options"))
    targets = {
        "compile_pipeline": (fx_fp8.compile_pipeline, 1),
        "prepare_model": (fx_fp8.prepare_model, 1),
        "DiffusersConfig": (None, 0),
    }
    if chain[:1] != ["fx_fp8"] or chain[-1] not in targets:
        return
    func, first = targets[chain[-1]]
    own = set(inspect.signature(func).parameters) if func is not None else set()
    config = _literal(call.args[first], "config") if len(call.args) > first else None
    overrides = {k: _literal(v, k) for k, v in kwargs.items() if k not in own}
    FP8Config.load(config, **overrides)


def python_problems(code: str, where: str, imports: bool = False) -> list[str]:
    """What is wrong in a snippet. imports: run its imports first, as a reader does (slow: diffusers),
    and check the fx_fp8 names only they make available."""
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        return [f"{where}: does not parse: {e}"]
    out = []
    for node in tree.body:  # the snippet's imports first (diffusers before fx_fp8.DiffusersConfig)
        if imports and isinstance(node, (ast.Import, ast.ImportFrom)):
            try:
                exec(compile(ast.Module([node], []), where, "exec"), {})
            except Exception as e:
                out.append(f"{where}: {ast.unparse(node)}: {type(e).__name__}: {e}")
    for node in ast.walk(tree):
        chain = _chain(node) if isinstance(node, ast.Attribute) else []
        if chain[:1] == ["fx_fp8"] and _resolves(chain, lazy=imports) is False:
            out.append(f"{where}: {'.'.join(chain)} does not exist")
        if isinstance(node, ast.Call):
            try:
                _check_call(node)
            except Exception as e:  # what a user running the line would meet
                out.append(f"{where}: {ast.unparse(node)}: {type(e).__name__}: {e}")
    return out


# -- shell: commands, flags, extras, markers, steps ---------------------------------------------------
@functools.lru_cache(maxsize=None)
def _load_script(rel: str):
    name = f"_gpu_quickstart_{Path(rel).stem}"
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _parse_cuda_bench(argv):
    from fx_fp8.compile.backend import config_from_options

    args = _load_script("benchmarks/cuda_bench.py").parse_args(argv)
    if args.fx_options is not None:
        config_from_options(args.fx_options)


def _parse_cli(argv):
    from fx_fp8.tools import cli

    cli.build_parser().parse_args(argv)


#: scripts the page may run -> a check of their arguments (argparse; exits or raises on a bad flag)
SCRIPTS = {
    "benchmarks/cuda_bench.py": _parse_cuda_bench,
    "benchmarks/attention_kernels.py": lambda argv: _load_script("benchmarks/attention_kernels.py").parse(argv),
    "benchmarks/w8a16_forms.py": lambda argv: _load_script("benchmarks/w8a16_forms.py").parse(argv),
    "examples/text_to_image.py": lambda argv: _load_script("examples/text_to_image.py").build_parser().parse_args(argv),
}


def _extras() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    block = text.split("[project.optional-dependencies]")[1].split("\n[")[0]
    return set(re.findall(r"^([\w-]+)\s*=", block, flags=re.M))


def _markers() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    return set(re.findall(r'^\s*"(\w+):', text.split("markers = [")[1].split("]")[0], flags=re.M))


def _gpu_run_steps() -> set[str]:
    text = (ROOT / "benchmarks" / "gpu_run.sh").read_text()
    return set(re.search(r"case \$step in ([\w|]+)\)", text).group(1).split("|"))


def _check_command(words: list[str]) -> list[str]:
    """Problems of one command (a list of words); raises on an argparse failure."""
    from fx_fp8.graph.dynamo_internals import SUPPORTED_TORCH

    head, rest = words[0], words[1:]
    if head in ("python", "python3") and rest[:1] == ["-c"]:
        return python_problems(rest[1], "python -c")
    if (head in ("python", "python3") and rest[:2] == ["-m", "venv"]) or head == ".":
        return []
    if head in ("python", "python3") and rest[:2] == ["-m", "pytest"]:
        expr = rest[rest.index("-m", 2) + 1].split() if "-m" in rest[2:] else []
        unknown = [w for w in expr if w not in _markers() | {"not", "and", "or"}]
        return [f"pytest marker(s) {unknown} not declared in pyproject"] if unknown else []
    if (head in ("python", "python3") and rest[:2] == ["-m", "fx_fp8"]) or head == "fx-fp8":
        _parse_cli(rest[2:] if head != "fx-fp8" else rest)
        return []
    if head in ("python", "python3") and rest and rest[0] in SCRIPTS:
        SCRIPTS[rest[0]](rest[1:])
        return []
    if head == "benchmarks/gpu_run.sh":
        return [f"gpu_run.sh has no step {s!r}" for s in rest if s not in _gpu_run_steps()]
    if head == "pip" and rest[:1] == ["install"]:
        out = []
        for w in rest[1:]:
            extra = re.fullmatch(r"\.\[([\w,-]+)\]", w)
            if extra:
                out += [f"no extra [{e}] in pyproject" for e in extra.group(1).split(",") if e not in _extras()]
            version = re.fullmatch(r"torch==(\d+)\.(\d+)\.\d+", w)
            if version and not SUPPORTED_TORCH[0] <= (int(version[1]), int(version[2])) <= SUPPORTED_TORCH[1]:
                out.append(f"{w} is outside the supported torch range {SUPPORTED_TORCH}")
        return out
    return [f"command not checked by this test: {shlex.join(words)} (add it to the test)"]


def shell_problems(code: str) -> list[str]:
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        commands, current = [], []
        for w in words + ["&&"]:
            if w == "&&":
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(w)
        for words in commands:
            try:
                out += _check_command(words)
            except (SystemExit, Exception) as e:  # argparse exits; the CLI raises UsageError
                out.append(f"{shlex.join(words)}: {type(e).__name__}: {e}")
    return out


# -- links ----------------------------------------------------------------------------------------------
def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def link_problems(text: str, page: Path) -> list[str]:
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        path = page if not file else (page.parent / file)
        if not path.exists():
            out.append(f"broken link {target}")
        elif anchor and path.suffix == ".md":
            heads = {_slug(h) for h in re.findall(r"^#+ (.*)$", path.read_text(encoding="utf-8"), flags=re.M)}
            if anchor not in heads:
                out.append(f"link {target}: no heading with anchor #{anchor}")
    return out


#: keyword arguments the page shows in inline code that belong to diffusers, not to fx_fp8's config
NOT_CONFIG_KEYWORDS = {"device_map"}


def inline_problems(text: str, imports: bool = False) -> list[str]:
    """Inline code the page tells readers to write: calls of fx_fp8's entry points, `key=value`
    keywords of them and `dotted.key: value` config settings."""
    out = []
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", prose):
        for name in re.findall(r"\bfx_fp8(?:\.\w+)+", span):
            if _resolves(name.split("."), lazy=imports) is False:
                out.append(f"`{span}`: {name} does not exist")
        call = re.fullmatch(r"(?:fx_fp8\.)?((?:compile_pipeline|prepare_model|DiffusersConfig)\(.*\))", span)
        keyword = re.fullmatch(r"(\w+)=(.+)", span)
        setting = re.fullmatch(r"(\w+(?:\.\w+)+): (\S+)", span)
        if call:
            out += python_problems(f"import fx_fp8\nfx_fp8.{call.group(1)}", f"`{span}`", imports)
        elif keyword and keyword.group(1) not in NOT_CONFIG_KEYWORDS:
            out += python_problems(f"import fx_fp8\nfx_fp8.compile_pipeline(pipe, {span})", f"`{span}`", imports)
        elif setting:
            from fx_fp8.config.fp8_config import FP8Config

            import yaml

            *parents, leaf = setting.group(1).split(".")
            mapping = {leaf: yaml.safe_load(setting.group(2))}
            for key in reversed(parents):
                mapping = {key: mapping}
            try:
                FP8Config.load(mapping)
            except Exception as e:
                out.append(f"`{span}`: {type(e).__name__}: {e}")
    return out


def page_problems(text: str, page: Path = PAGE, imports: bool = False) -> list[str]:
    out = []
    for i, block in enumerate(_fences(text, "python")):
        out += python_problems(block, f"python block {i + 1}", imports)
    out += inline_problems(text, imports)  # after the blocks, whose imports the prose assumes
    for block in _fences(text, "yaml"):
        from fx_fp8.config.fp8_config import FP8Config

        import yaml

        try:
            FP8Config.load(yaml.safe_load(block))
        except Exception as e:
            out.append(f"yaml block: {type(e).__name__}: {e}")
    for block in _fences(text, "bash"):
        out += shell_problems(block)
    return out + link_problems(text, page)


# -- the tests ------------------------------------------------------------------------------------------
def test_the_page_matches_the_code():
    text = PAGE.read_text(encoding="utf-8")
    assert len(_fences(text, "python")) >= 3 and len(_fences(text, "bash")) >= 2
    assert page_problems(text) == []


def test_the_snippets_imports_run_and_every_fx_fp8_name_exists():
    """The page's imports run (diffusers, transformers: slow), then the names only they make
    available (fx_fp8.DiffusersConfig) are checked too."""
    text = PAGE.read_text(encoding="utf-8")
    assert "fx_fp8.DiffusersConfig" in text
    assert page_problems(text, imports=True) == []


def test_the_checks_catch_what_they_check():
    """Each kind of mistake the page could make is reported (so an empty list means something)."""
    bad = "\n".join(
        [
            "```python",
            "import fx_fp8",
            "fx_fp8.compile_pipeline(pipe, regional=True, attention={'kernell': 'triton'})",
            "fx_fp8.get_report(model)",
            "torch.compile(model, backend='fp9')",
            "fx_fp8.prepare_model(model, {'quantisation': 'fp8'})",
            "fx_fp8.DiffusersConfg()",
            "```",
            "```bash",
            "python benchmarks/cuda_bench.py --quik",
            "python benchmarks/cuda_bench.py --flux --fx-options '{\"diffusion_kv_cache_dtyp\": null}'",
            "fx-fp8 inspect --modle tiny",
            'pip install -e ".[cudaa]" && python -m pytest -m gpu',
            "benchmarks/gpu_run.sh quick speed",
            "pip install torch==2.9.0",
            "make all",
            "```",
            "[x](cuda.md#no-such-heading) [y](no_such_page.md)",
            "`compile_pipeline(pipe, atention={})`, `diffusion_kv_cache_dtype=fp9`, `attention.kernal: triton`, `fx_fp8.get_reprts(model)`",
        ]
    )
    problems = "\n".join(page_problems(bad))
    imports = "\n".join(python_problems("from fx_fp8 import no_such_name", "imports", imports=True))
    assert "ImportError" in imports and "no_such_name" in imports, imports
    for expected in (
        "kernell",
        "get_report does not exist",
        "fp9",
        "quantisation",
        "--quik",
        "diffusion_kv_cache_dtyp",
        "--modle",
        "[cudaa]",
        "['gpu']",
        "no step 'speed'",
        "torch==2.9.0",
        "make all",
        "#no-such-heading",
        "broken link no_such_page.md",
        "atention",
        "fp9`",
        "kernal",
        "fx_fp8.get_reprts",
        "fx_fp8.DiffusersConfg does not exist",
    ):
        assert expected in problems, (expected, problems)


def test_readme_links_the_page_once_in_its_documentation_table():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("## Documentation")[1].split("\n## ")[0]
    rows = [line for line in table.splitlines() if "(docs/gpu_quickstart.md)" in line]
    assert len(rows) == 1 and rows[0].startswith("| ["), rows
    assert readme.count("docs/gpu_quickstart.md") == 1


# -- the report text the page quotes, from the CUDA lowering on fake CUDA tensors --------------------------
def _fake_cuda(*shapes, dtype=torch.bfloat16):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return [torch.empty(*s, device="cuda", dtype=dtype) for s in shapes]


@pytest.fixture
def gpu(monkeypatch):
    """set(capability, name): what torch.cuda would say on that GPU."""
    from fx_fp8.ops import attention_table

    def set_gpu(capability, name):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(attention_table, "gpu_name", lambda device: name)

    return set_gpu


def test_quoted_reasons_are_the_lowerings(gpu, monkeypatch):
    import triton  # noqa: F401  a test dependency ([test] extra): attention_reason names a missing Triton first
    from fx_fp8.config.fp8_config import FP8Config
    from fx_fp8.ops import cudnn_attention
    from fx_fp8.ops.cuda import LOWERING

    page = _flat(PAGE.read_text(encoding="utf-8"))
    att = FP8Config().attention
    flux, d80 = _fake_cuda((1, 24, 4608, 128), (1, 24, 4608, 80))
    (full_mask,) = _fake_cuda((1, 1, 4608, 4608), dtype=torch.bool)
    gpu((9, 0), "NVIDIA H200")
    quoted = [
        LOWERING.attention_reason(flux, flux, flux, att),  # Flux-dev at 1024x1024: native by the table
        LOWERING.attention_reason(d80, d80, d80, att),
        LOWERING.attention_reason(flux, flux, flux, att, full_mask).split(" (shape")[0] + " (",
        LOWERING.gemm_description("fp8", "channel", None, True),
    ]  # the default linear recipe
    monkeypatch.setattr(cudnn_attention, "import_cudnn", lambda: (_ for _ in ()).throw(ImportError("no cudnn")))
    cudnn = FP8Config.load(None, attention={"kernel": "cudnn", "granularity": "tensor"}).attention
    quoted.append(LOWERING.attention_reason(flux, flux, flux, cudnn).split(" not importable")[0] + " not importable")
    gpu((8, 0), "NVIDIA A100-SXM4-80GB")
    (w,) = _fake_cuda((3072, 3072))
    pre_ada = LOWERING.attention_reason(flux, flux, flux, att)
    assert LOWERING.weight_only(w, FP8Config().quantization_config) == pre_ada  # linears: weight-only, same reason
    assert LOWERING.weight_only(w, FP8Config.load(None, quantization="int8").quantization_config) is None
    quoted.append(pre_ada)
    for reason in quoted:
        assert reason and _flat(reason) in page, reason


def test_the_attention_decisions_the_page_describes():
    """H200: native at D128 up to about 23k keys, at D64 and with key-padding masks, Triton beyond;
    every other GPU (no row) Triton."""
    from fx_fp8.ops import attention_table, cuda

    table = attention_table.load_table()
    assert {r["gpu"] for r in table["rows"]} == {"NVIDIA H200"}  # "all but the H200" run the Triton kernel
    cut = [r["s_max"] for r in table["rows"] if r["d"] == 128 and not r["mask"] and r["s_max"]]
    assert len(cut) == 1 and 22_000 <= cut[0] <= 24_000, cut

    def pick(gpu_name, d, s, mask=False):
        return attention_table.auto_kernel(gpu_name, d, s, mask, cuda.AUTO_KERNEL, lambda k: True)[0]

    assert pick("NVIDIA H200", 128, 4608) == pick("NVIDIA H200", 128, 16896) == "native"
    assert pick("NVIDIA H200", 64, 4608) == pick("NVIDIA H200", 128, 4608, mask=True) == "native"
    assert pick("NVIDIA H200", 128, 32760) == "triton"
    assert pick("NVIDIA B200", 128, 4608) == pick("NVIDIA L40S", 64, 4608) == "triton"
