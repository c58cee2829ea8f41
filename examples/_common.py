"""What text_to_image.py and text_to_video.py share: timing, the native-vs-FP8 table, the run summary."""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import time

import torch

import fx_fp8
from fx_fp8 import pipeline_state
from fx_fp8.tools.cli_common import UsageError
from fx_fp8.tools.cli_flags import (
    add_fp8_flags,
    add_pipeline_flags,
    config_from_args,
    describe_pipeline_options,
    pipeline_options_from_args,
)

# a model folder's own fx_fp8 config (the shipped tiny model has one: its step policy); fx-fp8 compare uses it too
from fx_fp8.tools.model_source import MODEL_CONFIG_NAME


# -- errors: as fx-fp8 reports them (one line on stderr, exit status 2), found before any model loads --
def cli_main(prog: str):
    """Decorator for an example's main(argv): bad input (UsageError, raised by the checks below and by
    the parser) prints one line, '<prog>: error: ...', on stderr and returns exit status 2."""

    def wrap(main):
        @functools.wraps(main)
        def wrapped(argv=None) -> int:
            try:
                return main(argv)
            except UsageError as e:
                print(f"{prog}: error: {e}", file=sys.stderr)
                return 2

        return wrapped

    return wrap


def one_line_errors(parser):
    """The parser's errors become one UsageError line instead of argparse's usage block."""

    def error(message):
        raise UsageError(f"{message} (see '{parser.prog} --help')")

    parser.error = error
    return parser


def check_device(name: str) -> str:
    """--device resolved ('auto') and checked against this torch: a CPU build asked for cuda fails here."""
    from fx_fp8.tools.cli_flags import resolve_device

    try:
        return resolve_device(name)
    except ValueError as e:
        raise UsageError(str(e)) from None


def check_model(model: str, height: int, width: int, *, frames: int | None = None):
    """The model folder checked as fx-fp8 checks it (a pipeline folder with its transformer's weights;
    --height / --width the pipeline can make): the model source (fx_fp8.tools.model_source)."""
    from fx_fp8.tools.model_source import ModelSourceError, resolve_model

    if not os.path.exists(os.path.expanduser(model)):
        raise UsageError(f"--model {model!r}: no such folder (expected a local diffusers pipeline folder)")
    if not os.path.isfile(os.path.join(os.path.expanduser(model), "model_index.json")):
        raise UsageError(f"--model {model!r} is not a diffusers pipeline folder (no model_index.json)")
    try:
        source = resolve_model(model)
        source.check_pipeline()
        source.check_transformer(example_inputs=False)  # its weight files
        source.check_component_weights()  # the other models' (text encoders, VAE)
        source.check_size(height, width)
    except ModelSourceError as e:
        raise UsageError(str(e)) from None
    return source


def check_family_size(family: str, height: int, width: int) -> None:
    """--height / --width for one of the tiny random family pipelines (model_source.FAMILY_SIZE_RULES)."""
    from fx_fp8.tools.model_source import ModelSourceError, resolve_model

    try:
        resolve_model(family).check_size(height, width)
    except ModelSourceError as e:
        raise UsageError(str(e)) from None


def check_positive(flag: str, value) -> None:
    if value is not None and value < 1:
        raise UsageError(f"invalid {flag} {value}: expected a positive integer")


def load_or_fail(what: str, load):
    """load(), or one line naming `what` when diffusers cannot load it (a missing weight file, ...)."""
    try:
        return load()
    except Exception as e:  # noqa: BLE001 - one line saying which folder failed, not a traceback
        text = str(e).strip()
        raise UsageError(f"cannot load {what}: {text.splitlines()[0] if text else type(e).__name__}") from None


def tiny_vocabulary() -> tuple[list, int]:
    """The shipped tiny model's prompt words and the most words a prompt may have (its prompt encoder's config)."""
    from fx_fp8.tools.tiny_model import TINY_MODEL_DIR

    with open(os.path.join(TINY_MODEL_DIR, "prompt_encoder", "config.json")) as f:
        config = json.load(f)
    return list(config["vocab"]), int(config["max_length"])


def check_tiny_prompt(prompt: str) -> None:
    """A prompt the shipped tiny model's encoder can read: its words only, at most max_length of them."""
    vocab, most = tiny_vocabulary()
    words = prompt.lower().split()
    unknown = [w for w in words if w not in vocab]
    if unknown:
        raise UsageError(
            f"--prompt {prompt!r}: the tiny model does not know {', '.join(map(repr, unknown))}; its "
            f"{len(vocab)} words: {' '.join(vocab)} (e.g. 'a red circle on a blue background')"
        )
    if not words or len(words) > most:
        raise UsageError(f"--prompt {prompt!r}: the tiny model takes 1 to {most} words, got {len(words)}")


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


def model_config(args):
    """The --model folder's fx_fp8.yaml, used as --config when none is given (None without one,
    or with --library-default: the library's default config)."""
    model = getattr(args, "model", None)
    if getattr(args, "config", None) is not None or getattr(args, "library_default", False) or not model:
        return None
    path = os.path.join(model, MODEL_CONFIG_NAME)
    return path if os.path.isfile(path) else None


def configs_from_args(args):
    """(FP8Config, pipeline options) from the flags and --config (or the model's own fx_fp8.yaml),
    checked before any model loads: bad flags or YAML exit with their one-line message."""
    if getattr(args, "library_default", False) and args.config is not None:
        raise UsageError(
            f"--library-default and --config {args.config!r} both say which config to start from: give one of them"
        )
    own = model_config(args)
    if own is not None:
        args.config = own
        if os.environ.get("RANK", "0") == "0":  # torchrun's other ranks print nothing (not yet joined here)
            print(f"config: {own} (the model's own; --library-default for the library's default config)")
    try:
        cfg = config_from_args(args)
        # context parallelism / cache: checked now (mag_cache's step count is settled once the pipeline is known)
        return cfg, pipeline_options_from_args(args, num_inference_steps=args.num_inference_steps or 1)
    except ValueError as e:
        raise UsageError(str(e)) from None


def output_path(output, default_name: str) -> str:
    """--output as a file path, checked before any model loads: a file name, or a folder (an existing
    one, or a name ending with a slash) that gets `default_name` inside; none -> outputs/<default_name>.
    A path that cannot be written, or whose extension PIL cannot write, exits naming the path."""
    from fx_fp8.tools.cli_flags import check_output_file, image_suffixes, resolve_output

    path = resolve_output(output, default_name)
    if not os.path.splitext(path)[1]:
        raise UsageError(
            f"--output {output!r} has no file extension: expected an image file name (e.g. "
            f"{os.path.splitext(default_name)[1]}) or a folder (an existing one, or a name ending with '/')"
        )
    try:
        check_output_file("--output", path, image_suffixes(), kind="image")
    except ValueError as e:
        raise UsageError(str(e)) from None
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
        attn += f" (native at steps {cfg.diffusion_kv_cache_skip_steps})"
    if cfg.attention_enabled and cfg.diffusion_kv_cache_skip_layers:
        attn += f" (native in layers {sorted(cfg.diffusion_kv_cache_skip_layers)})"
    lin = cfg.quantization or "native"
    if cfg.linear_step_skips:
        lin += f" ({cfg.quantization_config.skip_steps_mode} at steps {cfg.quantization_config.skip_steps})"
    return f"attention {attn}, linears {lin}, lowering {cfg.lowering}, downstream {cfg.downstream}"


def print_fp8_summary(pipe) -> None:
    """What the backend did (per compiled graph) and which variant each denoising step ran."""
    for r in fx_fp8.get_reports():
        s = r.summary()
        variant = f" [{r.step_variant} variant]" if r.step_variant else ""
        print(
            f"  graph {r.graph_id}{variant}: attention {s['attention']['fp8']} fp8 / {s['attention']['native']} native, "
            f"linears {s['linear']['fp8']} fp8 / {s['linear']['native']} native "
            f"(lowering {r.lowering}, downstream {r.downstream})"
        )
    state = pipeline_state(pipe)
    per_step = state.step_variants()
    if per_step and any(v is not None for vs in per_step for v in vs):
        shown = ", ".join(f"{i}:{'/'.join(vs)}" for i, vs in enumerate(per_step))
        print(f"  step variants (step:variant per transformer call): {shown}")
        print(f"  {resolved_step_policy(state.config, state.scheduler_steps)}")


def resolved_step_policy(cfg, steps: int) -> str:
    """The step selectors as given and the steps they picked in a run of `steps` steps."""
    parts = []
    for key, sel, on in (
        ("diffusion_kv_cache_skip_steps", cfg.diffusion_kv_cache_skip_steps, cfg.attention_step_skips),
        ("quantization_config.skip_steps", cfg.quantization_config.skip_steps, cfg.linear_step_skips),
    ):
        if on:
            picked = sel.resolve(steps) if steps else sel
            parts.append(f"{key} '{sel}' -> steps {picked or 'none'}" if steps else f"{key} '{sel}'")
    return f"step policy ({steps} steps): " + "; ".join(parts)


def print_table(rows) -> None:
    """rows: dicts with run, first, steady, psnr, ssim (None where not applicable)."""
    from tabulate import tabulate

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    table = [
        [
            r["run"],
            fmt(r["first"], ".2f"),
            fmt(r.get("steady"), ".2f"),
            fmt(r.get("psnr"), ".2f"),
            fmt(r.get("ssim"), ".4f"),
        ]
        for r in rows
    ]
    print(
        tabulate(table, headers=["run", "first call (s)", "steady call (s)", "PSNR vs native (dB)", "SSIM vs native"])
    )


def apply_pipeline_options(pipe, options, applied: dict | None = None) -> str:
    """Context parallelism and the cache backend on the pipeline's transformers, before the native
    run, so that --compare measures FP8 against the same cache / parallel setup (cache-only
    native); compile_pipeline then compiles them as they are. `applied` collects what was
    applied per transformer. Returns the rows' label suffix."""
    if options is None or not options.enabled:
        return ""
    from fx_fp8.pipeline.apply_options import apply_pipeline_options as apply

    for attr in ("transformer", "transformer_2"):
        module = getattr(pipe, attr, None)
        if isinstance(module, torch.nn.Module):
            try:
                extras = apply(module, options)
            except (ValueError, RuntimeError) as e:  # one line, naming the value diffusers / fx_fp8 refused
                raise UsageError(str(e)) from None
            if applied is not None:
                applied[attr] = (module, extras)
    parts = []
    if options.parallel.enabled:
        parts.append(f"ulysses {options.parallel.ulysses_degree} x ring {options.parallel.ring_degree}")
    if options.cache_backend:
        parts.append(options.cache_backend)
    return " + " + " + ".join(parts)


def setup_distributed(options, device: str) -> str:
    """Under torchrun (a degree > 1): join the job, keep only rank 0's output on stdout, and give
    each rank its own accelerator (cuda:LOCAL_RANK). Returns the device to use."""
    if options is None or not options.parallel.enabled:
        return device
    import sys

    from fx_fp8.pipeline.launch import init_distributed, is_main_process

    try:
        init_distributed(options.parallel)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not is_main_process():
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    if device in ("cuda", "npu", "xpu"):
        device = f"{device}:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def settle_pipeline_options(args, pipe, call: dict, options):
    """The pipeline options once the step count is known (mag_cache needs it): --num-inference-steps,
    else the pipeline's own default."""
    if (
        options is None
        or options.cache_backend not in ("mag_cache", "cache_dit")
        or args.num_inference_steps is not None
    ):
        return options
    steps = call.get("num_inference_steps")
    if steps is None:
        steps = inspect.signature(type(pipe).__call__).parameters.get("num_inference_steps")
        steps = steps.default if steps is not None and isinstance(steps.default, int) else None
    try:
        return pipeline_options_from_args(args, num_inference_steps=steps)
    except ValueError as e:
        raise UsageError(str(e)) from None


def options_kwargs(options) -> dict:
    """run_native_and_fp8's `options` argument, only when there is something to apply."""
    return {"options": options} if options is not None and options.enabled else {}


def is_main_process() -> bool:
    from fx_fp8.pipeline.launch import is_main_process as main

    return main()


def run_native_and_fp8(pipe, run, cfg, *, backend: str, device: str, compare: bool, metrics, options=None):
    """Time `run()` natively (when comparing), compile the pipeline with fx_fp8, time it again.

    `options` (fx_fp8.pipeline.options.PipelineOptions): context parallelism and a cache backend, applied
    to both runs. Returns (native_output or None, fp8_output, table rows); `metrics(native, fp8)`
    gives the quality columns of the FP8 row.
    """
    from fx_fp8.tools.quantized_folders import prepared_transformers

    rows, native, applied = [], None, {}
    suffix = apply_pipeline_options(pipe, options, applied)
    # a transformer loaded quantized is compiled as it is; its reference run uses the stored quantized linears
    stored = prepared_transformers(pipe)
    if stored:
        print(
            f"note: {', '.join(stored)} already quantized (loaded from a quantized folder): compiled as it is"
            + ("; the reference run uses its stored quantized linears with native attention" if compare else "")
        )
    if compare:
        native, first = timed(run, device)
        _, steady = timed(run, device)
        rows.append(dict(run=("stored quantized" if stored else "native") + suffix, first=first, steady=steady))
    fx_fp8.clear_reports()
    cache = {}
    if options is not None:
        from fx_fp8.pipeline.apply_options import hand_over_cache

        cache = hand_over_cache(list(applied.values()), options)
    fx_fp8.compile_pipeline(pipe, cfg, backend=backend, prepare=not stored, **cache)
    out, first = timed(run, device)  # includes compilation
    row = dict(run=f"fp8 ({backend})" + suffix, first=first)
    if compare:
        out, row["steady"] = timed(run, device)
        row.update(metrics(native, out))
    rows.append(row)
    return native, out, rows


def compare_and_report(args, pipe, call: dict, run, cfg, options, *, device: str, metrics):
    """What both examples do once the pipeline is loaded: settle the pipeline options for this
    call, run natively (with --compare) and with FP8, print the backend's summary and the table.
    Returns (native_output or None, fp8_output)."""
    options = settle_pipeline_options(args, pipe, call, options)
    if options.enabled:
        print(f"pipeline: {describe_pipeline_options(options)}")
    native, out, rows = run_native_and_fp8(
        pipe,
        run,
        cfg,
        backend=args.backend,
        device=device,
        compare=args.compare,
        metrics=metrics,
        **options_kwargs(options),
    )
    print("fp8 backend:")
    print_fp8_summary(pipe)
    print()
    print_table(rows)
    return native, out


def add_run_flags(parser):
    """The flags both examples take after their generation flags: guidance, --compare, FP8, pipeline."""
    parser.add_argument(
        "--guidance-scale", type=float, default=None, help="the pipeline's guidance scale (default: its own)"
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also run the native pipeline with the same seed; print latency, PSNR, SSIM; save a side-by-side PNG",
    )
    add_fp8_flags(parser)
    parser.add_argument(
        "--library-default",
        action="store_true",
        help=f"start from the library's default config, not the model folder's own {MODEL_CONFIG_NAME} "
        "(the shipped tiny model has one: attention native on the first and last 2 steps)",
    )
    add_pipeline_flags(parser)
    return parser
