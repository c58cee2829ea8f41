"""Quantized checkpoints on disk: fx_fp8.save_quantized vs diffusers' bf16 save_pretrained.

Builds the Flux transformer of benchmarks/linear_memory.py (hidden 3072, 24 heads x 128,
random bf16 weights; 1 double + 1 single block by default), saves it with save_pretrained
(bf16), then prepares it (default config: the sensitive embedders, adaLN modulation and final
layer weight-only, INT8 with 32-column scales; as a second row, sensitive: native (bf16); as a
third, quantize_sensitive=True) and saves it with
save_quantized. Measured side by side in one run: bytes on disk of each folder (every file in
it), and load time of load_quantized vs from_pretrained(torch_dtype=bf16) of the bf16 folder
(best of --repeat, alternating, page cache warm; from_pretrained maps the file lazily, so its
time is also given with every tensor read once, as load_quantized does). The ratio for the real model (19 double +
38 single blocks) is extrapolated from the per-block bytes of the saved tensors.

    python benchmarks/checkpoint_size.py [--double 1] [--single 1] [--repeat 2] [--no-results]
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import sys
import tempfile
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from linear_memory import append_section, build_flux, flux_size_arguments, inputs, timed  # noqa: E402  (one Flux builder)

import fx_fp8  # noqa: E402
from fx_fp8.quant.checkpoint import WEIGHTS_NAME  # noqa: E402
from fx_fp8.tools.model_zoo.registry import output_tensor

FULL_FLUX = (19, 38)  # FLUX.1 double / single blocks


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def tensor_bytes_by_part(path: str) -> dict:
    """{"double" | "single" | "rest": bytes per block (or in all)} of a safetensors file's tensors."""
    from safetensors import safe_open

    parts, blocks = {"double": 0, "single": 0, "rest": 0}, {"double": set(), "single": set()}
    with safe_open(path, "pt") as f:
        for key in f.keys():
            sl = f.get_slice(key)
            n = 1
            for d in sl.get_shape():
                n *= d
            size = n * {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "I8": 1}[sl.get_dtype()]
            m = re.match(r"(single_)?transformer_blocks\.(\d+)\.", key)
            kind = "rest" if m is None else ("single" if m.group(1) else "double")
            parts[kind] += size
            if m:
                blocks[kind].add(m.group(2))
    return {k: v / max(1, len(blocks[k])) if k in blocks else v for k, v in parts.items()}


def extrapolate(parts: dict) -> float:
    return parts["rest"] + FULL_FLUX[0] * parts["double"] + FULL_FLUX[1] * parts["single"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    flux_size_arguments(ap, blocks=1, repeat=(2, "loads of each folder (best time kept)"))
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    from diffusers import FluxTransformer2DModel

    root = tempfile.mkdtemp(prefix="fx_fp8_ckpt_")
    try:
        bf16_dir = os.path.join(root, "bf16")
        build = lambda: build_flux(args.double, args.single)  # noqa: E731  (same seed: same weights)
        model = build()
        params = sum(p.numel() for p in model.parameters())
        _, t_save_bf16 = timed(lambda: model.save_pretrained(bf16_dir))
        kw = inputs()
        variants = {}
        for label, overrides in (
            ("default config (sensitive layers weight-only INT8)", {}),
            ("sensitive: native (sensitive layers bf16)", {"quantization_config": {"sensitive": "native"}}),
            ("quantize_sensitive=True", {"quantization_config": {"quantize_sensitive": True}}),
        ):
            if model is None:
                model = build()
            result = fx_fp8.prepare_model(model, **overrides)
            qdir = os.path.join(root, f"q{len(variants)}")
            _, t_save = timed(lambda: fx_fp8.save_quantized(model, qdir))
            with torch.no_grad():
                ref = output_tensor(model(**kw))
            variants[label] = dict(dir=qdir, result=result, t_save=t_save, ref=ref)
            model = None
            gc.collect()

        loads = {"bf16": [], "bf16 read": [], **{label: [] for label in variants}}
        for _ in range(args.repeat):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m, t = timed(lambda: FluxTransformer2DModel.from_pretrained(bf16_dir, torch_dtype=torch.bfloat16))
            loads["bf16"].append(t)
            # from_pretrained leaves the tensors as views of the mapped file: reading every byte once
            # (what load_quantized does, into its own memory) is the fair figure
            _, t_read = timed(lambda: [p.clone() for p in m.state_dict().values()])
            loads["bf16 read"].append(t + t_read)
            del m
            for label, v in variants.items():
                m, t = timed(lambda: fx_fp8.load_quantized(v["dir"]))
                loads[label].append(t)
                with torch.no_grad():
                    v["identical"] = torch.equal(output_tensor(m(**kw)), v["ref"])
                del m

        bf16_bytes = folder_bytes(bf16_dir)
        bf16_full = extrapolate(tensor_bytes_by_part(os.path.join(bf16_dir, "diffusion_pytorch_model.safetensors")))
        rows = [
            (
                "bf16 save_pretrained",
                "-",
                f"{bf16_bytes / 2**20:,.1f}",
                "1.000",
                "1.000",
                f"{t_save_bf16:.2f}",
                f"{min(loads['bf16']):.2f} lazy, {min(loads['bf16 read']):.2f} read",
                "-",
            )
        ]
        for label, v in variants.items():
            q = folder_bytes(v["dir"])
            full = extrapolate(tensor_bytes_by_part(os.path.join(v["dir"], WEIGHTS_NAME)))
            n_q, n_native = len(v["result"]["quantized"]), len(v["result"]["native"])
            rows.append(
                (
                    f"save_quantized, {label}",
                    f"{n_q}/{n_q + n_native}",
                    f"{q / 2**20:,.1f}",
                    f"{q / bf16_bytes:.3f}",
                    f"{full / bf16_full:.3f}",
                    f"{v['t_save']:.2f}",
                    f"{min(loads[label]):.2f}",
                    "yes" if v["identical"] else "NO",
                )
            )
        headers = [
            "folder",
            "FP8 linears",
            "MiB on disk",
            "ratio",
            "ratio, 19+38 blocks (extrapolated)",
            "save s",
            f"load s (best of {args.repeat})",
            "bit-identical output",
        ]
        from tabulate import tabulate

        title = (
            f"Flux width 3072, {args.double} double + {args.single} single blocks, bf16, {params / 1e6:,.0f}M "
            f"parameters; load = FluxTransformer2DModel.from_pretrained(torch_dtype=bf16) vs fx_fp8.load_quantized"
        )
        print(title)
        print(tabulate(rows, headers=headers))
        if not args.no_results:
            append_section("checkpoint_size.py", title, tabulate(rows, headers=headers, tablefmt="github"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
