"""The command-line flags shared by the examples and the `fx-fp8` CLI, and flags -> FP8Config.

Flag names follow vLLM-Omni (`--quantization fp8`, `--diffusion-kv-cache-dtype fp8`,
`--diffusion-kv-cache-skip-steps 0,1`, ...). Every FP8 flag defaults to "unset":
only the flags a user types override the `--config` YAML.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Optional

from fx_fp8.config.fp8_config import DOWNSTREAMS, LOWERINGS, FP8Config
from fx_fp8.install_hint import install_hint

#: argparse dest -> FP8Config key, for the flags that map one-to-one
FLAG_TO_KEY = {
    "quantization": "quantization",
    "ignored_layers": "ignored_layers",
    "diffusion_kv_cache_dtype": "diffusion_kv_cache_dtype",
    "diffusion_kv_cache_skip_steps": "diffusion_kv_cache_skip_steps",
    "diffusion_kv_cache_skip_layers": "diffusion_kv_cache_skip_layers",
    "quantization_skip_steps": "quantization_skip_steps",
    "quantization_skip_steps_mode": "quantization_skip_steps_mode",
    "lowering": "lowering",
    "downstream": "downstream",
}


def add_fp8_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--config, --quantization, --ignored-layers, --diffusion-kv-cache-*, --lowering, --downstream, --backend."""
    g = parser.add_argument_group("FP8 (vLLM-Omni names; unset flags leave the --config YAML as it is)")
    g.add_argument(
        "--config",
        metavar="YAML",
        default=None,
        help="FP8 config: a flat YAML or a vLLM-Omni stage config (stage_args[*].engine_args)",
    )
    g.add_argument(
        "--quantization",
        choices=["fp8", "int8", "none"],
        default=None,
        help="W8A8 linears (default when no FP8 flag and no --config is given: fp8 linears and fp8 attention)",
    )
    g.add_argument(
        "--ignored-layers",
        metavar="PATTERNS",
        default=None,
        help="comma-separated module-name patterns kept native (a comma inside {...}, [...] or (...) "
        "stays in its pattern: 're:blocks\\.[0-9]{1,2}\\..*' is one); the known-sensitive layers "
        "(embedders, adaLN modulation, final projection) are treated as --sensitive says "
        "(weight-only by default)",
    )
    g.add_argument(
        "--quantize-sensitive",
        action="store_true",
        default=None,
        help="also quantize the known-sensitive layers (everything eligible except --ignored-layers); "
        "the same as --sensitive fp8",
    )
    g.add_argument(
        "--sensitive",
        choices=["native", "weight_only", "fp8"],
        default=None,
        help="how the known-sensitive layers run: native, weight_only (W8A16, the default) or fp8",
    )
    g.add_argument(
        "--quantization-skip-steps",
        metavar="SEL",
        default=None,
        help="denoising steps whose linears do not run W8A8, e.g. '0,1,28,29' or 'first:2,last:2' "
        "(quantization_config.skip_steps)",
    )
    g.add_argument(
        "--quantization-skip-steps-mode",
        choices=["weight_only", "native"],
        default=None,
        help="what the linears run on those steps: weight_only (W8A16, default) or native",
    )
    g.add_argument(
        "--diffusion-kv-cache-dtype",
        choices=["fp8", "auto", "none"],
        default=None,
        help="fp8 = FP8 attention (Q/K/V quantized); auto/none = native attention",
    )
    g.add_argument(
        "--diffusion-kv-cache-skip-steps",
        metavar="SEL",
        default=None,
        help="denoising steps whose attention stays native, e.g. '0,1', '0-3,27' or 'first:2,last:2' "
        "(last:k counts from the run's end)",
    )
    g.add_argument(
        "--diffusion-kv-cache-skip-layers",
        metavar="SEL",
        default=None,
        help="transformer layers whose attention stays native, e.g. '0,1,57'",
    )
    g.add_argument(
        "--lowering",
        choices=list(LOWERINGS),
        default=None,
        help="FP8 kernels: auto (from the device), reference (CPU), cuda, npu",
    )
    g.add_argument("--downstream", choices=list(DOWNSTREAMS), default=None, help="compiler after the FP8 passes")
    g.add_argument("--backend", choices=["fp8", "fp8_npu"], default="fp8", help="torch.compile backend")
    return parser


#: the CLI's --dtype names (auto: bfloat16 on an accelerator, float32 on CPU)
CLI_DTYPES = ("float32", "bfloat16", "float16", "auto")


def add_device_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--device, --dtype: where the `fx-fp8` commands load the model and run it (CPU float32 by default)."""
    g = parser.add_argument_group("where it runs")
    g.add_argument(
        "--device",
        default="cpu",
        help="device the model is loaded on and run on: cpu (default), cuda, cuda:1, npu, auto (cuda, "
        "then npu, then cpu). FP8 numbers on CPU come from the reference lowering: they say "
        "nothing about GPU speed",
    )
    g.add_argument(
        "--dtype",
        choices=CLI_DTYPES,
        default="float32",
        help="dtype the model is loaded in (default float32; auto = bfloat16 on an accelerator, "
        "float32 on CPU); a GPU user wants --device cuda --dtype bfloat16",
    )
    return parser


def overrides_from_args(args: argparse.Namespace) -> dict:
    """The FP8Config keys of the flags the user set (None = unset)."""
    out = {}
    for dest, key in FLAG_TO_KEY.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if dest in ("quantization", "diffusion_kv_cache_dtype") and value == "none":
            value = None
        out[key] = value
    sensitive = getattr(args, "sensitive", None)
    if getattr(args, "quantize_sensitive", None):
        if sensitive not in (None, "fp8"):
            raise ValueError(f"--quantize-sensitive (= --sensitive fp8) disagrees with --sensitive {sensitive}")
        sensitive = "fp8"
    if sensitive is not None:
        out["quantization_config"] = {"sensitive": sensitive}
    return out


def config_from_args(args: argparse.Namespace) -> FP8Config:
    """--config (if any) with the set flags on top; no flags and no --config -> the default
    config (FP8 attention + FP8 linears). As in vLLM-Omni, without --config naming only one of
    --quantization / --diffusion-kv-cache-dtype turns only that feature on."""
    return FP8Config.load(getattr(args, "config", None), **overrides_from_args(args))


# -- context parallelism and cache acceleration (vLLM-Omni's flags; fx_fp8/pipeline/options.py) -----
def add_pipeline_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--ulysses-degree, --ring-degree, --cache-backend, --cache-config (unset: the --config YAML's
    parallel_config / cache_backend / cache_config, if any)."""
    g = parser.add_argument_group(
        "multiple devices and cache acceleration (vLLM-Omni names; with a degree > 1, launch with "
        "`torchrun --nproc-per-node ULYSSES*RING ...`)"
    )
    g.add_argument(
        "--ulysses-degree",
        type=_positive_int,
        default=None,
        metavar="N",
        help="Ulysses sequence parallelism over N processes (diffusers' ContextParallelConfig)",
    )
    g.add_argument(
        "--ring-degree",
        type=_positive_int,
        default=None,
        metavar="N",
        help="ring attention over N processes; each partial attention is FP8 with its log-sum-exp",
    )
    g.add_argument(
        "--cache-backend",
        default=None,
        metavar="NAME",
        help="first_block_cache, taylorseer or mag_cache (diffusers' cache hooks), cache_dit (the cache-dit "
        f"package: {install_hint('cache-dit')}); none to disable. tea_cache is not available",
    )
    g.add_argument(
        "--cache-config",
        default=None,
        metavar="JSON",
        help='the cache backend\'s settings as a JSON object, e.g. \'{"threshold": 0.1}\' '
        "(first_block_cache), '{\"cache_interval\": 3}' (taylorseer), "
        "'{\"mag_ratios\": \"flux\"}' (mag_cache), '{\"Fn_compute_blocks\": 1, \"residual_diff_threshold\": 0.24}' (cache_dit)",
    )
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid degree {text!r}: expected an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid degree {text!r}: expected an integer >= 1")
    return value


def pipeline_options_from_args(args: argparse.Namespace, *, num_inference_steps: Optional[int] = None):
    """fx_fp8.pipeline.options.PipelineOptions from --config and the pipeline flags (flags win). mag_cache's
    num_inference_steps defaults to the run's step count when the config does not give it."""
    from fx_fp8.pipeline.options import PipelineOptions, cache_config_mapping, canonical_cache_backend

    parallel = None
    if getattr(args, "ulysses_degree", None) is not None or getattr(args, "ring_degree", None) is not None:
        base = PipelineOptions.load(getattr(args, "config", None)).parallel
        parallel = {
            "ulysses_degree": args.ulysses_degree if args.ulysses_degree is not None else base.ulysses_degree,
            "ring_degree": args.ring_degree if args.ring_degree is not None else base.ring_degree,
        }
    backend = getattr(args, "cache_backend", None)
    cache_config = getattr(args, "cache_config", None)
    if cache_config is not None:
        try:
            cache_config = cache_config_mapping(cache_config)  # the JSON text, parsed where the YAML's is
        except ValueError as e:
            raise ValueError(f"invalid --cache-config: {e}") from None
    if backend is not None and canonical_cache_backend(backend) is None:
        backend, cache_config = "none", {}
    defaults = {"num_inference_steps": num_inference_steps} if num_inference_steps else None
    return PipelineOptions.load(
        getattr(args, "config", None),
        parallel_config=parallel,
        cache_backend=backend,
        cache_config=cache_config,
        cache_defaults=defaults,
    )


def describe_pipeline_options(opts) -> str:
    """One line: what the pipeline options turn on."""
    parts = []
    p = opts.parallel
    if p.enabled:
        parts.append(f"context parallel: ulysses {p.ulysses_degree} x ring {p.ring_degree} ({p.world_size} processes)")
    if opts.cache_backend:
        cfg = ", ".join(f"{k}: {v}" for k, v in opts.cache_config.items() if k != "mag_ratios")
        parts.append(f"cache: {opts.cache_backend}" + (f" ({cfg})" if cfg else ""))
    return "; ".join(parts) if parts else "no context parallelism, no cache"


def add_generation_flags(
    parser: argparse.ArgumentParser,
    *,
    default_model: Optional[str] = None,
    video: bool = False,
    default_size: int = 32,
    default_steps: Optional[int] = None,
    prompt_help: str = "the text prompt",
) -> argparse.ArgumentParser:
    """--model, --prompt, --height, --width, [--num-frames], --num-inference-steps, --seed, --device, --dtype, --output."""
    g = parser.add_argument_group("generation")
    g.add_argument(
        "--model",
        default=default_model,
        help="a local diffusers folder (model_index.json)" + (f"; default: {default_model}" if default_model else ""),
    )
    g.add_argument("--prompt", default=None, help=prompt_help)
    g.add_argument("--height", type=int, default=default_size)
    g.add_argument("--width", type=int, default=default_size)
    if video:
        g.add_argument("--num-frames", type=int, default=5, help="frames to generate")
    g.add_argument("--num-inference-steps", type=int, default=default_steps)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="auto", help="auto (cuda, then npu, then cpu), cpu, cuda, npu, ...")
    g.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="auto = bfloat16 on accelerators, float32 on CPU",
    )
    g.add_argument(
        "--output",
        default=None,
        help="where to write the result: a file name, or a folder (an existing one, or a name ending "
        "with '/') that gets the default file name",
    )
    return parser


# -- output paths: checked before the work starts, named in the message ----------------------------
def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not os.path.exists(path) and path.parent != path:
        path = path.parent
    return path


def check_output_dir(flag: str, path, *, named=None) -> None:
    """ValueError (one line naming the path) unless `path` is a folder we can write into or create.
    Creates nothing; `named` is the path the message names (a file, for the file's folder)."""
    named = str(path if named is None else named)
    base = _nearest_existing(Path(path).expanduser())
    if not base.is_dir():
        raise ValueError(f"cannot write {flag} {named!r}: {str(base)!r} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=base):  # a real probe: permissions, read-only file systems, root
            pass
    except OSError as e:
        raise ValueError(
            f"cannot write {flag} {named!r}: {str(base)!r} is not writable ({e.strerror or type(e).__name__})"
        ) from None


def check_output_file(flag: str, path, suffixes=None, kind: str = "file") -> None:
    """ValueError (one line naming the path) unless `path` names a file we can write, with one of
    `suffixes` (lower case, with the dot) when given; its folder may still have to be created."""
    p = Path(path).expanduser()
    if p.is_dir() or str(path).endswith(("/", os.sep)):
        raise ValueError(f"{flag} {str(path)!r} is a folder: expected a {kind} file name")
    if suffixes is not None and p.suffix.lower() not in suffixes:
        shown = ", ".join(s for s in (".png", ".jpg", ".pdf", ".svg", ".gif", ".webp") if s in suffixes)
        problem = f"unsupported {kind} type {p.suffix!r}" if p.suffix else "no file extension"
        raise ValueError(f"{flag} {str(path)!r}: {problem} (expected e.g. {shown})")
    if p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"cannot write {flag} {str(path)!r}: permission denied")
    check_output_dir(flag, p.parent, named=path)


def image_suffixes() -> set:
    """File extensions PIL can write."""
    from PIL import Image

    Image.init()
    return {ext.lower() for ext, fmt in Image.registered_extensions().items() if fmt in Image.SAVE}


def chart_suffixes() -> set:
    """File extensions matplotlib's savefig writes."""
    from matplotlib.backend_bases import FigureCanvasBase

    return {"." + ext for ext in FigureCanvasBase.get_supported_filetypes()}


def resolve_output(output: Optional[str], default_name: str, default_dir: str = "outputs") -> str:
    """--output as a file path: a folder (an existing one, or a name ending with a slash) gets
    `default_name` inside it; no --output -> default_dir/default_name."""
    if not output:
        return os.path.join(default_dir, default_name)
    expanded = os.path.expanduser(output)
    if output.endswith(("/", os.sep)) or (os.altsep and output.endswith(os.altsep)) or os.path.isdir(expanded):
        return os.path.join(expanded, default_name)
    return expanded


def resolve_device(name: str) -> str:
    """'auto' -> cuda if available, then npu, else cpu; any other name is checked (check_device)."""
    import torch

    if name != "auto":
        check_device(name)
        return name
    if torch.cuda.is_available():
        return "cuda"
    from fx_fp8.ops.lowering import npu_available

    return "npu" if npu_available() else "cpu"


def check_device(name: str) -> None:
    """ValueError naming --device when this torch cannot use that device (a CPU build asked for
    cuda, no NPU, a device index past the last one, a name torch does not know)."""
    import torch

    from fx_fp8.ops.lowering import npu_available

    if name.split(":")[0] == "npu":
        if not npu_available():
            raise ValueError(
                f"--device {name!r}: no Ascend NPU here (torch_npu not importable or no device); "
                "use --device cpu or auto"
            )
        return
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"invalid --device {name!r}: {str(e).strip().splitlines()[0]}") from None
    if device.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            raise ValueError(
                f"--device {name!r}: this torch ({torch.__version__}) was built without CUDA; use "
                "--device cpu, or install a CUDA build of torch"
            )
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {name!r}: no CUDA device is visible (torch.cuda.is_available() is False); use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {name!r}: MPS is not available in this torch / on this machine; use --device cpu")


def resolve_dtype(name: str, device: str):
    import torch

    if name == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    return getattr(torch, name)
