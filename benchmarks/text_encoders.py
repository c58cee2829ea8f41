"""Text encoders with FP8 / INT8 linears: weight bytes before / after prepare_model and the
prompt-embedding error against the native encoder (CPU reference lowering).

Builds random T5 (T5EncoderModel: Flux's / SD3's / Wan's text encoder), CLIP
(CLIPTextModelWithProjection) and Qwen2.5-VL (Qwen-Image's, with a one-block vision tower) encoders from
configs (fx_fp8.tools.model_zoo.text_encoders), in --dtype, runs native, then prepare_model with the
default rules (CLIP's text_projection weight-only, T5's `wo` native: transformers' _keep_in_fp32_modules,
Qwen2.5-VL's lm_head and vision tower weight-only: the text-encoder rules) and runs again. "weights" is every tensor
reachable from the model (fx_fp8.reachable_tensor_bytes); "linears" the quantized ones only.
Random weights: the error says the quantization runs as it should, not how a trained T5-XXL
degrades. Prints the table; --append adds it to benchmarks/RESULTS.md.

    OMP_NUM_THREADS=1 python benchmarks/text_encoders.py [--width 512] [--layers 4] [--dtype bfloat16] [--append]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import warnings

import torch

import fx_fp8
from fx_fp8.tools.model_zoo.text_encoders import prompt_embeddings, tiny_clip, tiny_qwen25_vl, tiny_t5, token_ids

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
HEADERS = (
    "encoder",
    "method",
    "linears quantized (weight-only)",
    "native: why",
    "linears MiB before -> after",
    "weights MiB before -> after",
    "ratio",
    "embedding",
    "rel. error",
)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _short(reason: str) -> str:
    """A native reason's subject: "T5EncoderModel._keep_in_fp32_modules", "output head lm_head", ..."""
    subject = reason.split(":")[0].split(" names")[0].split(" (")[0]
    return subject.split("'s ", 1)[1] if "'s " in subject else subject


def measure(name: str, build, method: str, dtype: torch.dtype, tokens: int) -> list:
    model = build().to(dtype)
    ids = token_ids(tokens=tokens)
    ref = prompt_embeddings(model, ids)
    before = fx_fp8.reachable_tensor_bytes(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fx_fp8.prepare_model(model, quantization=method)
    after = fx_fp8.reachable_tensor_bytes(model)
    out = prompt_embeddings(model, ids)
    reasons = sorted({_short(r) for r in result["native"].values()})
    rows = []
    for key in ref:
        a, b = out[key].float(), ref[key].float()
        rows.append(
            (
                name,
                method,
                f"{len(result['quantized'])} ({len(result['weight_only'])})",
                f"{len(result['native'])}: {', '.join(reasons)}" if result["native"] else "0",
                f"{_mib(result['bytes_before'])} -> {_mib(result['bytes_after'])}",
                f"{_mib(before)} -> {_mib(after)}",
                f"{after / before:.3f}",
                key,
                f"{((a - b).norm() / b.norm()).item():.4f}",
            )
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512, help="d_model / hidden size (multiple of 16)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    from tabulate import tabulate

    dtype = getattr(torch, args.dtype)
    encoders = {
        "T5EncoderModel": (lambda: tiny_t5(d_model=args.width, layers=args.layers), 128),
        "CLIPTextModelWithProjection": (lambda: tiny_clip(hidden=args.width, layers=args.layers, positions=77), 77),
        "Qwen2_5_VLForConditionalGeneration": (lambda: tiny_qwen25_vl(hidden=args.width, layers=args.layers), 128),
    }
    rows = []
    for name, (build, tokens) in encoders.items():
        for method in ("fp8", "int8"):
            rows += measure(name, build, method, dtype, tokens)
    table = tabulate(rows, headers=HEADERS, tablefmt="github")
    import transformers

    head = (
        f"width {args.width}, {args.layers} layers, {args.dtype}, random weights, vocabulary 128; T5 and Qwen2.5-VL 128 tokens, "
        f"CLIP 77; default rules (sensitive: weight_only). Machine: {platform.machine()} ({os.cpu_count()} CPUs), "
        f"{platform.system()}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}"
    )
    print(head + "\n\n" + table)
    if args.append:
        command = "python benchmarks/text_encoders.py " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(RESULTS, "a") as f:
            f.write(
                f"\n## Text encoders with FP8 / INT8 linears — {datetime.date.today().isoformat()}\n\n"
                f"`OMP_NUM_THREADS=1 {command.strip()}`: {head}.\n\n{table}\n"
            )
        print(f"appended to {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
