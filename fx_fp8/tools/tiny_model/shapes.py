"""Synthetic "coloured shape on a coloured background" data for the tiny model.

Prompts follow one fixed grammar::

    a {shape color} {shape} on a {background color} background

with ``shape color != background color``.  :func:`render_prompt_image` draws the
image for a prompt (with random position / size jitter), :func:`parse_prompt`
turns a prompt back into ``(shape_color, shape, background_color)``.
"""

from __future__ import annotations

import numpy as np

# Palette: corners of the RGB cube, far apart from each other (distance >= 255).
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "white": (255, 255, 255),
    "black": (0, 0, 0),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
COLOR_NAMES: tuple[str, ...] = tuple(COLORS)

PROMPT_TEMPLATE = "a {color} {shape} on a {background} background"
# Words the grammar uses besides colours and shapes.
FILLER_WORDS: tuple[str, ...] = ("a", "on", "background")
# Whole vocabulary (without the padding token), in a fixed order.
VOCAB: tuple[str, ...] = FILLER_WORDS + COLOR_NAMES + SHAPES


def make_prompt(color: str, shape: str, background: str) -> str:
    """Builds the prompt for a (shape colour, shape, background colour) triple."""
    for word, allowed, kind in ((color, COLORS, "color"), (shape, SHAPES, "shape"), (background, COLORS, "color")):
        if word not in allowed:
            raise ValueError(f"unknown {kind} {word!r}; expected one of {sorted(allowed)}")
    if color == background:
        raise ValueError(f"shape color and background color must differ (both {color!r})")
    return PROMPT_TEMPLATE.format(color=color, shape=shape, background=background)


def all_prompts() -> list[str]:
    """Every prompt of the grammar (6 colours x 4 shapes x 5 backgrounds = 120)."""
    return [make_prompt(c, s, b) for c in COLOR_NAMES for s in SHAPES for b in COLOR_NAMES if b != c]


def random_triple(rng: np.random.Generator) -> tuple[str, str, str]:
    """A random (shape colour, shape, background colour) with distinct colours."""
    ci, bi = rng.choice(len(COLOR_NAMES), size=2, replace=False)
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    return COLOR_NAMES[int(ci)], shape, COLOR_NAMES[int(bi)]


def random_prompt(rng: np.random.Generator) -> str:
    """A random prompt of the grammar, drawn with the numpy generator ``rng``."""
    return make_prompt(*random_triple(rng))


def parse_prompt(prompt: str) -> tuple[str, str, str]:
    """Parses ``"a red circle on a blue background"`` into ``("red", "circle", "blue")``.

    Raises ``ValueError`` naming the offending word if the prompt uses a word outside
    the vocabulary, or if it does not follow the grammar.
    """
    words = prompt.lower().split()
    for w in words:
        if w not in VOCAB:
            raise ValueError(f"unknown word {w!r} in prompt {prompt!r}; vocabulary: {list(VOCAB)}")
    if (
        len(words) != 7
        or words[0] != "a"
        or words[3] != "on"
        or words[4] != "a"
        or words[6] != "background"
        or words[1] not in COLORS
        or words[2] not in SHAPES
        or words[5] not in COLORS
    ):
        raise ValueError(f"prompt {prompt!r} does not follow the grammar {PROMPT_TEMPLATE!r}")
    color, shape, background = words[1], words[2], words[5]
    if color == background:
        raise ValueError(f"shape color and background color must differ in {prompt!r}")
    return color, shape, background


def shape_mask(
    shape: str,
    size: int,
    rng: np.random.Generator | None = None,
    *,
    height: int | None = None,
    width: int | None = None,
) -> np.ndarray:
    """Boolean mask (H, W) of one randomly placed / sized ``shape``.

    ``size`` is used for both sides unless ``height``/``width`` are given.  With
    ``rng=None`` the shape is centred with a fixed size.
    """
    h = height or size
    w = width or size
    m = min(h, w)
    if rng is None:
        r = 0.3 * m
        cy, cx = (h - 1) / 2.0, (w - 1) / 2.0
    else:
        r = float(rng.uniform(0.22, 0.36)) * m
        cy = float(rng.uniform(r, h - 1 - r))
        cx = float(rng.uniform(r, w - 1 - r))
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    dy, dx = yy - cy, xx - cx
    if shape == "circle":
        mask = dy * dy + dx * dx <= r * r
    elif shape == "square":
        s = r * 0.85
        mask = (np.abs(dy) <= s) & (np.abs(dx) <= s)
    elif shape == "triangle":
        # Upward-pointing isosceles triangle inscribed in the circle of radius r.
        top, bottom = -r, r * 0.8
        frac = (dy - top) / (bottom - top)  # 0 at apex, 1 at base
        mask = (frac >= 0) & (frac <= 1) & (np.abs(dx) <= frac * r)
    elif shape == "cross":
        t = r * 0.33
        mask = ((np.abs(dy) <= r) & (np.abs(dx) <= t)) | ((np.abs(dx) <= r) & (np.abs(dy) <= t))
    else:
        raise ValueError(f"unknown shape {shape!r}; expected one of {list(SHAPES)}")
    return mask


def render_prompt_image(
    prompt: str, rng: np.random.Generator | None = None, height: int = 32, width: int = 32
) -> np.ndarray:
    """Renders the image a prompt describes: uint8 array (H, W, 3).

    ``rng`` (a ``numpy.random.Generator``) jitters position and size; ``None``
    gives a centred, fixed-size shape.
    """
    color, shape, background = parse_prompt(prompt)
    img = np.empty((height, width, 3), dtype=np.uint8)
    img[:] = COLORS[background]
    mask = shape_mask(shape, min(height, width), rng, height=height, width=width)
    img[mask] = COLORS[color]
    return img


def classify_pixels(image: np.ndarray) -> np.ndarray:
    """Index into ``COLOR_NAMES`` of the nearest palette colour for each pixel of (H, W, 3) uint8/float."""
    palette = np.array([COLORS[c] for c in COLOR_NAMES], dtype=np.float32)  # (K, 3)
    px = np.asarray(image, dtype=np.float32).reshape(-1, 3)
    d = ((px[:, None, :] - palette[None, :, :]) ** 2).sum(-1)
    return d.argmin(-1).reshape(image.shape[:2])


def dominant_colors(image: np.ndarray) -> tuple[str, str]:
    """Returns ``(shape_color, background_color)`` measured from an image.

    The background is the palette colour most frequent along the image border; the
    shape colour is the most frequent other palette colour in the whole image.
    """
    labels = classify_pixels(image)
    k = len(COLOR_NAMES)
    border = np.concatenate([labels[0], labels[-1], labels[:, 0], labels[:, -1]])
    bg = int(np.bincount(border, minlength=k).argmax())
    counts = np.bincount(labels.reshape(-1), minlength=k)
    counts[bg] = -1
    fg = int(counts.argmax())
    return COLOR_NAMES[fg], COLOR_NAMES[bg]


def color_match_rates(prompts: list[str], images) -> tuple[float, float]:
    """Fraction of images (float RGB in [0, 1]) whose measured (shape colour, background
    colour) match their prompt: the prompt-following check of the tests and of training."""
    fg_ok = bg_ok = 0
    for prompt, img in zip(prompts, images):
        color, _, background = parse_prompt(prompt)
        fg, bg = dominant_colors((np.asarray(img) * 255).round().astype(np.uint8))
        fg_ok += fg == color
        bg_ok += bg == background
    return fg_ok / len(prompts), bg_ok / len(prompts)
