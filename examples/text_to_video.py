#!/usr/bin/env python
"""Text to video (Wan2.1 / Wan2.2) with FP8 attention and FP8 linears (fx_fp8), with vLLM-Omni's flags.

    # no --model: a tiny RANDOM-weight Wan pipeline built offline (noise-like frames: it shows
    # the FP8 path, the per-step variants and the numbers, not video quality)
    python examples/text_to_video.py --compare --diffusion-kv-cache-skip-steps 0,1
    python examples/text_to_video.py --tiny-pipeline wan2.2 --compare      # two experts

    # a local Wan folder on a GPU / NPU
    python examples/text_to_video.py --model /models/Wan2.2-T2V-A14B-Diffusers --prompt "a cat surfing" \\
        --height 480 --width 832 --num-frames 81 --num-inference-steps 40 \\
        --quantization fp8 --diffusion-kv-cache-dtype fp8 --diffusion-kv-cache-skip-steps 0-3 --output cat.gif

    # four GPUs / NPUs: Ulysses 4, as vLLM-Omni's Wan2.2 example (--ulysses-degree 4)
    torchrun --nproc-per-node 4 examples/text_to_video.py --model /models/Wan2.2-T2V-A14B-Diffusers \\
        --ulysses-degree 4 --quantization fp8 --diffusion-kv-cache-dtype fp8 --output cat.gif
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import numpy as np
import torch

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

from fx_fp8.tools.cli_flags import add_generation_flags, resolve_dtype  # noqa: E402
from fx_fp8.tools.image_metrics import compare_images, save_side_by_side, to_pil  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=os.path.basename(__file__),
        description=__doc__.split("\n")[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_generation_flags(parser, video=True)
    parser.add_argument(
        "--tiny-pipeline",
        choices=["wan2.1", "wan2.2"],
        default="wan2.1",
        help="without --model: which tiny random Wan pipeline to build (wan2.2 = two experts)",
    )
    return _common.one_line_errors(_common.add_run_flags(parser))


def load(args, device, dtype):
    """(pipe, call kwargs, description)."""
    if args.model:
        if not os.path.isfile(os.path.join(args.model, "model_index.json")):
            raise _common.UsageError(f"--model {args.model!r} is not a diffusers pipeline folder (no model_index.json)")
        from fx_fp8.tools.quantized_folders import load_pipeline_folder

        pipe = _common.load_or_fail(
            f"the pipeline in {args.model!r}",  # quantized transformer folders too
            lambda: load_pipeline_folder(args.model, dtype),
        )
        call = dict(prompt=args.prompt or "a cat surfing a wave at sunset")
        what = args.model
    else:
        from fx_fp8.tools.model_zoo.registry import build_tiny_pipeline

        pipe, call = build_tiny_pipeline(
            args.tiny_pipeline, height=args.height, width=args.width, num_frames=args.num_frames
        )
        pipe = pipe.to(dtype)
        call = {k: (v.to(dtype) if isinstance(v, torch.Tensor) else v) for k, v in call.items()}
        what = (
            f"tiny RANDOM-weight {args.tiny_pipeline} pipeline built offline (no --model): frames are noise-like; "
            "this shows the FP8 path and its numbers, not video quality"
        )
        if args.prompt:
            print("note: the tiny random pipeline has no text encoder; --prompt is not used (random prompt embeddings)")
    pipe.set_progress_bar_config(disable=True)
    call.update(height=args.height, width=args.width, num_frames=args.num_frames)
    if args.num_inference_steps is not None:
        call["num_inference_steps"] = args.num_inference_steps
    elif not args.model:
        call["num_inference_steps"] = 6
    if args.guidance_scale is not None:
        call["guidance_scale"] = args.guidance_scale
    return pipe.to(device), call, what


def frame_strip(frames: np.ndarray) -> np.ndarray:
    """(F, H, W, 3) -> (H, F*W, 3)."""
    return np.concatenate(list(frames), axis=1)


def save_frames(path: str, frames: np.ndarray, fps: int = 8) -> None:
    """A GIF for *.gif, else a PNG strip of the frames side by side."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    scale = max(1, 128 // frames.shape[1])
    if path.lower().endswith(".gif"):
        images = [to_pil(f, scale=scale) for f in frames]
        images[0].save(path, save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0)
    else:
        to_pil(frame_strip(frames), scale=scale).save(path)


def video_metrics(reference: np.ndarray, test: np.ndarray) -> dict:
    """PSNR / SSIM averaged over frames."""
    scores = [compare_images(a, b) for a, b in zip(reference, test)]
    return {k: float(np.mean([s[k] for s in scores])) for k in ("psnr", "ssim")}


@_common.cli_main("text_to_video.py")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    _common.quiet_diffusers()
    _common.check_positive("--num-frames", args.num_frames)
    _common.check_positive("--num-inference-steps", args.num_inference_steps)
    cfg, options = _common.configs_from_args(args)  # bad flags or YAML fail here, before any model loads
    device = _common.setup_distributed(options, _common.check_device(args.device))
    dtype = resolve_dtype(args.dtype, device)
    if args.model:  # its weights, the sizes it can make
        _common.check_model(args.model, args.height, args.width)
    else:
        _common.check_family_size("wan", args.height, args.width)
    output = _common.output_path(args.output, "text_to_video.gif")  # a file or a folder, checked before loading
    pipe, call, what = load(args, device, dtype)
    print(f"model: {what}")
    print(
        f"device {device}, {str(dtype).replace('torch.', '')}; {args.num_frames} frames {args.height}x{args.width}, seed {args.seed}"
    )
    print(f"fp8: {_common.describe_config(cfg)}")

    def run():
        gen = torch.Generator("cpu").manual_seed(args.seed)
        return pipe(**call, generator=gen, output_type="np").frames[0]

    native, frames = _common.compare_and_report(
        args, pipe, call, run, cfg, options, device=device, metrics=video_metrics
    )
    if not _common.is_main_process():  # under torchrun every rank holds the same frames: rank 0 writes them
        return 0
    save_frames(output, frames)
    print(f"\nsaved {output} ({len(frames)} frames)")
    if args.compare:
        stem, _ = os.path.splitext(output)
        path = save_side_by_side(f"{stem}_compare.png", [frame_strip(native), frame_strip(frames)], ["native", "fp8"])
        print(f"saved {path} (native frames | fp8 frames)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
