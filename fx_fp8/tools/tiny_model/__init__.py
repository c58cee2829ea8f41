"""A tiny trained text-to-image diffusion transformer shipped with ``fx_fp8``.

It draws "a {color} {shape} on a {color} background" images at 32x32 in pixel
space, runs on CPU in well under a second, and needs no download::

    from fx_fp8.tools.tiny_model import load_tiny_pipeline
    pipe = load_tiny_pipeline()
    image = pipe("a red circle on a blue background", generator=torch.Generator().manual_seed(0)).images[0]

Weights were produced by ``examples/train_tiny_dit.py``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .pipeline import DEFAULT_NUM_INFERENCE_STEPS, TinyShapesPipeline
from .prompt_encoder import TinyPromptEncoder
from .shapes import COLORS, SHAPES, dominant_colors, make_prompt, parse_prompt, random_prompt, render_prompt_image

TINY_MODEL_DIR: Path = Path(__file__).resolve().parent / "weights"
#: the model's own fx_fp8 config (its step policy), next to its weights
TINY_MODEL_CONFIG: Path = TINY_MODEL_DIR / "fx_fp8.yaml"


def load_tiny_pipeline(
    torch_dtype: torch.dtype = torch.float32, device: str | torch.device | None = None
) -> TinyShapesPipeline:
    """Loads the shipped tiny pipeline from :data:`TINY_MODEL_DIR` (offline)."""
    pipe = TinyShapesPipeline.from_pretrained(TINY_MODEL_DIR, torch_dtype=torch_dtype, local_files_only=True)
    if device is not None:
        pipe = pipe.to(device)
    return pipe


__all__ = [
    "COLORS",
    "DEFAULT_NUM_INFERENCE_STEPS",
    "SHAPES",
    "TINY_MODEL_CONFIG",
    "TINY_MODEL_DIR",
    "TinyPromptEncoder",
    "TinyShapesPipeline",
    "dominant_colors",
    "load_tiny_pipeline",
    "make_prompt",
    "parse_prompt",
    "random_prompt",
    "render_prompt_image",
]
