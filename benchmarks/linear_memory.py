"""Weight memory of FP8 linears at realistic width: bytes before / after prepare_model + compile.

Builds a Flux transformer of real width (hidden 3072, 24 heads x 128; 2 double +
2 single blocks by default) with random bf16 weights on CPU, measures every
tensor reachable from the model (fx_fp8.reachable_tensor_bytes) before and
after `fx_fp8.prepare_model` + `torch.compile(backend="fp8")` + one call,
prints a table per layer kind, and appends a dated section to
benchmarks/RESULTS.md.

    python benchmarks/linear_memory.py [--double 2] [--single 2] [--quantization int8] [--no-results]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import time
import warnings
from collections import defaultdict
from typing import Optional

import torch
import torch.nn as nn

import fx_fp8
from fx_fp8.tools.model_zoo.registry import output_tensor
from fx_fp8.quant.quantized_linear import QuantizedLinear

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
HEADER = "# Benchmark results\n\nDated sections appended by the scripts in benchmarks/; newest last.\n"


def flux_size_arguments(ap: argparse.ArgumentParser, *, blocks: int, repeat: Optional[tuple[int, str]] = None):
    """--double / --single (the Flux model's depth), optionally --repeat, and --no-results: the
    arguments the Flux benchmarks share."""
    ap.add_argument("--double", type=int, default=blocks, help="double-stream blocks")
    ap.add_argument("--single", type=int, default=blocks, help="single-stream blocks")
    if repeat is not None:
        ap.add_argument("--repeat", type=int, default=repeat[0], help=repeat[1])
    ap.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS.md")


def timed(fn):
    """fn's result and its wall seconds, after a garbage collection."""
    gc.collect()
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def append_section(script: str, title: str, table: str) -> None:
    """Append a dated section (script, machine, torch and diffusers versions, title, table) to RESULTS.md."""
    import diffusers

    new = not os.path.exists(RESULTS)
    with open(RESULTS, "a") as f:
        if new:
            f.write(HEADER)
        f.write(f"\n## {datetime.date.today().isoformat()} {script}\n\n")
        f.write(
            f"Machine: {platform.machine()} ({os.cpu_count()} CPUs), {platform.system()}; torch "
            f"{torch.__version__}; diffusers {diffusers.__version__}.\n\n{title}.\n\n"
        )
        f.write(table + "\n")
    print(f"appended to {RESULTS}")


def build_flux(double: int, single: int) -> nn.Module:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build directly in bf16: no fp32 copy of ~1B parameters
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = FluxTransformer2DModel(
                patch_size=1,
                in_channels=64,
                num_layers=double,
                num_single_layers=single,
                attention_head_dim=128,
                num_attention_heads=24,
                joint_attention_dim=4096,
                pooled_projection_dim=768,
                axes_dims_rope=(16, 56, 56),
            )
    finally:
        torch.set_default_dtype(previous)
    return model.to(torch.bfloat16).eval()


def inputs(batch: int = 1, img: int = 64, txt: int = 16) -> dict:
    g = torch.Generator().manual_seed(0)
    side = int(img**0.5)
    ids = torch.stack(
        torch.meshgrid(torch.zeros(1), torch.arange(float(side)), torch.arange(float(side)), indexing="ij"), -1
    )
    return dict(
        hidden_states=torch.randn(batch, img, 64, generator=g).bfloat16(),
        encoder_hidden_states=torch.randn(batch, txt, 4096, generator=g).bfloat16(),
        pooled_projections=torch.randn(batch, 768, generator=g).bfloat16(),
        timestep=torch.full((batch,), 0.5, dtype=torch.bfloat16),
        img_ids=ids.reshape(-1, 3),
        txt_ids=torch.zeros(txt, 3),
    )


def kind_of(name: str) -> str:
    """A layer kind for the table, from the module name."""
    leaf = name.split(".")
    if any(p in ("time_text_embed", "x_embedder", "context_embedder") for p in leaf):
        return "embedders"
    if name.startswith("norm_out") or name == "proj_out":
        return "final layer"
    if ".norm" in name and leaf[-1] == "linear":
        return "adaLN modulation"
    if leaf[-1] in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
        return "attention q/k/v"
    if "to_out" in leaf or leaf[-1] == "to_add_out":
        return "attention out"
    if "ff" in leaf or "ff_context" in leaf or leaf[-1] in ("proj_mlp", "proj_out"):
        return "MLP"
    return "other"


def linear_bytes(module: nn.Module) -> int:
    if isinstance(module, QuantizedLinear):
        return (
            module.weight.numel() * module.weight.element_size()
            + module.weight_scale.numel() * module.weight_scale.element_size()
        )
    return module.weight.numel() * module.weight.element_size()


def per_kind(model: nn.Module) -> dict:
    out = defaultdict(lambda: [0, 0])  # kind -> [count, bytes]
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, QuantizedLinear)):
            k = kind_of(name)
            out[k][0] += 1
            out[k][1] += linear_bytes(m)
    return out


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def report_sensitive(args) -> str:
    from fx_fp8.config.quantization import QuantizationConfig

    return args.sensitive or f"{QuantizationConfig().sensitive} (default)"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    flux_size_arguments(ap, blocks=2)
    ap.add_argument("--quantization", choices=["fp8", "int8"], default="fp8", help="W8A8 method (default fp8)")
    ap.add_argument(
        "--sensitive",
        choices=["native", "weight_only", "fp8"],
        default=None,
        help="quantization_config.sensitive (default: the config's default)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))

    t0 = time.time()
    model = build_flux(args.double, args.single)
    kw = inputs()
    before_kinds = per_kind(model)
    total_before = fx_fp8.reachable_tensor_bytes(model)
    method = args.quantization
    qc = {"sensitive": args.sensitive} if args.sensitive else {}
    result = fx_fp8.prepare_model(
        model, {"quantization": method, "diffusion_kv_cache_dtype": "fp8", "quantization_config": qc}
    )
    t_prep = time.time()
    options = {"quantization": method, "diffusion_kv_cache_dtype": "fp8", "quantization_config": qc}
    compiled = torch.compile(model, backend="fp8", options=options)
    with torch.no_grad():
        out = output_tensor(compiled(**kw))
    assert torch.isfinite(out.float()).all(), "non-finite output"
    t_run = time.time()
    after_kinds = per_kind(model)
    total_after = fx_fp8.reachable_tensor_bytes(compiled)
    (report,) = fx_fp8.get_reports()[-1:]

    quantized_kinds = defaultdict(int)
    for name in result["quantized"]:
        quantized_kinds[kind_of(name)] += 1
    rows = []
    for kind in sorted(before_kinds, key=lambda k: -before_kinds[k][1]):
        n, b = before_kinds[kind]
        a = after_kinds[kind][1]
        rows.append((kind, f"{quantized_kinds[kind]}/{n}", mib(b), mib(a), f"{a / b:.3f}"))
    rows.append(
        (
            "quantized linears",
            f"{len(result['quantized'])}",
            mib(result["bytes_before"]),
            mib(result["bytes_after"]),
            f"{result['bytes_after'] / result['bytes_before']:.3f}",
        )
    )
    rows.append(
        (
            "whole model (reachable tensors)",
            "",
            mib(total_before),
            mib(total_after),
            f"{total_after / total_before:.3f}",
        )
    )
    headers = ["layer kind", f"{method.upper()} / linears", "MiB before", "MiB after", "ratio"]

    from tabulate import tabulate

    params = sum(p.numel() for p in model.parameters())
    title = (
        f"Flux width 3072, {args.double} double + {args.single} single blocks, bf16, {params / 1e6:,.0f}M parameters "
        f"after prepare_model; prepare {t_prep - t0:.1f} s (incl. build), compile + 1 call {t_run - t_prep:.1f} s"
    )
    if method != "fp8":
        title = f"{method.upper()} W8A8 (quantization: {method}): " + title
    title = f"sensitive: {report_sensitive(args)}; " + title
    print(title)
    print(tabulate(rows, headers=headers))
    print(f"report: {report.summary()}, original copy kept: {report.weights.get('original_copy_kept')}")

    if not args.no_results:
        new = not os.path.exists(RESULTS)
        with open(RESULTS, "a") as f:
            if new:
                f.write(HEADER)
            f.write(
                f"\n## {datetime.date.today().isoformat()} linear_memory.py"
                + (f" --quantization {method}" if method != "fp8" else "")
                + "\n\n"
            )
            cpu = " ".join(x for x in (platform.machine(), platform.processor()) if x)
            import diffusers

            f.write(
                f"Machine: {cpu} ({os.cpu_count()} CPUs), "
                f"{platform.system()}; torch {torch.__version__}; diffusers {diffusers.__version__}; "
                f"lowering {report.lowering}.\n\n"
            )
            f.write(title + ".\n\n")
            f.write(tabulate(rows, headers=headers, tablefmt="github") + "\n")
        print(f"appended to {RESULTS}")


if __name__ == "__main__":
    main()
