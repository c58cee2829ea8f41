"""`fx-fp8 inspect / dump / compare / sensitivity` and bad input.

Everything runs in-process through `fx_fp8.tools.cli.main(argv)` (no torch start-up per case);
one subprocess test checks that the installed `fx-fp8` entry point works.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fx_fp8.tools.model_source import resolve_model

from cli_runs import cli, no_work, one_error_line, strict_json  # noqa: F401 (no_work: a fixture)

ROOT = Path(__file__).resolve().parents[2]
TINY_TRANSFORMER_CONFIG = ROOT / "fx_fp8" / "tools" / "tiny_model" / "weights" / "transformer" / "config.json"


def count_nodes(model, kwargs) -> dict:
    """SDPA and linear call_function nodes of the graph Dynamo gives a backend (independent of fx_fp8)."""
    counts = {"attention": 0, "linear": 0}

    def counting_backend(gm, example_inputs):
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target is F.scaled_dot_product_attention:
                counts["attention"] += 1
            elif n.op == "call_function" and n.target is F.linear:
                counts["linear"] += 1
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=counting_backend, fullgraph=True)(**kwargs)
    return counts


def table_rows(text: str, header_start: str = "module") -> list[list[str]]:
    """Rows of the first tabulate table whose header starts with `header_start`."""
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


@pytest.fixture(scope="module")
def tiny_counts():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        src = resolve_model("tiny")
        model = src.load_transformer()
        return count_nodes(model, src.example_inputs(model))


# -- the commands ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_inspect_table_and_json_match_the_graph(tiny_counts, capsys):
    # skip step 0 -> two step variants: the table shows the fp8 one and the native one's counts
    flags = ("--diffusion-kv-cache-skip-steps", "0", "--diffusion-kv-cache-skip-layers", "3")
    code, table, err = cli(capsys, "inspect", *flags)
    assert code == 0, err
    code, as_json, err = cli(capsys, "inspect", "--format", "json", *flags)
    assert code == 0, err
    data = strict_json(as_json)

    rows = table_rows(table)
    ops = [r[2] if r[1].isdigit() else r[1] for r in rows]  # the layer column is empty outside blocks
    assert ops.count("attention") == tiny_counts["attention"] == 4
    assert ops.count("linear") == tiny_counts["linear"]
    assert tiny_counts["linear"] > 30

    assert [g["step_variant"] for g in data["graphs"]] == ["fp8", "native"]
    fp8_graph = data["graphs"][0]
    assert [r[0] for r in rows] == [e["module"] for e in fp8_graph["entries"]]
    assert [r[3] if r[1].isdigit() else r[2] for r in rows] == [e["action"] for e in fp8_graph["entries"]]
    # layer 3's attention is native in both variants, every attention is native in the skipped-step one
    att = {e["layer"]: e for e in fp8_graph["entries"] if e["op"] == "attention"}
    assert att[3]["action"] == "native" and "diffusion_kv_cache_skip_layers" in att[3]["reason"]
    assert [att[i]["action"] for i in range(3)] == ["fp8"] * 3
    assert data["graphs"][1]["summary"]["attention"] == {"fp8": 0, "native": 4}

    summary = data["summary"]
    assert summary["nodes"]["attention"] == {"fp8": 3, "native": 1}
    # the sensitive layers run weight-only by default: a column of their own
    assert sum(summary["nodes"]["linear"].values()) == tiny_counts["linear"]
    assert summary["nodes"]["linear"]["weight-only"] > 0
    w = summary["weights"]
    assert w["model_bytes_after"] < w["model_bytes_before"]
    assert w["quantized_linear_bytes_after"] * 3 < w["quantized_linear_bytes_before"]  # fp8 + scales vs fp32
    # the table's summary block shows the same numbers
    srows = {r[0]: tuple(int(v) for v in r[1:4]) for r in table_rows(table, header_start="op ")[:2]}
    assert srows == {op: (c["fp8"], c.get("weight-only", 0), c["native"]) for op, c in summary["nodes"].items()}
    assert "variant native (skipped steps): attention 0 fp8 / 4 native" in table


@pytest.fixture
def torch_logs():
    """Set TORCH_LOGS for this test only: PyTorch logging re-reads the variable, and its handlers
    write to the (captured) stderr of the test."""
    from torch._logging._internal import _init_logs, log_registry

    original = os.environ.get("TORCH_LOGS")
    registered = dict(log_registry.log_alias_to_log_qnames)

    def set_(value: str):
        os.environ["TORCH_LOGS"] = value
        _init_logs()

    yield set_
    if original is None:
        os.environ.pop("TORCH_LOGS", None)
    else:
        os.environ["TORCH_LOGS"] = original
    # "+fx_fp8" registered fx_fp8 as a PyTorch log: every later reset of PyTorch's logs would make it
    # non-propagating again (pytest then attaches its capture handlers to it, and records miss the root)
    log_registry.log_alias_to_log_qnames.clear()
    log_registry.log_alias_to_log_qnames.update(registered)
    _init_logs()
    # _init_logs left the module logger at DEBUG with its handler (on this test's closed stderr) and
    # not propagating: later tests would format a graph dump on every pass
    import logging

    for name in ["fx_fp8", *[n for n in logging.root.manager.loggerDict if n.startswith("fx_fp8.")]]:
        logger = logging.getLogger(name)
        logger.setLevel(logging.NOTSET)
        logger.propagate = True
        for handler in list(logger.handlers):
            logger.removeHandler(handler)


@pytest.mark.slow
def test_dump_writes_graphs_and_torch_logs_shows_them(tmp_path, capsys, torch_logs):
    out = tmp_path / "dump"
    torch_logs("+fx_fp8")
    code, _, err = cli(capsys, "dump", "--out", out, "--model", "flux", "--diffusion-kv-cache-skip-steps", "0")
    assert code == 0, err
    for variant in ("fp8", "native"):
        folder = out / ("graph0_fp8" if variant == "fp8" else "graph1_native")
        files = sorted(p.name for p in folder.iterdir())
        # one file per pass that ran, in order (the pre-quantized pass runs and finds no FP8 weights here)
        assert files == [
            "00_before.py",
            "01_after_fp8_attention.py",
            "02_after_prequantized_linear.py",
            "03_after_quantized_linear.py",
        ]
        before = (folder / files[0]).read_text()
        after = (folder / files[-1]).read_text()
        assert "scaled_dot_product_attention" in before and "fx_fp8.scaled_mm" not in before
        assert "fx_fp8.scaled_mm" in after
        assert ("fx_fp8.fp8_attention" in after) == (variant == "fp8")
    report = strict_json((out / "report.json").read_text())
    assert [g["step_variant"] for g in report["graphs"]] == ["fp8", "native"]
    assert (out / "report.txt").read_text().startswith("model: flux")
    # TORCH_LOGS="+fx_fp8" routes the passes' graph dumps through PyTorch logging
    assert "fx_fp8 after_quantized_linear (variant=fp8)" in err
    assert "fx_fp8 pass fp8_attention rewrote" in err


def test_compare_starts_from_the_models_own_config_as_the_examples_do():
    from fx_fp8.tools.cli import build_parser
    from fx_fp8.tools.cli_common import _choose_config
    from fx_fp8.tools.model_source import resolve_model
    from fx_fp8.tools.tiny_model import TINY_MODEL_DIR

    own = TINY_MODEL_DIR / "fx_fp8.yaml"
    args = build_parser().parse_args(["compare"])
    assert (
        _choose_config(args, resolve_model("tiny")) == f"{own} (the model's own; --library-default for the "
        "library's default)"
    )
    assert args.config == str(own)
    args = build_parser().parse_args(["compare", "--library-default"])
    assert _choose_config(args, resolve_model("tiny")) == "the library default (--library-default)"
    assert args.config is None
    args = build_parser().parse_args(["compare", "--config", "x.yaml"])
    assert _choose_config(args, resolve_model("tiny")) == "--config x.yaml"
    args = build_parser().parse_args(["compare", "--model", "flux"])
    assert _choose_config(args, resolve_model("flux")) == "the library default" and args.config is None


def test_compare_refuses_library_default_with_config(capsys):
    code, _, err = cli(capsys, "compare", "--library-default", "--config", "x.yaml")
    assert code == 2 and err.strip() == (
        "fx-fp8: error: --library-default and --config 'x.yaml' both say which config to start from: give one of them"
    )


@pytest.mark.slow
def test_compare_tiny_prints_metrics_and_writes_png(tmp_path, capsys):
    png = tmp_path / "cmp.png"
    code, out, err = cli(
        capsys,
        "compare",
        "--steps",
        "3",
        "--prompts",
        "2",
        "--height",
        "16",
        "--width",
        "16",
        "--out",
        png,
        "--format",
        "json",
    )
    assert code == 0, err
    res = strict_json(out)
    assert res["samples"] == 2 and res["steps"] == 3
    assert res["latency_native_s"] > 0 and res["latency_fp8_s"] > 0
    assert 10 < res["psnr_db"] < 80, res  # FP8 changed the images, but not into noise
    assert 0.5 < res["ssim"] < 1.0
    assert 0 < res["latents_max_abs_error"] < 2.5
    # the tiny model's own config, as the example uses it (its step policy: attention native on 2 steps)
    from fx_fp8.tools.tiny_model import TINY_MODEL_DIR

    assert res["config_source"].startswith(str(TINY_MODEL_DIR / "fx_fp8.yaml"))
    from fx_fp8 import FP8Config

    assert res["config"] == FP8Config.load(str(TINY_MODEL_DIR / "fx_fp8.yaml")).to_dict()
    assert len(res["prompts"]) == 2
    from PIL import Image

    with Image.open(png) as im:  # 2 rows (one per sample) of 3 images
        assert im.width > 3 * 16 and im.height > 2 * 16


@pytest.mark.slow
def test_compare_with_cache_dit_runs_both_sides_under_cache_dit(capsys):
    """cache-dit is enabled for the native run, then handed over to compile_pipeline (which must
    enable it itself to compile its blocks with their real names)."""
    code, out, err = cli(
        capsys,
        "compare",
        "--steps",
        "4",
        "--prompts",
        "1",
        "--cache-backend",
        "cache_dit",
        "--cache-config",
        '{"Fn_compute_blocks": 1, "Bn_compute_blocks": 0}',
        "--format",
        "json",
    )
    assert code == 0, err
    res = strict_json(out)
    assert 15 < res["psnr_db"] < 80 and 0.5 < res["ssim"] < 1.0, res


# -- strict JSON -------------------------------------------------------------------------------------
def test_json_output_is_strict():
    from fx_fp8.tools.cli_common import to_json

    text = to_json(
        {
            "psnr": float("inf"),
            "low": float("-inf"),
            "bad": float("nan"),
            "ok": 1.5,
            "nested": [(float("inf"), 2)],
            "np": __import__("numpy").float32("inf"),
        }
    )
    assert strict_json(text) == {
        "psnr": "inf",
        "low": "-inf",
        "bad": "nan",
        "ok": 1.5,
        "nested": [["inf", 2]],
        "np": "inf",
    }
    with pytest.raises(ValueError, match="not strict JSON"):
        strict_json(json.dumps({"psnr": float("inf")}))  # what json.dumps alone writes: bare Infinity


def test_compare_json_writes_infinite_psnr_as_a_string(capsys, monkeypatch):
    """Identical native and FP8 outputs: PSNR is +inf, written "inf" (strict JSON), SSIM 1."""
    from fx_fp8.tools.model_source import PipelineRun

    def same_output(self, steps, *, output_type="latent", publish=True):
        gen = torch.Generator().manual_seed(0)
        return torch.randn(1, 4, 8, 8, generator=gen), torch.rand(1, 16, 16, 3, generator=gen)

    monkeypatch.setattr(PipelineRun, "run", same_output)
    code, out, err = cli(
        capsys, "compare", "--steps", "1", "--prompts", "1", "--height", "16", "--width", "16", "--format", "json"
    )
    assert code == 0, err
    res = strict_json(out)
    assert res["psnr_db"] == "inf" and res["latents_psnr_db"] == "inf"
    assert res["ssim"] == 1.0 and res["latents_max_abs_error"] == 0.0
    code, out, err = cli(capsys, "compare", "--steps", "1", "--prompts", "1", "--height", "16", "--width", "16")
    assert code == 0 and "inf" in out, err  # the table too


# -- bad input: one line on stderr, exit status 2 ----------------------------------------------------
@pytest.mark.slow
def test_entry_point_runs_and_bad_input_exits_2_with_one_line(tmp_path):
    """The installed `fx-fp8` script (a subprocess: the entry point is the point)."""
    script = Path(sys.executable).with_name("fx-fp8")
    assert script.is_file(), f"{script} missing: pip install -e . installs it"
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [str(script), "inspect", "--model", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=240,
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [f"fx-fp8: error: model folder not found: '{tmp_path / 'missing'}'"]


def test_bad_input_exits_2_with_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    cases = {
        ("inspect", "--model", str(tmp_path / "missing")): f"model folder not found: '{tmp_path / 'missing'}'",
        ("inspect", "--frobnicate"): "unrecognized arguments: --frobnicate (see 'fx-fp8 --help')",
        ("inspect", "--model", str(tmp_path / "empty")): "holds no transformer",
        ("inspect", "--model", str(tmp_path / "vae")): "holds a AutoencoderKL, not a transformer",
        ("inspect", "--model", "fluxx"): "unknown model 'fluxx'",
        ("inspect", "--diffusion-kv-cache-skip-layers", "3-1"): "invalid token '3-1' in diffusion_kv_cache_skip_layers",
        ("sensitivity", "--diffusion-kv-cache-skip-steps", "a"): "invalid token 'a' in diffusion_kv_cache_skip_steps",
        ("compare", "--steps", "0"): "invalid --steps 0",
        ("inspect", "--format", "xml"): "argument --format: invalid choice: 'xml'",
        ("inspect", "--config", str(tmp_path / "nope.yaml")): "config file not found",
    }
    for argv, expected in cases.items():
        code, out, err = cli(capsys, *argv)
        assert code == 2 and out == "", argv
        assert expected in one_error_line(err), (argv, err)
    assert (
        cli(capsys, "inspect", "--model", str(tmp_path / "missing"))[2].strip()
        == f"fx-fp8: error: model folder not found: '{tmp_path / 'missing'}'"
    )
    assert cli(capsys, "inspect", "--frobnicate")[2].strip().splitlines() == [
        "fx-fp8: error: unrecognized arguments: --frobnicate (see 'fx-fp8 --help')"
    ]


def _pipeline_folder(
    root: Path, name: str, transformer_config: dict, *, weights: bool = True, vae_config: dict | None = None
) -> Path:
    """A diffusers pipeline folder on disk: model_index.json, transformer/ (config, dummy weights), vae/."""
    folder = root / name
    (folder / "transformer").mkdir(parents=True)
    (folder / "vae").mkdir()
    cls = transformer_config["_class_name"]
    (folder / "model_index.json").write_text(
        json.dumps(
            {"_class_name": "FluxPipeline", "transformer": ["diffusers", cls], "vae": ["diffusers", "AutoencoderKL"]}
        )
    )
    (folder / "transformer" / "config.json").write_text(json.dumps(transformer_config))
    if weights:
        (folder / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"not a safetensors file")
    (folder / "vae" / "config.json").write_text(
        json.dumps(vae_config or {"_class_name": "AutoencoderKL", "block_out_channels": [8, 8, 8, 8]})
    )
    return folder


@pytest.fixture
def bad_models(tmp_path):
    tiny = json.loads(TINY_TRANSFORMER_CONFIG.read_text())
    return {
        "unknown class": _pipeline_folder(tmp_path, "unknown", {"_class_name": "NoSuchTransformer2DModel"}),
        "no weights": _pipeline_folder(tmp_path, "noweights", tiny, weights=False),
        "no input builder": _pipeline_folder(tmp_path, "hunyuan", {"_class_name": "HunyuanVideoTransformer3DModel"}),
        "broken weights": _pipeline_folder(tmp_path, "broken", tiny),
    }


#: (command, folder kind) -> text the one error line must contain ({folder}: the folder given to --model)
LOAD_FAILURES = {
    "unknown class": "transformer class 'NoSuchTransformer2DModel' in '{folder}/transformer' is not a diffusers "
    "model class",
    "no weights": "folder '{folder}/transformer' has config.json but no weights",
    "no input builder": "no example-input builder for transformer class 'HunyuanVideoTransformer3DModel' in "
    "'{folder}/transformer'",
    "broken weights": "cannot load the FluxTransformer2DModel in '{folder}/transformer': ",
}
PIPELINE_LOAD_FAILURES = {  # compare / sensitivity run the pipeline, which needs no input builder
    "no input builder": "cannot load the pipeline in '{folder}': ",
    "broken weights": "cannot load the pipeline in '{folder}': ",
}


@pytest.mark.parametrize("command", ["inspect", "dump", "compare", "sensitivity"])
def test_a_model_that_fails_to_load_is_one_line_and_exit_2(command, bad_models, tmp_path, capsys):
    for kind, folder in bad_models.items():
        argv = [command, "--model", folder, "--steps", "1", "--prompts", "1", "--out", tmp_path / "out"]
        if command == "inspect":
            argv = argv[:3]
        elif command == "dump":
            argv = argv[:3] + argv[-2:]
        elif command == "compare":
            argv[-1] = tmp_path / "cmp.png"
        code, out, err = cli(capsys, *argv)
        expected = (
            PIPELINE_LOAD_FAILURES.get(kind) if command in ("compare", "sensitivity") else None
        ) or LOAD_FAILURES[kind]
        assert code == 2 and out == "", (command, kind, err)
        assert expected.format(folder=folder) in one_error_line(err), (command, kind, err)


@pytest.fixture(scope="module")
def saved_wan(tmp_path_factory) -> Path:
    from fx_fp8.tools.model_zoo.registry import build_tiny_transformer

    folder = tmp_path_factory.mktemp("models") / "wan_transformer"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_tiny_transformer("wan").save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_saved_wan_transformer_folder_loads_and_inspects(saved_wan, capsys):
    """WanTransformer3DModel keeps modules in float32: diffusers loads it only with accelerate."""
    code, out, err = cli(capsys, "inspect", "--model", saved_wan, "--format", "json")
    assert code == 0, err
    data = strict_json(out)
    assert data["class"] == "WanTransformer3DModel" and data["model"] == str(saved_wan)
    assert data["summary"]["nodes"]["attention"]["fp8"] == 2  # the 2 self-attentions (cross stays native)
    assert data["summary"]["nodes"]["linear"]["fp8"] > 10
    for command in ("compare", "sensitivity"):  # a transformer folder is not a pipeline: one line, exit 2
        code, out, err = cli(capsys, command, "--model", saved_wan)
        assert code == 2 and "is a transformer folder: compare/sensitivity need a pipeline folder" in one_error_line(
            err
        )


def test_loading_without_accelerate_says_how_to_fix_it(saved_wan, capsys, monkeypatch):
    import diffusers.models.modeling_utils as modeling_utils

    monkeypatch.setattr(modeling_utils, "is_accelerate_available", lambda: False)
    for argv in (("inspect",), ("dump", "--out", saved_wan.parent / "dump")):
        code, out, err = cli(capsys, *argv, "--model", saved_wan)
        line = one_error_line(err)
        assert code == 2 and f"cannot load the WanTransformer3DModel in '{saved_wan}'" in line
        assert "pip install accelerate" in line


def test_accelerate_is_declared_with_diffusers():
    """diffusers' from_pretrained cannot load Wan (_keep_in_fp32_modules) without accelerate."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, deps in extras.items():
        if any(d.startswith("diffusers") for d in deps):
            assert any(d.startswith("accelerate") for d in deps), name


@pytest.mark.parametrize("command", ["compare", "sensitivity"])
def test_sizes_the_pipeline_cannot_make_are_found_before_any_work(command, tmp_path, capsys, no_work):
    tiny = json.loads(TINY_TRANSFORMER_CONFIG.read_text())
    folder = _pipeline_folder(tmp_path, "flux", tiny)  # VAE x8, 2x2 packing: multiples of 16
    sd3 = _pipeline_folder(
        tmp_path, "sd3", {"_class_name": "SD3Transformer2DModel", "patch_size": 2, "pos_embed_max_size": 96}
    )
    cases = [
        (("--height", "33"), "invalid --height 33 for tiny (FluxTransformer2DModel): expected a multiple of 4"),
        (
            ("--width", "8"),
            "invalid --width 8 for tiny (FluxTransformer2DModel): expected a multiple of 4, at least 16",
        ),
        (
            ("--model", "wan", "--height", "40"),
            "invalid --height 40 for wan (WanTransformer3DModel): expected a multiple of 16, at most 128",
        ),
        (("--model", "wan", "--height", "256"), "invalid --height 256 for wan"),  # past its rotary tables
        (("--model", "sd3", "--width", "30"), "invalid --width 30 for sd3"),
        (
            ("--model", "sd3", "--height", "256"),
            "invalid --height 256 for sd3 (SD3Transformer2DModel): expected a multiple of 4, at most 128",
        ),  # past pos_embed_max_size
        (("--model", "z-image", "--width", "132"), "invalid --width 132 for z-image"),
        (
            ("--model", folder, "--height", "40"),
            f"invalid --height 40 for {folder} (FluxTransformer2DModel): expected a multiple of 16",
        ),
        (
            ("--model", sd3, "--width", "1552"),
            f"invalid --width 1552 for {sd3} (SD3Transformer2DModel): expected a multiple of 16, at most 1536",
        ),
    ]
    for flags, expected in cases:
        code, out, err = cli(capsys, command, *flags, "--out", tmp_path / ("o.png" if command == "compare" else "o"))
        assert code == 2 and out == "", (flags, err)
        assert expected in one_error_line(err), (flags, err)


def test_family_size_rules_match_the_tiny_pipelines():
    """The family size rules model_source uses before any work = what the built pipelines' configs say."""
    from fx_fp8.tools.model_source import FAMILY_SIZE_RULES, SizeRule, size_rule
    from fx_fp8.tools.model_zoo.registry import build_tiny_pipeline

    for family, pipeline in (
        ("flux", "flux"),
        ("qwen-image", "qwen-image"),
        ("wan", "wan2.1"),
        ("z-image", "z-image"),
        ("sd3", "sd3"),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe, _ = build_tiny_pipeline(pipeline)
        vae = dict(pipe.vae.config, _class_name=type(pipe.vae).__name__)
        assert (
            size_rule(type(pipe.transformer).__name__, dict(pipe.transformer.config), vae) == FAMILY_SIZE_RULES[family]
        ), family
    # real checkpoints' configs: FLUX.1 (VAE x8, 2x2 packing), Wan2.1 (x8, patch 2), SD3 (x8, patch 2)
    sd_vae = {"_class_name": "AutoencoderKL", "block_out_channels": [128, 256, 512, 512]}
    assert size_rule("FluxTransformer2DModel", {"patch_size": 1}, sd_vae) == SizeRule(16, 16)
    assert size_rule(
        "WanTransformer3DModel", {"patch_size": [1, 2, 2]}, {"_class_name": "AutoencoderKLWan"}
    ) == SizeRule(16, 16, 16384, 16384)
    assert size_rule("SD3Transformer2DModel", {"patch_size": 2, "pos_embed_max_size": 192}, sd_vae) == SizeRule(
        16, 16, 3072, 3072
    )


def test_unwritable_outputs_are_found_before_any_work(tmp_path, capsys, no_work):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    (tmp_path / "a_dir").mkdir()
    cases = [
        (("dump", "--out", blocker / "dump"), f"cannot write --out '{blocker / 'dump'}': '{blocker}' is a file"),
        (("dump", "--out", blocker), f"cannot write --out '{blocker}': '{blocker}' is a file, not a folder"),
        (("compare", "--out", blocker / "x" / "cmp.png"), f"cannot write --out '{blocker / 'x' / 'cmp.png'}'"),
        (("compare", "--out", tmp_path / "a_dir"), f"--out '{tmp_path / 'a_dir'}' is a folder"),
        (("compare", "--out", tmp_path / "cmp"), f"--out '{tmp_path / 'cmp'}': no file extension"),
        (("compare", "--out", tmp_path / "cmp.txt"), f"--out '{tmp_path / 'cmp.txt'}': unsupported image type '.txt'"),
        (("sensitivity", "--out", blocker / "sens"), f"cannot write --out '{blocker / 'sens'}'"),
        (
            ("sensitivity", "--out", tmp_path / "s", "--chart", blocker / "c.png"),
            f"cannot write --chart '{blocker}/c.png'",
        ),
        (("sensitivity", "--out", tmp_path / "s", "--chart", tmp_path / "c.txt"), "--chart"),
        (
            ("sensitivity", "--out", tmp_path / "s", "--yaml", blocker / "r.yaml"),
            f"cannot write --yaml '{blocker}/r.yaml'",
        ),
    ]
    for argv, expected in cases:
        code, out, err = cli(capsys, *argv)
        assert code == 2 and out == "", (argv, err)
        assert expected in one_error_line(err), (argv, err)
    assert not (tmp_path / "s").exists()  # nothing created


def test_output_folder_on_a_read_only_file_system(tmp_path, capsys, no_work, monkeypatch):
    """The probe's failure as root meets it (a read-only mount): a permission bit does not stop root."""
    import errno

    from fx_fp8.tools import cli_flags

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(cli_flags.tempfile, "TemporaryFile", read_only)
    code, _, err = cli(capsys, "dump", "--out", tmp_path / "dump")
    assert code == 2
    assert (
        f"cannot write --out '{tmp_path / 'dump'}': '{tmp_path}' is not writable ({os.strerror(errno.EROFS)})"
    ) in one_error_line(err)
    assert not (tmp_path / "dump").exists()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_output_folder(tmp_path, capsys, no_work):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        code, _, err = cli(capsys, "dump", "--out", ro / "dump")
        assert code == 2 and f"cannot write --out '{ro / 'dump'}': '{ro}' is not writable" in one_error_line(err)
    finally:
        ro.chmod(0o755)


def test_model_source_folders(tmp_path):
    from fx_fp8.tools.model_source import ModelSourceError
    from fx_fp8.tools.tiny_model import TINY_MODEL_DIR

    tiny_dir = resolve_model(str(TINY_MODEL_DIR))  # the pipeline folder itself is the tiny model
    assert tiny_dir.kind == "tiny"
    t = resolve_model(str(TINY_MODEL_DIR / "transformer"))  # a transformer folder
    assert t.kind == "transformer_dir" and t.class_name == "FluxTransformer2DModel"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = t.load_transformer()
    with torch.no_grad():
        out = model(**t.example_inputs(model)).sample
    assert out.shape == (1, 256, 12)
    with pytest.raises(ModelSourceError, match="transformer folder"):
        t.load_pipeline()
    assert resolve_model("Wan2.2").family == "wan" and resolve_model("qwen").family == "qwen-image"
