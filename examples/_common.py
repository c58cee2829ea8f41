"""What text_to_image.py and text_to_video.py share: timing, the native-vs-FP8 table, the run summary."""
from __future__ import annotations

import os
import time

import torch

import fx_fp8
from fx_fp8.pipelines import pipeline_state


def quiet_diffusers() -> None:
    """Only errors from diffusers/transformers loading (no progress bars, no accelerate hints)."""
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    diffusers_logging.disable_progress_bar()
    try:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
    except ImportError:
        pass


def output_path(output, default_name: str) -> str:
    """--output as a file path, checked before any model loads: a file name, or a folder (an existing
    one, or a name ending with a slash) that gets `default_name` inside; none -> outputs/<default_name>.
    A path that cannot be written, or whose extension PIL cannot write, exits naming the path."""
    from fx_fp8.tools.cli_flags import check_output_file, image_suffixes, resolve_output

    path = resolve_output(output, default_name)
    if not os.path.splitext(path)[1]:
        raise SystemExit(f"--output {output!r} has no file extension: expected an image file name (e.g. "
                         f"{os.path.splitext(default_name)[1]}) or a folder (an existing one, or a name ending with '/')")
    try:
        check_output_file("--output", path, image_suffixes(), kind="image")
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return path


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elif device.startswith("npu"):
        torch.npu.synchronize()  # type: ignore[attr-defined]


def timed(fn, device: str):
    """(result, seconds) of fn(), with the device drained before and after."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - t0


def describe_config(cfg) -> str:
    attn = "fp8" if cfg.attention_enabled else "native"
    if cfg.attention_enabled and cfg.diffusion_kv_cache_skip_steps:
        attn += f" (native at steps {sorted(cfg.diffusion_kv_cache_skip_steps)})"
    if cfg.attention_enabled and cfg.diffusion_kv_cache_skip_layers:
        attn += f" (native in layers {sorted(cfg.diffusion_kv_cache_skip_layers)})"
    lin = cfg.quantization or "native"
    return f"attention {attn}, linears {lin}, lowering {cfg.lowering}, downstream {cfg.downstream}"


def print_fp8_summary(pipe) -> None:
    """What the backend did (per compiled graph) and which variant each denoising step ran."""
    for r in fx_fp8.get_reports():
        s = r.summary()
        variant = f" [{r.step_variant} variant]" if r.step_variant else ""
        print(f"  graph {r.graph_id}{variant}: attention {s['attention']['fp8']} fp8 / {s['attention']['native']} native, "
              f"linears {s['linear']['fp8']} fp8 / {s['linear']['native']} native "
              f"(lowering {r.lowering}, downstream {r.downstream})")
    per_step = pipeline_state(pipe).step_variants()
    if per_step and any(v is not None for vs in per_step for v in vs):
        shown = ", ".join(f"{i}:{'/'.join(vs)}" for i, vs in enumerate(per_step))
        print(f"  step variants (step:variant per transformer call): {shown}")


def print_table(rows) -> None:
    """rows: dicts with run, first, steady, psnr, ssim (None where not applicable)."""
    from tabulate import tabulate

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    table = [[r["run"], fmt(r["first"], ".2f"), fmt(r.get("steady"), ".2f"), fmt(r.get("psnr"), ".2f"),
              fmt(r.get("ssim"), ".4f")] for r in rows]
    print(tabulate(table, headers=["run", "first call (s)", "steady call (s)", "PSNR vs native (dB)", "SSIM vs native"]))


def run_native_and_fp8(pipe, run, cfg, *, backend: str, device: str, compare: bool, metrics):
    """Time `run()` natively (when comparing), compile the pipeline with fx_fp8, time it again.

    Returns (native_output or None, fp8_output, table rows); `metrics(native, fp8)` gives the
    quality columns of the FP8 row.
    """
    rows, native = [], None
    if compare:
        native, first = timed(run, device)
        _, steady = timed(run, device)
        rows.append(dict(run="native", first=first, steady=steady))
    fx_fp8.clear_reports()
    fx_fp8.compile_pipeline(pipe, cfg, backend=backend)
    out, first = timed(run, device)  # includes compilation
    row = dict(run=f"fp8 ({backend})", first=first)
    if compare:
        out, row["steady"] = timed(run, device)
        row.update(metrics(native, out))
    rows.append(row)
    return native, out, rows
