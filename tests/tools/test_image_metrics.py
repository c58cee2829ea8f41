"""PSNR / SSIM / side-by-side PNG (fx_fp8.tools.image_metrics)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fx_fp8.tools.image_metrics import compare_images, psnr, save_side_by_side, ssim, to_float_image


def _img(seed=0, shape=(32, 32, 3)):
    return np.random.default_rng(seed).random(shape)


def test_psnr_matches_its_definition():
    a = _img()
    b = np.clip(a + 0.01 * np.random.default_rng(1).standard_normal(a.shape), 0, 1)
    assert psnr(a, b) == pytest.approx(10 * math.log10(1 / np.mean((a - b) ** 2)))
    assert psnr(a, a) == math.inf


def test_ssim_of_constant_images_is_the_luminance_term():
    # for flat images the variance terms vanish: SSIM = (2ab + C1) / (a^2 + b^2 + C1)
    a, b, c1 = 0.3, 0.5, 0.01**2
    expected = (2 * a * b + c1) / (a * a + b * b + c1)
    assert ssim(np.full((16, 16, 3), a), np.full((16, 16, 3), b)) == pytest.approx(expected, rel=1e-9)


def test_ssim_orders_by_distortion_and_is_symmetric():
    a = _img()
    noise = np.random.default_rng(2).standard_normal(a.shape)
    slight, strong = np.clip(a + 0.02 * noise, 0, 1), np.clip(a + 0.2 * noise, 0, 1)
    assert ssim(a, a) == pytest.approx(1.0)
    assert 1.0 > ssim(a, slight) > ssim(a, strong)
    assert ssim(a, slight) == pytest.approx(ssim(slight, a))


def test_image_kinds_agree():
    from PIL import Image

    u8 = (np.random.default_rng(3).random((8, 8, 3)) * 255).astype(np.uint8)
    as_float = u8 / 255.0
    chw = torch.from_numpy(as_float).permute(2, 0, 1)
    for kind in (u8, Image.fromarray(u8), chw, torch.from_numpy(as_float)):
        assert np.allclose(to_float_image(kind), as_float)
    scores = compare_images(Image.fromarray(u8), chw)  # chw went through float32: not bit-equal
    assert scores["psnr"] > 100 and scores["ssim"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "bad, match",
    [
        (np.full((4, 4, 3), 2.0), r"values must lie in \[0, 1\]"),
        (np.zeros((2, 4, 4, 3)), "expected one image"),
        (np.full((4, 4, 3), np.nan), "NaN"),
        (np.zeros((4, 4, 3), dtype=np.int32), "dtype int32"),
    ],
)
def test_bad_images_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        to_float_image(bad)


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="differ in shape"):
        psnr(_img(shape=(8, 8, 3)), _img(shape=(8, 16, 3)))


def test_side_by_side_png(tmp_path):
    from PIL import Image

    path = save_side_by_side(tmp_path / "sub" / "cmp.png", [_img(0), _img(1)], ["native", "fp8"], scale=2)
    im = Image.open(path)
    assert im.format == "PNG" and im.width == 2 * 64 + 4 and im.height == 64 + 14
    with pytest.raises(ValueError, match="2 images but 1 labels"):
        save_side_by_side(tmp_path / "x.png", [_img(0), _img(1)], ["one"])
