"""`fx-fp8 sensitivity`: per-block / per-step FP8 sensitivity, the search, and the recommended
YAML (the search itself: fx_fp8.tools.sensitivity)."""

from __future__ import annotations

import sys
from pathlib import Path

from fx_fp8.tools.cli_common import (
    UsageError,
    _check_dir,
    _check_file,
    _check_sizes,
    _check_source,
    _choose_config,
    _config,
    _placement,
    _source,
    to_json,
)

SENSITIVITY_HELP = """\
Measure how much FP8 in each block's attention, each block's linears and each
denoising step's attention changes the final latents, rank them, and search the
smallest set kept native that reaches --target-psnr.

Method: one item quantized at a time (everything else native), not one left out:
each measurement is then a clean error owned by one item, and independent
quantization errors add up, so the isolated errors predict any candidate config
(calibrated by one all-FP8 run). Greedy search: keep native the item with the
largest predicted error reduction per FP8 FLOP given up until the predicted PSNR
reaches the target, run that config, recalibrate and continue if it misses.
The recommended config is written as YAML (load it with --config or
fx_fp8.compile_pipeline) and re-measured through compile_pipeline. Exit status 1
if the re-measured PSNR misses the target. Progress goes to stderr.

--step-policy first measures step policies (the first and last k steps with
attention native and/or linears weight-only or native) and takes the one that
keeps the most FP8 FLOPs while meeting the target; the layer search starts from
it and the YAML carries its keys (diffusion_kv_cache_skip_steps,
quantization_config.skip_steps, skip_steps_mode).
"""


def cmd_sensitivity(args) -> int:
    from tabulate import tabulate

    from fx_fp8.tools import cli_flags
    from fx_fp8.tools.model_source import ModelSourceError
    from fx_fp8.tools.sensitivity import run_sensitivity
    from fx_fp8.tools.sensitivity_chart import save_chart

    source = _source(args)
    config_source = _choose_config(args, source)  # the same rule as compare, inspect and dump
    config = _config(args)
    _check_sizes(args)
    edges = _step_edges(args, config, config_source)  # before the model loads: bad flags fail fast
    placement = _placement(args)
    try:
        import matplotlib  # noqa: F401  (the chart)
    except ImportError:
        from fx_fp8.install_hint import install_hint

        raise UsageError(
            f"sensitivity draws its chart with matplotlib, which is not installed: {install_hint('cli')}"
        ) from None
    _check_source(source, pipeline=True, args=args)
    try:
        source.check_full_precision("sensitivity")  # it measures FP8 against the model's own precision
    except ModelSourceError as e:
        raise UsageError(str(e)) from None
    out = Path(args.out).expanduser()
    yaml_path = Path(args.yaml).expanduser() if args.yaml else out / "recommended.yaml"
    chart_path = Path(args.chart).expanduser() if args.chart else out / "sensitivity.png"
    _check_dir("--out", args.out)
    _check_file("--yaml" if args.yaml else "--out", args.yaml or yaml_path, kind="YAML")
    _check_file(
        "--chart" if args.chart else "--out", args.chart or chart_path, cli_flags.chart_suffixes(), kind="chart"
    )
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
    for p in (yaml_path, chart_path, out / "sensitivity.json"):
        p.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"sensitivity of {source.spec}: {len(run.labels)} sample(s) x {args.steps} steps at {args.height}x{args.width}, "
        f"target {args.target_psnr:g} dB (PSNR of the final latents vs native)",
        file=sys.stderr,
        flush=True,
    )
    print(f"ran on: {placement.describe()}; config: {config_source}")
    res = run_sensitivity(
        run,
        config,
        steps=args.steps,
        target_psnr=args.target_psnr,
        yaml_path=yaml_path,
        verify=not args.no_verify,
        step_policy=bool(edges),
        step_edges=edges or (1,),
    )
    save_chart(res, chart_path)
    (out / "sensitivity.json").write_text(to_json(res.to_dict()))

    total = res.all_fp8.mse or 1.0
    native = set(res.native_items)
    rows = [
        (i.label, f"{i.psnr:.2f}", f"{100 * i.mse / total:.1f}", "native" if i.label in native else "fp8")
        for i in res.ranking()
    ]
    print("ranking (one item in FP8 at a time; lower PSNR = more sensitive):")
    print(tabulate(rows, headers=["item", "PSNR alone (dB)", "MSE % of all-FP8", "recommended"]))
    if res.step_candidates:
        chosen = res.step_policy.label if res.step_policy is not None else None
        rows = [
            (c.label, f"{c.psnr:.2f}", f"{100 * c.fp8_work_fraction:.0f}", "chosen" if c.label == chosen else "")
            for c in res.step_candidates
        ]
        print("\nstep policies (first and last k steps in higher precision):")
        print(tabulate(rows, headers=["policy", "PSNR (dB)", "FP8 FLOPs kept %", ""]))
    cfg = res.recommended
    qc = cfg.quantization_config
    print(f"\nall FP8:            {res.all_fp8.psnr:.2f} dB")
    if edges:
        print(
            f"step policy:        {res.step_policy.label if res.step_policy is not None else 'none'} "
            f"(diffusion_kv_cache_skip_steps '{cfg.diffusion_kv_cache_skip_steps}', quantization_config.skip_steps "
            f"'{qc.skip_steps}', skip_steps_mode {qc.skip_steps_mode})"
        )
    print(
        f"recommended config: skip layers '{','.join(map(str, sorted(cfg.diffusion_kv_cache_skip_layers)))}', "
        f"skip steps '{','.join(map(str, sorted(cfg.diffusion_kv_cache_skip_steps)))}', ignored_layers "
        f"{list(cfg.quantization_config.ignored_layers) if cfg.quantization_config.ignored_layers is not None else 'defaults'}"
    )
    print(f"predicted PSNR:     {res.predicted_psnr:.2f} dB")
    print(
        f"re-measured PSNR:   {res.measured_psnr:.2f} dB ({'meets' if res.measured_psnr >= res.target_psnr else 'MISSES'} "
        f"the {res.target_psnr:g} dB target)"
    )
    print(
        f"FP8 kept:           {100 * res.fp8_work_fraction:.1f}% of the all-FP8 FLOPs "
        f"({len(res.native_items)} of {len(res.items)} items native)"
    )
    runs = len(res.items) + 2 + len(res.history) - 1 + sum(1 for c in res.step_candidates if c.seconds > 0)
    print(f"measurements:       {runs} runs in {res.seconds:.1f} s")
    print(f"wrote {yaml_path} (use: --config {yaml_path}), {chart_path}, {out / 'sensitivity.json'}")
    return 0 if res.measured_psnr >= res.target_psnr else 1


def _step_edges(args, config, config_source: str = "") -> tuple:
    """--step-policy K[,K...]: the k values (first and last k steps), checked against --steps and
    the base config (the search starts from no step policy)."""
    if args.step_policy is None:
        return ()
    try:
        edges = tuple(int(k) for k in args.step_policy.split(","))
    except ValueError:
        raise UsageError(f"invalid --step-policy {args.step_policy!r}: expected k values like '1,2'") from None
    from fx_fp8.tools.sensitivity_steps import check_step_edges

    try:
        check_step_edges(edges, args.steps)
    except ValueError as e:
        raise UsageError(f"invalid --step-policy {args.step_policy!r}: {e}") from None
    for key, sel in (
        ("--diffusion-kv-cache-skip-steps", config.diffusion_kv_cache_skip_steps),
        ("--quantization-skip-steps", config.quantization_config.skip_steps),
    ):
        if sel:
            where = (
                " (it comes from the model's own config: --library-default starts from the library's)"
                if "the model's own" in config_source
                else ""
            )
            raise UsageError(
                f"--step-policy searches the step policy itself: drop {key} {str(sel)!r} "
                f"(or the YAML key) from the base config{where}"
            )
    return edges
