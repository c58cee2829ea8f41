"""benchmarks/cuda_bench.py: the GPU benchmark's parts checked on CPU (kernel attribution, tables,
result sections, arguments, model materialisation), and --dry-run running every row at tiny shapes."""

from __future__ import annotations

import datetime
import importlib.util
import os
import re
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from torch.autograd import DeviceType

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "cuda_bench.py")


def _load():
    spec = importlib.util.spec_from_file_location("cuda_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["cuda_bench"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)  # puts benchmarks/ on sys.path for gpu_timing
    return module


cb = _load()
import gpu_timing as gt  # noqa: E402  (benchmarks/, put on sys.path by cuda_bench)


# -- kernel attribution -----------------------------------------------------------------------------
def test_attribute_sums_kernel_time_per_call_and_ranks_kernels_by_share():
    gemm = "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<float8_e4m3, 128> >(Params)"
    quant = "triton_red_fused__to_copy_abs_amax_clamp_div_0"
    kernel_ms, per_call, kernels = gt.attribute([(gemm, 300.0), (quant, 100.0), (gemm, 300.0), (quant, 100.0)], 2)
    assert kernel_ms == pytest.approx(0.4) and per_call == 2
    assert kernels == [
        ("device_kernel", pytest.approx(0.3), pytest.approx(0.75)),
        (quant, pytest.approx(0.1), pytest.approx(0.25)),
    ]
    with pytest.raises(ValueError, match="calls must be >= 1, got 0"):
        gt.attribute([], 0)


def test_short_kernel_names_drop_templates_parameters_and_namespaces():
    assert (
        gt.short_kernel_name("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>(float*)")
        == "cunn_SoftMaxForward"
    )
    assert gt.short_kernel_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD"
    assert gt.short_kernel_name("aten::_scaled_mm") == "aten::_scaled_mm"
    assert gt.short_kernel_name("x" * 60) == "x" * 47 + "~"


def _event(name, device, us, parent=None):
    return SimpleNamespace(
        name=name, device_type=device, cpu_parent=parent, time_range=SimpleNamespace(elapsed_us=lambda: us)
    )


def test_kernel_durations_take_gpu_kernels_on_cuda_and_outermost_aten_ops_on_cpu():
    linear = _event("aten::linear", DeviceType.CPU, 50.0)
    region = _event("Torch-Compiled Region", DeviceType.CPU, 80.0)
    events = [
        region,
        linear,
        _event("aten::addmm", DeviceType.CPU, 40.0, parent=linear),
        _event("aten::amax", DeviceType.CPU, 5.0, parent=region),
        _event("nvjet_tst_128x256", DeviceType.CUDA, 30.0),
        _event("Memset (Device)", DeviceType.CUDA, 1.0),
    ]
    assert gt.kernel_durations(events, "cuda") == [("nvjet_tst_128x256", 30.0), ("Memset (Device)", 1.0)]
    assert gt.kernel_durations(events, "cpu") == [("aten::linear", 50.0), ("aten::amax", 5.0)]


def test_timer_measures_a_cpu_callable_and_attributes_its_ops():
    timer = gt.Timer("cpu")
    x = torch.randn(16, 16)
    t = timer.measure(lambda: torch.mm(x, x))
    assert t.ms > 0 and t.wall_ms > 0 and t.launch_ms > 0 and t.kernel_ms > 0
    assert t.kernels[0][0] == "aten::mm" and t.kernels_per_call == 1


# -- tables and result files ------------------------------------------------------------------------
def _timing(ms, kernels=(("gemm", 1.0),)):
    return gt.Timing(ms, ms * 1.1, ms * 0.2, ms * 0.9, 2.0, [(n, ms * s, s) for n, s in kernels])


def test_quick_table_divides_by_bf16_inductor_and_torchao_of_the_same_case():
    case = "4608x3072->3072"
    rows = [
        cb.Row("linear", case, cb.BF16_INDUCTOR, _timing(0.12), flop=8.7e10),
        cb.Row("linear", case, cb.TORCHAO, _timing(0.30)),
        cb.Row("linear", case, cb.FX_FP8, _timing(0.06, [("gemm", 0.75), ("quant", 0.25)]), note="linear fp8 1/1"),
        cb.Row("linear", case, cb.FX_FP8_PREPARED, "error: RuntimeError: boom"),
        cb.Row("attention", "S4608", cb.CUDNN_BF16, _timing(0.4)),
        cb.Row("attention", "S4608", cb.FX_FP8, _timing(0.2)),
    ]
    lines = cb.quick_table(rows).splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    inductor, torchao, fx, failed, cudnn, fx_attn = cells
    assert inductor[3] == "1" and inductor[4] == "-" and inductor[5] == "725"  # 8.7e10 flop / 0.12 ms
    assert fx[3] == "2" and fx[4] == "5" and fx[9] == "0.818"  # x BF16, x torchao, GPU busy = 0.9 / 1.1
    assert fx[13] == "gemm 75%; quant 25%" and fx[14] == "linear fp8 1/1"
    assert failed[2] == "error: RuntimeError: boom"
    assert fx_attn[3] == "2" and fx_attn[4] == "-"  # attention: cuDNN BF16 is the base; no torchao peer


def test_flux_table_reports_first_call_memory_and_ratios():
    rows = [
        cb.Row("flux", "c", "BF16 Inductor", _timing(134.0), first_s=40.0, extra={"peak GiB": 30.5}),
        cb.Row("flux", "c", cb.TORCHAO, _timing(100.0)),
        cb.Row(
            "flux",
            "c",
            "fx_fp8 prepared",
            _timing(67.0),
            first_s=50.0,
            err=0.01,
            extra={"peak GiB": 18.0, "graphs": "3 / 3 (+0 cached)"},
        ),
        cb.Row("flux", "c", "fx_fp8 prepared, reduce-overhead", "skipped: time budget"),
    ]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in cb.flux_table(rows).splitlines()[2:]]
    assert cells[2][:8] == ["fx_fp8 prepared", "67", "2", "1.49", "50", "-", "3 / 3 (+0 cached)", "18"]
    assert cells[3][1] == "skipped: time budget"


def _kernel_timing(kernels: dict):
    """A Timing whose kernels ({short name: ms per forward}) sum to its kernel ms, as attribute() makes them."""
    total = sum(kernels.values())
    ranked = sorted(((name, ms, ms / total) for name, ms in kernels.items()), key=lambda k: -k[1])
    return gt.Timing(total * 1.1, total * 1.1, 1.0, total, float(len(kernels)), ranked)


def _numbers(cells):
    return [float(c) if c else None for c in cells]


def test_kernel_attribution_table_ranks_kernels_by_the_fx_fp8_torchao_difference_and_sums_to_each_total():
    rows = [
        cb.Row("flux", "c", "BF16 Inductor", _kernel_timing({"gemm_bf16": 50.0, "fused_norm": 5.0, "attn": 20.0})),
        cb.Row(
            "flux",
            "c",
            cb.FX_FP8_PREPARED,
            _kernel_timing({"gemm_fp8": 20.0, "w8a16": 4.7, "quant": 3.0, "attn": 21.0, "fused_norm": 5.0}),
        ),
        cb.Row(
            "flux",
            "c",
            cb.TORCHAO,
            _kernel_timing({"gemm_fp8": 21.8, "quant": 1.5, "attn": 20.0, "fused_norm": 6.2, "tiny": 0.01}),
        ),
        cb.Row("flux", "c", "fx_fp8 prepared, reduce-overhead", gt.Timing(90.0, 90.0, 1.0, 0.0, 0.0, [])),
        cb.Row("flux", "c", cb.FX_FP8_SENSITIVE_FP8, "skipped: time budget"),
    ]
    lines = cb.kernel_attribution_table(rows, top=3).splitlines()
    header = [c.strip() for c in lines[0].strip()[1:-1].split("|")]
    # no column for a variant without kernels (CUDA graphs hide them) or without a timing
    assert header == [
        "kernel",
        "BF16 Inductor ms",
        f"{cb.FX_FP8_PREPARED} ms",
        f"{cb.TORCHAO} ms",
        f"{cb.FX_FP8_PREPARED} - {cb.TORCHAO} ms",
    ]
    cells = _table_cells("\n".join(lines))
    # |difference| 4.7 (fx_fp8 only), 1.8, 1.5 first; then fused_norm 1.2, attn 1, tiny 0.01, gemm_bf16 0
    assert [c[0] for c in cells] == ["w8a16", "gemm_fp8", "quant", "all others (4 kernels)", "total"]
    w8a16, gemm, quant, others, total = (_numbers(c[1:]) for c in cells)
    assert w8a16 == [None, 4.7, None, 4.7]  # a kernel a variant lacks is blank, and 0 in the difference
    near = lambda v: pytest.approx(v, rel=2e-3)  # noqa: E731  the table prints 3 significant digits
    assert gemm == [None, 20.0, 21.8, near(-1.8)] and quant == [None, 3.0, 1.5, 1.5]
    assert others == [75.0, 26.0, near(26.21), near(-0.21)]
    assert total == [75.0, 53.7, near(49.51), near(4.19)]
    for column in range(4):  # the shown kernels and all others add up to each variant's kernel ms
        assert sum(r[column] or 0.0 for r in (w8a16, gemm, quant, others)) == pytest.approx(total[column], rel=1e-3)


def test_kernel_attribution_table_without_torchao_ranks_by_the_largest_time_and_lists_every_kernel():
    rows = [
        cb.Row("flux", "c", "BF16 Inductor", _kernel_timing({"gemm_bf16": 50.0, "attn": 20.0})),
        cb.Row("flux", "c", cb.FX_FP8_PREPARED, _kernel_timing({"gemm_fp8": 30.0, "attn": 21.0, "quant": 2.0})),
        cb.Row("flux", "c", cb.TORCHAO, "torchao not installed (ModuleNotFoundError)"),
    ]
    text = cb.kernel_attribution_table(rows)
    assert " - " not in text.splitlines()[0]  # no difference column
    cells = _table_cells(text)
    assert [c[0] for c in cells] == ["gemm_bf16", "gemm_fp8", "attn", "quant", "total"]  # no "all others"
    assert _numbers(cells[-1][1:]) == [70.0, 53.0]
    assert "no variant" in cb.kernel_attribution_table([cb.Row("flux", "c", "BF16 eager", "error: boom")])


def test_kernel_attribution_table_sums_numbered_inductor_kernels_of_one_pattern():
    """Inductor numbers its kernels per graph (..._0, ..._1): one fused pattern is one row across variants."""
    rows = [
        cb.Row(
            "flux",
            "c",
            cb.FX_FP8_PREPARED,
            _kernel_timing({"triton_red_fused_abs_amax_0": 2.0, "triton_red_fused_abs_amax_1": 1.0, "gemm_10": 5.0}),
        ),
        cb.Row("flux", "c", cb.TORCHAO, _kernel_timing({"triton_red_fused_abs_amax_3": 1.5, "gemm_10": 5.0})),
    ]
    cells = _table_cells(cb.kernel_attribution_table(rows))
    assert [c[0] for c in cells] == ["triton_red_fused_abs_amax", "gemm_10", "total"]  # only Triton names lose digits
    assert _numbers(cells[0][1:]) == [3.0, 1.5, 1.5]


def _spin(n):
    return sum(i * i for i in range(n))


def test_host_profile_names_the_functions_with_the_most_own_time():
    t = gt.Timer("cpu")
    host = t.host_profile(lambda: (_spin(20000), sorted(range(10))), calls=3)
    names = [name for name, _ in host]
    # the generator and sum() take nearly all the time (which of the two leads varies from run to run)
    genexpr = next(n for n in names[:2] if n != "built-in method builtins.sum")
    assert "built-in method builtins.sum" in names[:2], names
    assert genexpr.startswith("test_cuda_bench_dryrun.py:") and genexpr.endswith("(<genexpr>)"), names
    assert any(n.endswith("(_spin)") for n in names), names
    assert all(ms >= 0 for _, ms in host) and host == sorted(host, key=lambda h: -h[1])
    timing = gt.Timing(1.0, 1.0, 0.5, 0.5, 1.0, [], [("a.py:1(f)", 0.25), ("b.py:2(g)", 0.125)])
    assert timing.top_host(1) == "a.py:1(f) 0.250"
    rows = [
        cb.Row("linear", "c", cb.FX_FP8, timing),
        cb.Row("linear", "c", cb.BF16_INDUCTOR, timing),
        cb.Row("linear", "c", cb.FX_FP8_PREPARED, "error: boom"),
    ]
    cells = _table_cells(cb.host_table(rows))
    assert cells == [["c", cb.FX_FP8, "0.5", "1", "a.py:1(f) 0.250; b.py:2(g) 0.125"]]  # fx_fp8 rows with a profile
    assert "no fx_fp8 row" in cb.host_table(rows[1:])


def test_quantization_options_keep_attention_and_the_given_options():
    assert cb.with_quantization(None, {}) is None
    assert cb.with_quantization({"lowering": "reference"}, {"sensitive": "fp8"}) == {
        "lowering": "reference",
        "quantization_config": {"sensitive": "fp8"},
        "diffusion_kv_cache_dtype": "fp8",
    }
    given = {"diffusion_kv_cache_dtype": None, "quantization_config": {"method": "int8"}}
    assert cb.with_quantization(given, {"sensitive": "fp8"}) == {
        "diffusion_kv_cache_dtype": None,
        "quantization_config": {"method": "int8", "sensitive": "fp8"},
    }
    assert given["quantization_config"] == {"method": "int8"}  # the caller's options are not changed
    # on the GPU (no --fx-options) the sensitive-fp8 rows differ from the default in that setting only
    from fx_fp8.config.fp8_config import FP8Config

    default = FP8Config.load(None).to_dict()
    sens_fp8 = FP8Config.load(None, **cb.with_quantization(None, {"sensitive": "fp8"})).to_dict()
    default["quantization_config"].update(sensitive="fp8")
    assert sens_fp8 == default


def test_the_conditioning_linear_is_adaln_modulation_by_structure_alone():
    from fx_fp8.graph.sensitive import MODULATION
    from fx_fp8.quant.rules import sensitive_reason

    assert sensitive_reason("linear") is None  # no name pattern: only the graph's structure can find it
    for chunks in (6, 3):  # a double block's norm1.linear, a single block's norm.linear
        x, temb, lin, exact = cb.conditioning_case(32, 32 * chunks, 4, "cpu")
        assert cb.sensitive_by_structure(cb.Modulation(lin), (x, temb)) == {"linear": MODULATION}
        out, emb = cb.Modulation(lin)(x, temb)
        assert out.shape == x.shape and cb.rel(emb, exact) < 1e-2  # the error is measured on the linear's output


def test_append_section_adds_a_dated_section_with_versions(tmp_path):
    out = tmp_path / "RESULTS.md"
    out.write_text("# Benchmark results\n")
    env = [f"torch: {torch.__version__}", "Triton: 3.6.0", "GPU: NVIDIA H200 (sm90, 140 GiB)"]
    gt.append_section(
        str(out),
        "cuda_bench.py --quick",
        env,
        "python benchmarks/cuda_bench.py --quick",
        12.3,
        "### table\n",
        when=datetime.datetime(2026, 12, 4, 9, 5),
    )
    text = out.read_text()
    assert text.startswith("# Benchmark results\n\n## cuda_bench.py --quick — 2026-12-04 09:05\n")
    for line in (
        "- torch: " + torch.__version__,
        "- Triton: 3.6.0",
        "- GPU: NVIDIA H200",
        "- wall: 12 s",
        "- command: `python benchmarks/cuda_bench.py --quick`",
        "### table",
    ):
        assert line in text, line


# -- arguments --------------------------------------------------------------------------------------
def test_multi_kernel_rows_cover_every_flux_shape_whose_row_amax_inductor_loops():
    # Inductor loops a row reduction of more than 1024 values (should_use_persistent_reduction's INNER
    # threshold): every Flux linear shape has such rows, so every shape gets the multi-kernel row
    assert cb.MULTI_KERNEL_MIN_K == 1025
    assert all(k >= cb.MULTI_KERNEL_MIN_K for k, _ in cb.FLUX_LINEAR_SHAPES)
    # the dry run exercises the condition: some tiny shapes get the row, some do not
    assert {k >= cb.DRY_MULTI_KERNEL_MIN_K for k, _ in cb.TINY_LINEAR_SHAPES} == {True, False}
    assert list(cb.FLUX_VARIANTS)[-1] == "fx_fp8_mk" and cb.FLUX_VARIANTS["fx_fp8_mk"] == cb.FX_FP8_MULTI_KERNEL


def test_modes_and_budget_defaults():
    gpu = cb.parse_args([])
    assert (gpu.quick, gpu.flux, gpu.budget) == (True, False, 280.0)
    dry = cb.parse_args(["--dry-run"])
    assert (dry.quick, dry.flux, dry.budget) == (True, True, None)
    flux = cb.parse_args(["--flux", "--flux-depth", "2,1", "--flux-variants", "inductor, fx_fp8_ro"])
    assert (flux.quick, flux.flux, flux.flux_depth) == (False, True, (2, 1))
    assert flux.flux_variants == ("inductor", "fx_fp8_ro") and gpu.flux_variants == tuple(cb.FLUX_VARIANTS)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--flux-depth", "19"], "'19'"),
        (["--flux-depth", "0,3"], "'0,3'"),
        (["--budget", "-5"], "-5.0"),
        (["--flux-variants", "eager,bogus"], "['bogus']"),
    ],
)
def test_bad_arguments_are_refused_naming_the_value(argv, message, capsys):
    with pytest.raises(SystemExit):
        cb.parse_args(argv)
    assert message in capsys.readouterr().err


# -- the Flux model's weights -----------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d))


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(3))


def test_materialise_initialises_every_parameter_and_refuses_what_it_cannot():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 64), RMSNorm(64), nn.LayerNorm(64))
    model = cb.materialise(model.to(torch.bfloat16), "cpu", seed=0)
    lin, norm, ln = model
    assert lin.weight.device.type == "cpu" and lin.weight.dtype == torch.bfloat16
    assert 0 < lin.weight.float().abs().max() <= 1 / 32**0.5 + 1e-3  # nn.Linear's own initialisation
    assert torch.equal(norm.weight, torch.ones(64, dtype=torch.bfloat16))
    assert torch.equal(ln.weight, torch.ones(64, dtype=torch.bfloat16))
    first, second = (cb.materialise(nn.Linear(32, 64, device="meta"), "cpu", seed=1) for _ in range(2))
    assert torch.equal(first.weight, second.weight)  # seeded: every variant of a run gets the same weights
    with pytest.raises(ValueError, match=r"initialise \['1 \(Odd\)'\]"):
        cb.materialise(nn.Sequential(nn.Linear(2, 2, device="meta"), Odd().to("meta")), "cpu")
    with_buffer = nn.BatchNorm1d(4, device="meta")
    with pytest.raises(ValueError, match="buffers"):
        cb.materialise(with_buffer, "cpu")


def _table_cells(text):
    """The cells of every data row of the markdown tables in `text` (header and rule lines left out)."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    return [
        [c.strip() for c in line.strip()[1:-1].split("|")]
        for line in lines
        if not line.startswith(("| case |", "| variant |", "| kernel |"))
    ]


# -- the whole script on CPU ------------------------------------------------------------------------
def _dry_run(*extra, timeout=900):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, SCRIPT, "--dry-run", *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow  # ~30-70 s: some 40 torch.compile calls and five tiny Flux models
def test_dry_run_runs_every_row_of_both_modes(tmp_path):
    out = tmp_path / "results.md"
    out.write_text("# Benchmark results\n")
    proc = _dry_run("--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "error:" not in text and "skipped" not in text
    quick = text[text.index("### cuda_bench --quick") : text.index("#### CPU time per call of the fx_fp8 rows")]
    quick_host = text[text.index("#### CPU time per call of the fx_fp8 rows") : text.index("### cuda_bench --flux")]
    flux = text[text.index("### cuda_bench --flux") : text.index("#### CPU time per forward of the fx_fp8 variants")]
    flux_host = text[text.index("#### CPU time per forward of the fx_fp8 variants") :]
    # the host tables: a row per fx_fp8 row, its top functions with their own ms per call
    host_rows = _table_cells(quick_host)
    assert {cells[1] for cells in host_rows} == {
        cb.FX_FP8,
        cb.FX_FP8_PREPARED,
        cb.FX_FP8_MULTI_KERNEL,
        *cb.FX_FP8_CONDITIONING,
    }
    assert all(re.search(r"\S \d+\.\d{3}(;|$)", cells[-1]) for cells in host_rows), host_rows[:2]  # "function ms"
    assert {cells[1] for cells in _table_cells(flux_host)} == {
        cb.FX_FP8_PREPARED,
        cb.FX_FP8_SENSITIVE_FP8,
        "fx_fp8 prepared, reduce-overhead",
        cb.FX_FP8_MULTI_KERNEL,
    }
    for k, n in cb.TINY_LINEAR_SHAPES:
        for contender in (cb.BF16_EAGER, cb.BF16_INDUCTOR, cb.FX_FP8, cb.FX_FP8_PREPARED):
            assert f"| 64x{k}->{n} | {contender} |" in quick
        assert f"| 64x{k}->{n} | {cb.FX_FP8} |" in quick
    for k, n in cb.TINY_LINEAR_SHAPES:  # Inductor's multi-kernel reductions on the largest K, through Inductor
        row = next(
            (line for line in quick.splitlines() if line.startswith(f"| 64x{k}->{n} | {cb.FX_FP8_MULTI_KERNEL} |")),
            None,
        )
        assert (row is not None) == (k >= cb.DRY_MULTI_KERNEL_MIN_K), (k, row)
        assert row is None or "linear fp8 1/1 (reference/inductor)" in row, row
    linear_rows = [line for line in quick.splitlines() if line.startswith("| 64x")]
    assert sum("linear fp8 1/1 (reference/eager)" in line for line in linear_rows) == 2 * len(cb.TINY_LINEAR_SHAPES)
    assert quick.count("attention fp8 1/1 (reference/eager)") == 3
    # conditioning: fx_fp8 found the adaLN linear by structure and ran it as each contender asks, never native
    expected = {
        cb.FX_FP8_PREPARED: (
            "prepare_model: weight-only",
            "linear weight-only 1/1 (reference/eager)",
            "weight-only INT8 (block [1, 32] scales)",
        ),
        "fx_fp8 prepared, weight-only fp8": (
            "prepare_model: weight-only",
            "linear weight-only 1/1 (reference/eager)",
            "weight-only FP8 (block [1, 32] scales)",
        ),
        cb.FX_FP8_SENSITIVE_FP8: ("prepare_model: W8A8", "linear fp8 1/1 (reference/eager)", "FP8 W8A8"),
    }
    assert set(expected) == set(cb.FX_FP8_CONDITIONING)
    for k, n in cb.TINY_CONDITIONING_SHAPES:
        rows = {cells[1]: cells for cells in _table_cells(quick) if cells[0] == f"1x{k}->{n} (adaLN)"}
        assert set(rows) == {cb.BF16_INDUCTOR, cb.TORCHAO, *expected}, sorted(rows)
        for contender, parts in expected.items():
            note = rows[contender][-1]
            assert "sensitive by structure: adaLN modulation" in note and "NOT" not in note, note
            for part in parts:
                assert part in note, (contender, part, note)
            assert float(rows[contender][12]) < 0.1  # err of the linear's output: quantized, not garbage
        assert float(rows[cb.BF16_INDUCTOR][12]) < 0.01
    for s in (64, 128, 200):
        for contender in (cb.CUDNN_BF16, cb.FLASH_BF16, cb.FX_FP8):
            assert f"| B1 H2 S{s} D64 | {contender} |" in quick
    # the attribution names the quantized GEMM: on the CPU the reference's exact product sum (a matmul; on
    # CUDA it is aten::_scaled_mm, which the CPU reference no longer uses: torch 2.11 lacks its row-wise scales)
    fx_rows = [line for line in quick.splitlines() if f"| {cb.FX_FP8} |" in line and "->" in line]
    assert fx_rows  # not vacuous: all() of nothing is True
    assert fx_rows and all("aten::matmul" in line for line in fx_rows), fx_rows
    for variant in (
        "BF16 eager",
        "BF16 Inductor",
        "fx_fp8 prepared",
        cb.TORCHAO,
        cb.FX_FP8_SENSITIVE_FP8,
        "fx_fp8 prepared, reduce-overhead",
        cb.FX_FP8_MULTI_KERNEL,
    ):
        assert f"| {variant} |" in flux, variant
    assert flux.count("attention fp8 4/4 (reference/eager)") == 3  # every block's attention, counted once
    # multi-kernel reductions are Inductor's: that variant compiled every block through Inductor
    assert flux.count("attention fp8 4/4 (reference/inductor)") == 1
    variants = {cells[0]: cells for cells in _table_cells(flux[: flux.index("#### GPU kernel time")])}
    # the 2 + 2 block model: 6 sensitive linears in the blocks (norm1 / norm1_context / norm.linear), weight-only
    # by default and FP8 with sensitive "fp8", attention FP8 in both; the error is reported for both
    assert "(14 of them weight-only)" in variants[cb.FX_FP8_PREPARED][-1]
    assert "linear fp8 34/40 (reference/eager)" in variants[cb.FX_FP8_PREPARED][-1]
    assert "(0 of them weight-only)" in variants[cb.FX_FP8_SENSITIVE_FP8][-1]
    assert "linear fp8 40/40 (reference/eager)" in variants[cb.FX_FP8_SENSITIVE_FP8][-1]
    assert 0 < float(variants[cb.FX_FP8_SENSITIVE_FP8][12]) < 0.1
    # the second table: one column per variant that has kernels, its total row equal to the main table's kernel ms
    attribution = _table_cells(flux[flux.index("#### GPU kernel time") :])
    total = next(cells for cells in attribution if cells[0] == "total")
    measured = [v for v, cells in variants.items() if cells[10] != "-"]
    assert len(total) == 1 + len(measured) + (cb.TORCHAO in measured)  # the difference column needs torchao
    assert total[1 : 1 + len(measured)] == [variants[v][10] for v in measured]
    appended = out.read_text()
    assert appended.startswith("# Benchmark results\n") and "## cuda_bench.py --quick --flux — " in appended
    assert "- torch: " in appended and "- device: CPU dry run" in appended and "### cuda_bench --flux" in appended


@pytest.mark.slow  # a subprocess stopped part-way: ~10 s
def test_sigterm_prints_and_saves_what_was_measured(tmp_path):
    out = tmp_path / "results.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, "--dry-run", "--quick", "--out", str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    for line in proc.stdout:  # wait for the first measured row, then stop the run as `timeout` would
        lines.append(line)
        if line.startswith("[") and " | " in line:
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=120)
    text = "".join(lines) + rest
    assert proc.returncode == 124, text[-2000:]
    assert "### cuda_bench --quick" in text and "stopped by SIGTERM" in text
    assert f"| {cb.BF16_EAGER} |" in text
    assert "stopped by SIGTERM" in out.read_text()


@pytest.mark.slow  # a subprocess importing torch: ~3 s
def test_without_gpu_and_without_dry_run_it_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would run the real benchmark")
    proc = subprocess.run([sys.executable, SCRIPT, "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--dry-run" in proc.stderr


# -- --wan ----------------------------------------------------------------------------------------------
def test_wan_shapes_and_token_counts():
    # Wan2.1 at 480x832 and 720x1280, 81 frames: the 32760 and 75600 tokens, for both models
    for shape in cb.WAN_SHAPES.values():
        assert cb.wan_tokens(shape, *cb.WAN_RESOLUTIONS["480p"]) == 32760
        assert cb.wan_tokens(shape, *cb.WAN_RESOLUTIONS["720p"]) == 75600
    big, small = cb.WAN_SHAPES["14b"], cb.WAN_SHAPES["1.3b"]
    assert (big["num_layers"], big["num_attention_heads"] * big["attention_head_dim"], big["ffn_dim"]) == (
        40,
        5120,
        13824,
    )
    assert (small["num_layers"], small["num_attention_heads"] * small["attention_head_dim"], small["ffn_dim"]) == (
        30,
        1536,
        8960,
    )
    args = cb.parse_args(["--wan", "--wan-models", "1.3b", "--wan-depth", "4", "--wan-variants", "inductor,fx_fp8"])
    assert (args.quick, args.flux, args.wan, args.wan_models, args.wan_depth) == (False, False, True, ("1.3b",), 4)
    assert args.wan_variants == ("inductor", "fx_fp8") and args.wan_resolutions == ("480p",)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--wan-models", "14b,7b"], "['7b']"),
        (["--wan-depth", "0"], "0"),
        (["--wan-resolutions", "1080p"], "['1080p']"),
        (["--wan-variants", "bogus"], "['bogus']"),
    ],
)
def test_bad_wan_arguments_are_refused_naming_the_value(argv, message, capsys):
    with pytest.raises(SystemExit):
        cb.parse_args(["--wan", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.slow  # ~40-75 s: four tiny Wan models compiled block by block
def test_wan_dry_run_runs_every_variant():
    proc = _dry_run("--wan")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "error:" not in text and "### cuda_bench --quick" not in text and "### cuda_bench --flux" not in text
    wan = text[text.index("### cuda_bench --wan") :]
    assert "Wan tiny (2 blocks, width 64, 2 heads, FFN 128), 32x32 x 9 frames = 12 tokens" in wan
    variants = {cells[0]: cells for cells in _table_cells(wan[: wan.index("#### GPU kernel time")])}
    assert set(variants) == set(cb.WAN_VARIANTS.values()), sorted(variants)
    for name in ("BF16 eager", cb.BF16_INDUCTOR):
        assert "SDPA default dispatch: CPU SDPA (dry run)" in variants[name][-1]
    for name in (cb.FX_FP8_PREPARED, cb.FX_FP8_FORCED):  # every block's self- and cross-attention ran FP8
        assert "attention fp8 4/4 (reference/eager)" in variants[name][-1], variants[name]
        assert 0 < float(variants[name][12]) < 0.1  # err vs BF16 eager: quantized, not garbage
    assert "not in a dry run" in variants[cb.TORCHAO_ATTENTION][1] or "torchao" in variants[cb.TORCHAO_ATTENTION][1]
    assert "#### GPU kernel time per forward, by kernel" in wan


def test_fp8_attention_forced_variant_asks_for_the_triton_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(cb, "regional_compile", lambda model, **kw: calls.append(kw))
    bench = cb.Bench(cb.parse_args(["--dry-run", "--wan", "--wan-variants", "fx_fp8,fx_fp8_fp8_attention"]))
    variants = dict((name, compile_) for name, _, compile_, _ in cb.wan_variants(bench, "n/a"))
    variants[cb.FX_FP8_PREPARED](None)
    variants[cb.FX_FP8_FORCED](None)
    auto, forced = calls
    assert auto["backend"] == forced["backend"] == "fp8"
    assert "attention" not in auto.get("options", {})
    assert forced["options"]["attention"] == {"kernel": "triton"} and forced["options"]["lowering"] == "reference"
