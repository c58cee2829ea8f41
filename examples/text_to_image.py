#!/usr/bin/env python
"""Text to image with FP8 attention and FP8 linears (fx_fp8), with vLLM-Omni's flags.

    # the shipped tiny model on CPU: native vs FP8 latency, PSNR, SSIM and a side-by-side PNG, with the
    # model's own config (its fx_fp8.yaml: attention native on the first and last 2 steps)
    python examples/text_to_image.py --compare
    python examples/text_to_image.py --compare --library-default   # the library's default config instead

    # a local diffusers folder (Flux, Qwen-Image, Z-Image, SD3, ...) on a GPU / NPU
    python examples/text_to_image.py --model /models/FLUX.1-dev --prompt "a lighthouse at dawn" \\
        --height 1024 --width 1024 --num-inference-steps 28 \\
        --quantization fp8 --diffusion-kv-cache-dtype fp8 --diffusion-kv-cache-skip-steps 0,1 --compare

    # a vLLM-Omni stage config, one key overridden on the command line
    python examples/text_to_image.py --config examples/configs/vllm_omni_stage.yaml --diffusion-kv-cache-skip-steps 0-2

    # two GPUs / NPUs, Ulysses sequence parallelism, first-block cache (vLLM-Omni's flags)
    torchrun --nproc-per-node 2 examples/text_to_image.py --model /models/FLUX.1-dev --ulysses-degree 2 \\
        --cache-backend first_block_cache --cache-config '{"threshold": 0.08}' --compare
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

from fx_fp8.tools.cli_flags import add_generation_flags, resolve_dtype  # noqa: E402
from fx_fp8.tools.image_metrics import compare_images, save_side_by_side  # noqa: E402
from fx_fp8.tools.tiny_model import TINY_MODEL_DIR  # noqa: E402

TINY_PROMPT = "a red circle on a blue background"


def is_tiny_model(model: str) -> bool:
    try:
        with open(os.path.join(model, "model_index.json")) as f:
            return json.load(f).get("_class_name") == "TinyShapesPipeline"
    except OSError:
        return False


def load_pipeline(model: str, device: str, dtype):
    """The shipped tiny model, or any local diffusers text-to-image folder (offline)."""
    if not os.path.isfile(os.path.join(model, "model_index.json")):
        raise _common.UsageError(f"--model {model!r} is not a diffusers pipeline folder (no model_index.json)")
    from fx_fp8.tools.quantized_folders import load_pipeline_folder

    # transformer/ may hold quantized weights: save_pretrained of a model loaded with fx_fp8.DiffusersConfig,
    # or fx_fp8.save_quantized
    cls = None
    if is_tiny_model(model):
        from fx_fp8.tools.tiny_model import TinyShapesPipeline as cls
    pipe = _common.load_or_fail(
        f"the pipeline in {model!r}", lambda: load_pipeline_folder(model, dtype, pipeline_class=cls)
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=os.path.basename(__file__),
        description=__doc__.split("\n")[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    vocab, most = _common.tiny_vocabulary()
    add_generation_flags(
        parser,
        default_model=str(TINY_MODEL_DIR),
        prompt_help=(
            f"the text prompt (default for the tiny model: {TINY_PROMPT!r}); the shipped tiny model knows "
            f"{len(vocab)} words, at most {most} a prompt: {' '.join(vocab)}"
        ),
    )
    return _common.one_line_errors(_common.add_run_flags(parser))


@_common.cli_main("text_to_image.py")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    _common.quiet_diffusers()
    cfg, options = _common.configs_from_args(args)  # bad flags or YAML fail here, before any model loads
    _common.check_positive("--num-inference-steps", args.num_inference_steps)
    device = _common.setup_distributed(options, _common.check_device(args.device))
    dtype = resolve_dtype(args.dtype, device)
    _common.check_model(args.model, args.height, args.width)  # its weights, the sizes it can make
    tiny = is_tiny_model(args.model)
    prompt = args.prompt or (TINY_PROMPT if tiny else "a photo of a lighthouse at dawn")
    if tiny:
        _common.check_tiny_prompt(prompt)
    output = _common.output_path(args.output, "text_to_image.png")  # a file or a folder, checked before loading

    print(
        f"model: {args.model}{' (shipped tiny model)' if tiny else ''} on {device}, {str(dtype).replace('torch.', '')}"
    )
    print(f"prompt: {prompt!r}, {args.height}x{args.width}, seed {args.seed}")
    print(f"fp8: {_common.describe_config(cfg)}")
    pipe = load_pipeline(args.model, device, dtype)

    call = dict(prompt=prompt, height=args.height, width=args.width)
    if args.num_inference_steps is not None:
        call["num_inference_steps"] = args.num_inference_steps
    if args.guidance_scale is not None:
        call["guidance_scale"] = args.guidance_scale

    def run():
        gen = torch.Generator("cpu").manual_seed(args.seed)  # same noise on every device (and every rank)
        return pipe(**call, generator=gen).images[0]

    native, image = _common.compare_and_report(
        args, pipe, call, run, cfg, options, device=device, metrics=compare_images
    )
    if not _common.is_main_process():  # under torchrun every rank holds the same image: rank 0 writes it
        return 0
    os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
    image.save(output)
    print(f"\nsaved {output}")
    if args.compare:
        stem, _ = os.path.splitext(output)
        path = save_side_by_side(f"{stem}_compare.png", [native, image], ["native", "fp8"])
        print(f"saved {path} (native | fp8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
