"""Peak memory of quantizing while loading (fx_fp8.DiffusersConfig) against loading in bf16 and preparing.

Builds a Flux transformer of real width (hidden 3072, 24 heads x 128, Flux-dev's embedders; 1 double
+ 2 single blocks by default) with random weights, saves it with save_pretrained, and loads it four
ways onto --device, measuring the peak bytes of tensors on that device during each load and what the
model holds after it:
  1. from_pretrained (no quantization)
  2. from_pretrained, then fx_fp8.prepare_model
  3. from_pretrained(quantization_config=fx_fp8.DiffusersConfig()), device_map=--device
  4. from_pretrained of 3's save_pretrained folder (bytes compared with 3's)
and checks 3 against the bound "quantized model + one bf16 layer" (the largest linear, in bf16); on a GPU
the exit status is 1 when the bound is exceeded.

On CUDA the peak is torch.cuda.max_memory_allocated; the checkpoint stays in host memory (memory-mapped)
and only what the loader puts on the GPU counts. On the CPU the peak is counted by
fx_fp8.tools.memory_tracker.TensorMemoryTracker (storages torch ops allocate); memory-mapped file pages
are not counted, so the CPU run saves the checkpoint in float32 (--checkpoint-dtype) and loads it as
bf16: then every tensor the loader keeps is a counted copy.

    python benchmarks/load_time_memory.py                       # CPU, fp32 files loaded as bf16
    python benchmarks/load_time_memory.py --device cuda         # a GPU: bf16 files, loaded straight onto it
    python benchmarks/load_time_memory.py --device cuda --double 2 --single 4
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import time
import warnings

import torch
import torch.nn as nn

import fx_fp8
from fx_fp8.tools.memory_tracker import TensorMemoryTracker
from fx_fp8.quant.quantized_linear import QuantizedLinear

GIB = 2**30


def build_flux(double: int, single: int, dtype: torch.dtype) -> nn.Module:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the checkpoint's dtype: no second copy
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
                guidance_embeds=True,
                axes_dims_rope=(16, 56, 56),
            )
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


class Measure:
    """Peak and final bytes of tensors on `device` while a load runs."""

    def __init__(self, device: str):
        self.device = torch.device(device)

    def __call__(self, fn):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t
            return out, torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base, seconds
        with TensorMemoryTracker(self.device.type) as mem:
            t = time.perf_counter()
            out = fn()
            seconds = time.perf_counter() - t
        return out, mem.peak, mem.live, seconds


def same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        sa[k].dtype == sb[k].dtype
        and torch.equal(sa[k].reshape(-1).view(torch.uint8), sb[k].reshape(-1).view(torch.uint8))
        for k in sa
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the model is loaded")
    ap.add_argument("--double", type=int, default=1, help="double-stream blocks")
    ap.add_argument("--single", type=int, default=2, help="single-stream blocks")
    ap.add_argument(
        "--checkpoint-dtype",
        choices=["bfloat16", "float32"],
        default=None,
        help="dtype of the saved files (default: float32 on the CPU, bfloat16 on a GPU); loaded as bf16",
    )
    args = ap.parse_args(argv)
    from diffusers import FluxTransformer2DModel
    from tabulate import tabulate

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device here")
    file_dtype = getattr(torch, args.checkpoint_dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    root = tempfile.mkdtemp(prefix="fx_fp8_load_time_")
    try:
        t = time.perf_counter()
        model = build_flux(args.double, args.single, file_dtype)
        params = sum(p.numel() for p in model.parameters())
        largest = max(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)) * 2  # bf16 bytes
        model.save_pretrained(os.path.join(root, "full"))
        del model
        print(
            f"built and saved {params / 1e6:,.0f}M parameters ({file_dtype}) in {time.perf_counter() - t:.1f} s",
            flush=True,
        )
        measure = Measure(str(device))
        full = os.path.join(root, "full")

        def load(folder, **kw):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return FluxTransformer2DModel.from_pretrained(
                    folder, torch_dtype=torch.bfloat16, device_map=str(device), **kw
                )

        rows = []

        def row(label, peak, final, seconds, note=""):
            rows.append(
                [
                    label,
                    f"{peak / GIB:.3f}",
                    f"{final / GIB:.3f}",
                    f"{(peak - final) / GIB:.3f}",
                    f"{(peak - final) / largest:.2f}",
                    f"{seconds:.1f}",
                    note,
                ]
            )

        m, peak, final, s = measure(lambda: load(full))
        row("from_pretrained, bf16", peak, final, s)
        del m

        def load_and_prepare():
            m = load(full)
            fx_fp8.prepare_model(m)
            return m

        m, peak, final, s = measure(load_and_prepare)
        row("from_pretrained bf16, then prepare_model", peak, final, s)
        del m

        q, peak, quantized, s = measure(lambda: load(full, quantization_config=fx_fp8.DiffusersConfig()))
        bound = quantized + largest
        layers = sum(isinstance(m, QuantizedLinear) for m in q.modules())
        over = (peak - bound) / largest
        row(
            "from_pretrained(quantization_config=fx_fp8.DiffusersConfig())",
            peak,
            quantized,
            s,
            f"{layers} layers quantized; quantized + one bf16 layer = {bound / GIB:.3f} GiB: "
            + ("within" if over <= 0 else f"over by {over:.2f} bf16 layers"),
        )
        within = over <= 0
        q.save_pretrained(os.path.join(root, "quantized"))
        again, peak, final, s = measure(lambda: load(os.path.join(root, "quantized")))
        row(
            "from_pretrained of its save_pretrained folder",
            peak,
            final,
            s,
            ("same bytes as loaded" if same_state(again, q) else "BYTES DIFFER")
            + ("; CPU: its tensors are views of the memory-mapped file (not counted)" if device.type == "cpu" else ""),
        )
        print(
            f"\nFlux width 3072, {args.double} double + {args.single} single blocks, {params / 1e6:,.0f}M parameters, "
            f"files {str(file_dtype).replace('torch.', '')}, loaded as bf16 onto {device}; largest linear "
            f"{largest / 2**20:.1f} MiB in bf16 (torch {torch.__version__})"
        )
        print(
            tabulate(
                rows,
                headers=[
                    "load",
                    "peak GiB",
                    "model after GiB",
                    "peak - model GiB",
                    "peak - model, in largest bf16 layers",
                    "s",
                    "",
                ],
            )
        )
        if device.type == "cpu" and file_dtype != torch.bfloat16:
            print(
                "CPU, float32 files: the loader converts each weight to bf16 before fx_fp8 sees it; that copy is "
                "the one bf16 layer, and quantizing it in slices adds the rest of 'peak - model'"
            )
        return 0 if within or device.type == "cpu" else 1  # the bound is the device's
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
