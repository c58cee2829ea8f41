"""benchmarks/cuda_bench.py: the GPU benchmark's parts checked on CPU (kernel attribution, tables,
result sections, arguments, model materialisation), and --dry-run running every row at tiny shapes."""
from __future__ import annotations

import datetime
import importlib.util
import os
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
    assert kernels == [("device_kernel", pytest.approx(0.3), pytest.approx(0.75)),
                       (quant, pytest.approx(0.1), pytest.approx(0.25))]
    with pytest.raises(ValueError, match="calls must be >= 1, got 0"):
        gt.attribute([], 0)


def test_short_kernel_names_drop_templates_parameters_and_namespaces():
    assert gt.short_kernel_name("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>(float*)") \
        == "cunn_SoftMaxForward"
    assert gt.short_kernel_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD"
    assert gt.short_kernel_name("aten::_scaled_mm") == "aten::_scaled_mm"
    assert gt.short_kernel_name("x" * 60) == "x" * 47 + "~"


def _event(name, device, us, parent=None):
    return SimpleNamespace(name=name, device_type=device, cpu_parent=parent,
                           time_range=SimpleNamespace(elapsed_us=lambda: us))


def test_kernel_durations_take_gpu_kernels_on_cuda_and_outermost_aten_ops_on_cpu():
    linear = _event("aten::linear", DeviceType.CPU, 50.0)
    region = _event("Torch-Compiled Region", DeviceType.CPU, 80.0)
    events = [region, linear, _event("aten::addmm", DeviceType.CPU, 40.0, parent=linear),
              _event("aten::amax", DeviceType.CPU, 5.0, parent=region),
              _event("nvjet_tst_128x256", DeviceType.CUDA, 30.0), _event("Memset (Device)", DeviceType.CUDA, 1.0)]
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
    rows = [cb.Row("linear", case, cb.BF16_INDUCTOR, _timing(0.12), flop=8.7e10),
            cb.Row("linear", case, cb.TORCHAO, _timing(0.30)),
            cb.Row("linear", case, cb.FX_FP8, _timing(0.06, [("gemm", 0.75), ("quant", 0.25)]), note="linear fp8 1/1"),
            cb.Row("linear", case, cb.FX_FP8_PREPARED, "error: RuntimeError: boom"),
            cb.Row("attention", "S4608", cb.CUDNN_BF16, _timing(0.4)),
            cb.Row("attention", "S4608", cb.FX_FP8, _timing(0.2))]
    lines = cb.quick_table(rows).splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    inductor, torchao, fx, failed, cudnn, fx_attn = cells
    assert inductor[3] == "1" and inductor[4] == "-" and inductor[5] == "725"  # 8.7e10 flop / 0.12 ms
    assert fx[3] == "2" and fx[4] == "5" and fx[9] == "0.818"  # x BF16, x torchao, GPU busy = 0.9 / 1.1
    assert fx[13] == "gemm 75%; quant 25%" and fx[14] == "linear fp8 1/1"
    assert failed[2] == "error: RuntimeError: boom"
    assert fx_attn[3] == "2" and fx_attn[4] == "-"  # attention: cuDNN BF16 is the base; no torchao peer


def test_flux_table_reports_first_call_memory_and_ratios():
    rows = [cb.Row("flux", "c", "BF16 Inductor", _timing(134.0), first_s=40.0, extra={"peak GiB": 30.5}),
            cb.Row("flux", "c", cb.TORCHAO, _timing(100.0)),
            cb.Row("flux", "c", "fx_fp8 prepared", _timing(67.0), first_s=50.0, err=0.01,
                   extra={"peak GiB": 18.0, "graphs": "3 / 3 (+0 cached)"}),
            cb.Row("flux", "c", "fx_fp8 prepared, reduce-overhead", "skipped: time budget")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in cb.flux_table(rows).splitlines()[2:]]
    assert cells[2][:8] == ["fx_fp8 prepared", "67", "2", "1.49", "50", "-", "3 / 3 (+0 cached)", "18"]
    assert cells[3][1] == "skipped: time budget"


def test_append_section_adds_a_dated_section_with_versions(tmp_path):
    out = tmp_path / "RESULTS.md"
    out.write_text("# Benchmark results\n")
    env = [f"torch: {torch.__version__}", "Triton: 3.6.0", "GPU: NVIDIA H200 (sm90, 140 GiB)"]
    gt.append_section(str(out), "cuda_bench.py --quick", env, "python benchmarks/cuda_bench.py --quick", 12.3,
                      "### table\n", when=datetime.datetime(2026, 12, 4, 9, 5))
    text = out.read_text()
    assert text.startswith("# Benchmark results\n\n## cuda_bench.py --quick — 2026-12-04 09:05\n")
    for line in ("- torch: " + torch.__version__, "- Triton: 3.6.0", "- GPU: NVIDIA H200", "- wall: 12 s",
                 "- command: `python benchmarks/cuda_bench.py --quick`", "### table"):
        assert line in text, line


# -- arguments --------------------------------------------------------------------------------------
def test_modes_and_budget_defaults():
    gpu = cb.parse_args([])
    assert (gpu.quick, gpu.flux, gpu.budget) == (True, False, 280.0)
    dry = cb.parse_args(["--dry-run"])
    assert (dry.quick, dry.flux, dry.budget) == (True, True, None)
    flux = cb.parse_args(["--flux", "--flux-depth", "2,1", "--flux-variants", "inductor, fx_fp8_ro"])
    assert (flux.quick, flux.flux, flux.flux_depth) == (False, True, (2, 1))
    assert flux.flux_variants == ("inductor", "fx_fp8_ro") and gpu.flux_variants == tuple(cb.FLUX_VARIANTS)


@pytest.mark.parametrize("argv, message", [(["--flux-depth", "19"], "'19'"), (["--flux-depth", "0,3"], "'0,3'"),
                                           (["--budget", "-5"], "-5.0"),
                                           (["--flux-variants", "eager,bogus"], "['bogus']")])
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
    assert 0 < lin.weight.float().abs().max() <= 1 / 32 ** 0.5 + 1e-3  # nn.Linear's own initialisation
    assert torch.equal(norm.weight, torch.ones(64, dtype=torch.bfloat16))
    assert torch.equal(ln.weight, torch.ones(64, dtype=torch.bfloat16))
    first, second = (cb.materialise(nn.Linear(32, 64, device="meta"), "cpu", seed=1) for _ in range(2))
    assert torch.equal(first.weight, second.weight)  # seeded: every variant of a run gets the same weights
    with pytest.raises(ValueError, match=r"initialise \['1 \(Odd\)'\]"):
        cb.materialise(nn.Sequential(nn.Linear(2, 2, device="meta"), Odd().to("meta")), "cpu")
    with_buffer = nn.BatchNorm1d(4, device="meta")
    with pytest.raises(ValueError, match="buffers"):
        cb.materialise(with_buffer, "cpu")


# -- the whole script on CPU ------------------------------------------------------------------------
def _dry_run(*extra, timeout=900):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, SCRIPT, "--dry-run", *extra], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow  # ~30-70 s: some 40 torch.compile calls and five tiny Flux models
def test_dry_run_runs_every_row_of_both_modes(tmp_path):
    out = tmp_path / "results.md"
    out.write_text("# Benchmark results\n")
    proc = _dry_run("--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "error:" not in text and "skipped" not in text
    quick = text[text.index("### cuda_bench --quick"):text.index("### cuda_bench --flux")]
    flux = text[text.index("### cuda_bench --flux"):]
    for k, n in cb.TINY_LINEAR_SHAPES:
        for contender in (cb.BF16_EAGER, cb.BF16_INDUCTOR, cb.FX_FP8, cb.FX_FP8_PREPARED):
            assert f"| 64x{k}->{n} | {contender} |" in quick
        assert f"| 64x{k}->{n} | {cb.FX_FP8} |" in quick
    assert quick.count("linear fp8 1/1 (reference/eager)") == 2 * len(cb.TINY_LINEAR_SHAPES)
    assert quick.count("attention fp8 1/1 (reference/eager)") == 3
    for s in (64, 128, 200):
        for contender in (cb.CUDNN_BF16, cb.FLASH_BF16, cb.FX_FP8):
            assert f"| B1 H2 S{s} D64 | {contender} |" in quick
    # the attribution names the quantized GEMM: on the CPU the reference's exact product sum (a matmul; on
    # CUDA it is aten::_scaled_mm, which the CPU reference no longer uses: torch 2.11 lacks its row-wise scales)
    fx_rows = [line for line in quick.splitlines() if f"| {cb.FX_FP8} |" in line and "->" in line]
    assert fx_rows and all("aten::matmul" in line for line in fx_rows), fx_rows
    for variant in ("BF16 eager", "BF16 Inductor", "fx_fp8 prepared", cb.TORCHAO, "fx_fp8 prepared, reduce-overhead"):
        assert f"| {variant} |" in flux, variant
    assert flux.count("attention fp8 4/4 (reference/eager)") == 2  # every block's attention, counted once
    appended = out.read_text()
    assert appended.startswith("# Benchmark results\n") and "## cuda_bench.py --quick --flux — " in appended
    assert "- torch: " in appended and "- device: CPU dry run" in appended and "### cuda_bench --flux" in appended


@pytest.mark.slow  # a subprocess stopped part-way: ~10 s
def test_sigterm_prints_and_saves_what_was_measured(tmp_path):
    out = tmp_path / "results.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, SCRIPT, "--dry-run", "--quick", "--out", str(out)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
