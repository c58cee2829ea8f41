#!/usr/bin/env python
"""Native vs FP8 on the shipped tiny model, as one picture: a row per prompt, native | FP8 | difference.

    python examples/make_readme_picture.py                                       # writes outputs/native_vs_fp8.png
    python examples/make_readme_picture.py --out docs/images/native_vs_fp8.png   # the README's picture

The FP8 images come from `fx_fp8.compile_pipeline(pipe, TINY_MODEL_CONFIG)`, the shipped model's own
config as the main example runs it (FP8 attention except on the first and last 2 steps, FP8 linears,
sensitive layers weight-only; the CPU reference lowering, which computes the device kernels' numerics), with
the same prompts and noise seeds as the native images. The difference column is |native - FP8|
amplified --gain times (clipped). Each 32x32 image is upscaled with nearest neighbour (--scale).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import numpy as np
import torch

import fx_fp8
from fx_fp8.tools.image_metrics import compare_images, side_by_side
from fx_fp8.tools.tiny_model import DEFAULT_NUM_INFERENCE_STEPS, TINY_MODEL_CONFIG, load_tiny_pipeline

PROMPTS = (
    ("a red circle on a blue background", 0),
    ("a yellow cross on a black background", 1),
    ("a green triangle on a white background", 2),
    ("a white square on a green background", 3),
)


def generate(pipe, cases) -> list[np.ndarray]:
    return [
        pipe(
            prompt,
            num_inference_steps=DEFAULT_NUM_INFERENCE_STEPS,
            output_type="np",
            generator=torch.Generator().manual_seed(seed),
        ).images[0]
        for prompt, seed in cases
    ]


def picture(cases, native, fp8, *, scale: int, gain: float):
    from PIL import Image, ImageDraw

    rows = []
    for (prompt, seed), a, b in zip(cases, native, fp8):
        m = compare_images(a, b)
        diff = np.clip(np.abs(a.astype(np.float32) - b.astype(np.float32)) * gain, 0.0, 1.0)
        row = side_by_side([a, b, diff], ["native", f"FP8  {m['psnr']:.1f} dB", f"|diff| x{gain:g}"], scale=scale)
        caption = Image.new("RGB", (row.width, 16), (255, 255, 255))
        ImageDraw.Draw(caption).text((2, 2), f"{prompt!r}, seed {seed}", fill=(0, 0, 0))
        rows += [caption, row]
    gap = 6
    canvas = Image.new(
        "RGB", (max(r.width for r in rows), sum(r.height for r in rows) + gap * (len(cases) - 1)), (255, 255, 255)
    )
    y = 0
    for i, r in enumerate(rows):
        canvas.paste(r, (0, y))
        y += r.height + (gap if i % 2 == 1 else 0)
    return canvas


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join("outputs", "native_vs_fp8.png"))
    p.add_argument("--scale", type=int, default=4, help="nearest-neighbour upscale of each 32x32 image")
    p.add_argument("--gain", type=float, default=4.0, help="amplification of the difference column")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    pipe = load_tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    native = generate(pipe, PROMPTS)
    fx_fp8.compile_pipeline(pipe, TINY_MODEL_CONFIG)
    fp8 = generate(pipe, PROMPTS)
    for (prompt, _), a, b in zip(PROMPTS, native, fp8):
        m = compare_images(a, b)
        print(f"{prompt}: PSNR {m['psnr']:.1f} dB, SSIM {m['ssim']:.3f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    picture(PROMPTS, native, fp8, scale=args.scale, gain=args.gain).save(args.out, format="PNG")
    print(f"saved {args.out} (native | FP8 | difference)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
