"""Image quality between a native and an FP8 run: PSNR, SSIM, and a side-by-side PNG.

Images are RGB in [0, 1]: PIL images, numpy arrays (H, W, 3) / (H, W) as float in
[0, 1] or uint8, or torch tensors (H, W, 3) or (3, H, W). No dependency beyond
numpy (and PIL for PNGs).
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import numpy as np

SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
_K1, _K2 = 0.01, 0.03


def to_float_image(image) -> np.ndarray:
    """(H, W, C) float64 in [0, 1] from any of the accepted image kinds."""
    if hasattr(image, "convert") and hasattr(image, "size"):  # PIL image
        image = np.asarray(image.convert("RGB"))
    elif hasattr(image, "detach"):  # torch tensor
        t = image.detach().float().cpu()
        if t.ndim == 3 and t.shape[0] in (1, 3) and t.shape[-1] not in (1, 3):
            t = t.permute(1, 2, 0)  # CHW -> HWC
        image = t.numpy()
    arr = np.asarray(image)
    if arr.ndim == 2:
        arr = arr[..., None]
    if arr.ndim != 3 or arr.shape[-1] not in (1, 3):
        raise ValueError(f"expected one image of shape (H, W), (H, W, 1|3) or (3, H, W), got shape {arr.shape}")
    if arr.dtype == np.uint8:
        return arr.astype(np.float64) / 255.0
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"expected a float image in [0, 1] or uint8, got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        raise ValueError("image has NaN or infinite values")
    lo, hi = float(arr.min()), float(arr.max())
    if lo < -1e-3 or hi > 1 + 1e-3:
        raise ValueError(f"float image values must lie in [0, 1], got [{lo:.3f}, {hi:.3f}]")
    return np.clip(arr, 0.0, 1.0)


def _pair(a, b) -> tuple[np.ndarray, np.ndarray]:
    x, y = to_float_image(a), to_float_image(b)
    if x.shape != y.shape:
        raise ValueError(f"images differ in shape: {x.shape} vs {y.shape}")
    return x, y


def psnr_db(mse: float, peak: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB of a mean squared error against a peak; inf for mse 0."""
    return math.inf if mse <= 0 else 10.0 * math.log10(peak * peak / mse)


def psnr(a, b) -> float:
    """Peak signal-to-noise ratio in dB of two images (peak 1.0); inf for identical images."""
    x, y = _pair(a, b)
    return psnr_db(float(np.mean((x - y) ** 2)))


def _gaussian(size: int, sigma: float) -> np.ndarray:
    r = np.arange(size, dtype=np.float64) - (size - 1) / 2
    g = np.exp(-(r**2) / (2 * sigma**2))
    return g / g.sum()


def _filter(img: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Separable 'valid' filtering of an (H, W, C) image."""
    n = len(g)
    h, w = img.shape[0] - n + 1, img.shape[1] - n + 1
    rows = sum(g[i] * img[i : i + h] for i in range(n))
    return sum(g[j] * rows[:, j : j + w] for j in range(n))


def ssim(a, b, *, window: int = SSIM_WINDOW, sigma: float = SSIM_SIGMA) -> float:
    """Mean SSIM (Wang et al. 2004): Gaussian window 11, sigma 1.5, K1 0.01, K2 0.03, range 1,
    per channel then averaged. Images smaller than the window use the largest odd window that fits."""
    x, y = _pair(a, b)
    size = min(window, x.shape[0], x.shape[1])
    size -= (size + 1) % 2  # odd
    g = _gaussian(size, sigma)
    c1, c2 = _K1**2, _K2**2
    mx, my = _filter(x, g), _filter(y, g)
    sxx = _filter(x * x, g) - mx * mx
    syy = _filter(y * y, g) - my * my
    sxy = _filter(x * y, g) - mx * my
    num = (2 * mx * my + c1) * (2 * sxy + c2)
    den = (mx * mx + my * my + c1) * (sxx + syy + c2)
    return float(np.mean(num / den))


def compare_images(reference, test) -> dict:
    """{"psnr": dB, "ssim": ...} of `test` against `reference`."""
    return {"psnr": psnr(reference, test), "ssim": ssim(reference, test)}


def to_pil(image, *, scale: int = 1):
    """A PIL RGB image, upscaled by an integer factor with nearest neighbour (tiny images stay crisp)."""
    from PIL import Image

    arr = to_float_image(image)
    if arr.shape[-1] == 1:
        arr = np.repeat(arr, 3, axis=-1)
    pil = Image.fromarray((arr * 255.0 + 0.5).astype(np.uint8))
    if scale != 1:
        pil = pil.resize((pil.width * scale, pil.height * scale), Image.NEAREST)
    return pil


def side_by_side(images: Sequence, labels: Sequence[str] | None = None, *, scale: int | None = None, gap: int = 4):
    """One PIL image with `images` in a row, each captioned with its label.

    `scale` defaults to enough to make small images at least 256 pixels tall."""
    from PIL import Image, ImageDraw

    if not images:
        raise ValueError("side_by_side needs at least one image")
    if labels is not None and len(labels) != len(images):
        raise ValueError(f"got {len(images)} images but {len(labels)} labels")
    first = to_float_image(images[0])
    if scale is None:
        scale = max(1, 256 // first.shape[0])
    tiles = [to_pil(im, scale=scale) for im in images]
    caption = 14 if labels else 0
    width = sum(t.width for t in tiles) + gap * (len(tiles) - 1)
    height = max(t.height for t in tiles) + caption
    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    x = 0
    for i, tile in enumerate(tiles):
        canvas.paste(tile, (x, caption))
        if labels:
            draw.text((x + 2, 1), str(labels[i]), fill=(0, 0, 0))
        x += tile.width + gap
    return canvas


def save_side_by_side(path, images: Sequence, labels: Sequence[str] | None = None, **kw) -> str:
    """Write side_by_side(images, labels) as a PNG (parent folders created); returns the path."""
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    side_by_side(images, labels, **kw).save(path, format="PNG")
    return path
