"""`fx-fp8 inspect / dump / compare` and bad input, each run as `python -m fx_fp8` subprocesses."""
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

from fx_fp8.tools.cli import main
from fx_fp8.tools.model_source import resolve_model

ROOT = Path(__file__).resolve().parents[1]


def fx_fp8_cli(*args, env_extra=None, timeout=240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="2", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "fx_fp8", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


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
    for line in lines[start + 2:]:
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


def test_inspect_table_and_json_match_the_graph(tiny_counts):
    # skip step 0 -> two step variants: the table shows the fp8 one and the native one's counts
    table = fx_fp8_cli("inspect", "--diffusion-kv-cache-skip-steps", "0", "--diffusion-kv-cache-skip-layers", "3")
    assert table.returncode == 0, table.stderr
    as_json = fx_fp8_cli("inspect", "--format", "json", "--diffusion-kv-cache-skip-steps", "0",
                         "--diffusion-kv-cache-skip-layers", "3")
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)

    rows = table_rows(table.stdout)
    ops = [r[2] if r[1].isdigit() else r[1] for r in rows]   # the layer column is empty outside blocks
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
    assert summary["nodes"]["linear"]["fp8"] + summary["nodes"]["linear"]["native"] == tiny_counts["linear"]
    w = summary["weights"]
    assert w["model_bytes_after"] < w["model_bytes_before"]
    assert w["quantized_linear_bytes_after"] * 3 < w["quantized_linear_bytes_before"]  # fp8 + scales vs fp32
    # the table's summary block shows the same numbers
    srows = {r[0]: (int(r[1]), int(r[2])) for r in table_rows(table.stdout, header_start="op ")[:2]}
    assert srows == {op: (c["fp8"], c["native"]) for op, c in summary["nodes"].items()}
    assert "variant native (skipped steps): attention 0 fp8 / 4 native" in table.stdout


def test_dump_writes_graphs_and_torch_logs_shows_them(tmp_path):
    out = tmp_path / "dump"
    r = fx_fp8_cli("dump", "--out", str(out), "--model", "flux", "--diffusion-kv-cache-skip-steps", "0",
                   env_extra={"TORCH_LOGS": "+fx_fp8"})
    assert r.returncode == 0, r.stderr
    for variant in ("fp8", "native"):
        folder = out / ("graph0_fp8" if variant == "fp8" else "graph1_native")
        files = sorted(p.name for p in folder.iterdir())
        assert files == ["00_before.py", "01_after_fp8_attention.py", "02_after_fp8_linear.py"]
        before = (folder / files[0]).read_text()
        after = (folder / files[-1]).read_text()
        assert "scaled_dot_product_attention" in before and "fx_fp8.fp8_linear" not in before
        assert "fx_fp8.fp8_linear" in after
        assert ("fx_fp8.fp8_attention" in after) == (variant == "fp8")
    report = json.loads((out / "report.json").read_text())
    assert [g["step_variant"] for g in report["graphs"]] == ["fp8", "native"]
    assert (out / "report.txt").read_text().startswith("model: flux")
    # TORCH_LOGS="+fx_fp8" routes the passes' graph dumps through PyTorch logging
    assert "fx_fp8 after_fp8_linear (variant=fp8)" in r.stderr
    assert "fx_fp8 pass fp8_attention changed" in r.stderr


def test_compare_tiny_prints_metrics_and_writes_png(tmp_path):
    png = tmp_path / "cmp.png"
    r = fx_fp8_cli("compare", "--steps", "3", "--prompts", "2", "--height", "16", "--width", "16", "--out", str(png),
                   "--format", "json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["samples"] == 2 and res["steps"] == 3
    assert res["latency_native_s"] > 0 and res["latency_fp8_s"] > 0
    assert 10 < res["psnr_db"] < 80, res           # FP8 changed the images, but not into noise
    assert 0.5 < res["ssim"] < 1.0
    assert 0 < res["latents_max_abs_error"] < 2.5
    from PIL import Image

    with Image.open(png) as im:  # 2 rows (one per sample) of 3 images
        assert im.width > 3 * 16 and im.height > 2 * 16


def test_bad_input_exits_2_with_one_line(tmp_path, capsys):
    # as subprocesses: a missing path and an unknown flag
    r = fx_fp8_cli("inspect", "--model", str(tmp_path / "missing"))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [f"fx-fp8: error: model folder not found: '{tmp_path / 'missing'}'"]
    r = fx_fp8_cli("inspect", "--frobnicate")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["fx-fp8: error: unrecognized arguments: --frobnicate (see 'fx-fp8 --help')"]

    # in-process (same main(), no torch start-up per case)
    (tmp_path / "empty").mkdir()
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    cases = {
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
        assert main(list(argv)) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("fx-fp8: error: ") and expected in err[0], (argv, err)


def test_model_source_folders(tmp_path):
    from fx_fp8.tools.model_source import ModelSourceError
    from fx_fp8.tools.tiny_model import TINY_MODEL_DIR

    tiny_dir = resolve_model(str(TINY_MODEL_DIR))          # the pipeline folder itself is the tiny model
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
