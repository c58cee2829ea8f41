"""`fx-fp8 compare`: native vs FP8 on the same prompts and seeds: latency, PSNR, SSIM, max abs
error, optionally under context parallelism or a cache backend (see fx_fp8/tools/cli.py)."""

from __future__ import annotations

import time
from pathlib import Path

from fx_fp8.tools.cli_common import (
    UsageError,
    _check_file,
    _check_sizes,
    _check_source,
    _choose_config,
    _config,
    _one_line,
    _placement,
    _source,
    to_json,
)


def _latent_psnr(ref, x) -> float:
    from fx_fp8.tools.image_metrics import psnr_db

    return psnr_db(float(((x - ref) ** 2).mean()), float(ref.max() - ref.min()) or 1.0)


def cmd_compare(args) -> int:
    import torch

    from fx_fp8 import compile_pipeline
    from fx_fp8.tools import cli_flags, image_metrics

    source = _source(args)
    config_source = _choose_config(args, source)
    config = _config(args)
    _check_sizes(args)
    placement = _placement(args)
    _check_source(source, pipeline=True, args=args)
    options = _pipeline_options(args)  # --ulysses-degree / --ring-degree / --cache-backend / --cache-config
    if args.out:
        _check_file("--out", args.out, cli_flags.image_suffixes(), kind="image")
    from fx_fp8.tools.model_source import ModelSourceError

    try:
        run = source.load_pipeline(
            prompts=args.prompts,
            height=args.height,
            width=args.width,
            seed=args.seed,
            dtype=placement.dtype,
            device=placement.device,
        )
    except ModelSourceError as e:
        raise UsageError(str(e)) from None
    applied = _apply_pipeline_options(
        run, options
    )  # on both runs: FP8 is compared with the same cache / parallel setup
    torch._dynamo.reset()
    try:
        run.run(args.steps, output_type="np")  # warm-up (lazy init), untimed; the pipeline checks its inputs
    except ValueError as e:
        raise UsageError(
            f"the native {source.spec} pipeline refused --height {args.height} --width {args.width} "
            f"--steps {args.steps}: {_one_line(e)}"
        ) from None
    t0 = time.perf_counter()
    ref_lat, ref_img = run.run(args.steps, output_type="np")
    t_native = time.perf_counter() - t0
    from fx_fp8.pipeline.apply_options import hand_over_cache
    from fx_fp8.tools.quantized_folders import prepared_transformers

    # a transformer loaded quantized has no full-precision weights: it is compiled as it is, and the
    # reference run above used its stored quantized linears (with native attention)
    stored = prepared_transformers(run.pipe)
    compile_pipeline(run.pipe, config, backend=args.backend, prepare=not stored, **hand_over_cache(applied, options))
    t0 = time.perf_counter()
    run.run(args.steps, output_type="np", publish=False)  # compiles
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    lat, img = run.run(args.steps, output_type="np", publish=False)
    t_fp8 = time.perf_counter() - t0
    ref_img, img = _as_images(ref_img), _as_images(img)
    result = {
        "model": source.spec,
        "steps": args.steps,
        "samples": len(run.labels),
        "size": [args.height, args.width],
        "latency_native_s": t_native,
        "latency_fp8_s": t_fp8,
        "first_fp8_call_s": t_first,
        "psnr_db": _mean([image_metrics.psnr(a, b) for a, b in zip(ref_img, img)]),
        "ssim": _mean([image_metrics.ssim(a, b) for a, b in zip(ref_img, img)]),
        "latents_max_abs_error": float((lat - ref_lat).abs().max()),
        "latents_psnr_db": _latent_psnr(ref_lat, lat),
        "device": placement.device,
        "dtype": placement.dtype_name,
        "config": config.to_dict(),
        "config_source": config_source,
        "prompts": list(run.labels),
        "pipeline_options": options.to_dict(),
        "reference": (
            f"the quantized weights as stored in {', '.join(stored)} (eager, native attention)"
            if stored
            else "native (the model's own precision)"
        ),
    }
    from fx_fp8.pipeline.launch import is_main_process

    if not is_main_process():  # under torchrun every rank computed the same result: rank 0 reports it
        return 0
    if args.out:
        Path(args.out).expanduser().parent.mkdir(parents=True, exist_ok=True)
        _save_side_by_side(Path(args.out).expanduser(), ref_img, img)
        result["image"] = str(args.out)
    if args.format == "json":
        print(to_json(result))
    else:
        from tabulate import tabulate

        rows = [
            (f"latency {'reference' if stored else 'native'} (s)", f"{t_native:.3f}"),
            ("latency FP8 (s)", f"{t_fp8:.3f}"),
            ("first FP8 run incl. compile (s)", f"{t_first:.3f}"),
            ("PSNR images (dB)", f"{result['psnr_db']:.2f}"),
            ("SSIM images", f"{result['ssim']:.4f}"),
            ("max abs error, final latents", f"{result['latents_max_abs_error']:.4g}"),
            ("PSNR final latents (dB)", f"{result['latents_psnr_db']:.2f}"),
        ]
        print(
            f"model: {source.spec}, {len(run.labels)} sample(s), {args.steps} steps, {args.height}x{args.width}, "
            f"seed {args.seed}"
        )
        print(f"ran on: {placement.describe()}; config: {config_source}")
        print(f"samples: {'; '.join(run.labels)}")
        if options.enabled:
            print(f"pipeline (both runs): {cli_flags.describe_pipeline_options(options)}")
        if stored:
            print(f"reference run: {result['reference']}, not full precision (the checkpoint holds no other)")
        print(tabulate(rows, headers=["metric", "value"]))
        if args.out:
            print(f"side by side (native | FP8 | |difference| x4): {args.out}")
    return 0


def _pipeline_options(args):
    """--ulysses-degree / --ring-degree / --cache-backend / --cache-config (and the YAML's keys);
    with a degree > 1, joins the torchrun job (an error naming the torchrun command otherwise)."""
    from fx_fp8.pipeline.launch import init_distributed
    from fx_fp8.tools import cli_flags

    try:
        options = cli_flags.pipeline_options_from_args(args, num_inference_steps=args.steps)
        if options.parallel.enabled:
            init_distributed(options.parallel)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return options


def _apply_pipeline_options(run, options) -> list:
    """[(transformer, what was applied)]."""
    from fx_fp8.pipeline.apply_options import apply_pipeline_options

    if not options.enabled:
        return []
    try:
        return [(module, apply_pipeline_options(module, options)) for _, module in run.transformers()]
    except (ValueError, RuntimeError) as e:
        raise UsageError(_one_line(e)) from None


def _mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values)


def _save_side_by_side(path, ref, fp8) -> None:
    """One row per sample: native | FP8 | |difference| x4."""
    from PIL import Image

    from fx_fp8.tools import image_metrics

    rows = [
        image_metrics.side_by_side([a, b, ((a - b).abs() * 4).clamp(0, 1)], ["native", "FP8", "|diff| x4"])
        for a, b in zip(ref, fp8)
    ]
    sheet = Image.new("RGB", (max(r.width for r in rows), sum(r.height for r in rows)), "white")
    y = 0
    for r in rows:
        sheet.paste(r, (0, y))
        y += r.height
    sheet.save(path)


def _as_images(x):
    """[B, H, W, 3] float images in [0, 1]; video frames [B, F, H, W, 3] become B*F images."""
    if x.dim() == 5:
        x = x.reshape(-1, *x.shape[-3:])
    if x.shape[-1] not in (1, 3) and x.shape[1] in (1, 3):  # [B, C, H, W]
        x = x.permute(0, 2, 3, 1)
    return x.float().clamp(0, 1)
