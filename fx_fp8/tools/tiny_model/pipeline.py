"""``TinyShapesPipeline``: a pixel-space Flux-style text-to-image pipeline for the tiny model."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput
from diffusers.utils.torch_utils import randn_tensor

from .prompt_encoder import TinyPromptEncoder

DEFAULT_NUM_INFERENCE_STEPS = 10


def pack_images(images: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> Flux-packed 2x2 patches [B, (H/2)*(W/2), C*4]."""
    b, c, h, w = images.shape
    x = images.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_images(latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_images`: [B, (H/2)*(W/2), C*4] -> [B, C, H, W]."""
    b, _, ch = latents.shape
    x = latents.view(b, height // 2, width // 2, ch // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, ch // 4, height, width)


def image_ids(height: int, width: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Flux ``img_ids`` for a (height/2) x (width/2) token grid: [(H/2)*(W/2), 3] = (0, row, col)."""
    h, w = height // 2, width // 2
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 3).to(device=device, dtype=dtype)


def text_ids(seq_len: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Flux ``txt_ids``: all zeros, [T, 3]."""
    return torch.zeros(seq_len, 3, device=device, dtype=dtype)


class TinyShapesPipeline(DiffusionPipeline):
    """Text-to-image in pixel space (no VAE) with a tiny ``FluxTransformer2DModel``.

    Images are RGB in [-1, 1], packed into 2x2 patches (12 channels per token).
    Sampling is rectified flow with ``FlowMatchEulerDiscreteScheduler``; the
    transformer receives ``timestep / 1000`` (i.e. the sigma), as in the Flux pipeline.
    """

    model_cpu_offload_seq = "prompt_encoder->transformer"
    _callback_tensor_inputs = ["latents", "prompt_embeds", "pooled_prompt_embeds"]

    def __init__(
        self,
        transformer: FluxTransformer2DModel,
        prompt_encoder: TinyPromptEncoder,
        scheduler: FlowMatchEulerDiscreteScheduler,
    ):
        super().__init__()
        self.register_modules(transformer=transformer, prompt_encoder=prompt_encoder, scheduler=scheduler)

    @property
    def num_channels(self) -> int:
        return self.transformer.config.in_channels // 4

    def _device(self) -> torch.device:
        # ``_execution_device`` needs every component to expose ``.device``; a user-supplied
        # wrapper around the transformer may not, so fall back to the prompt encoder's device.
        try:
            return self._execution_device
        except AttributeError:
            return self.prompt_encoder.device

    def _dtype(self) -> torch.dtype:
        dtype = getattr(self.transformer, "dtype", None)
        if isinstance(dtype, torch.dtype):
            return dtype
        for p in self.transformer.parameters():
            if p.is_floating_point():
                return p.dtype
        return self.prompt_encoder.dtype

    def encode_prompt(self, prompt: str | list[str], device=None, dtype=None):
        """Returns ``(prompt_embeds [B, T, D], pooled_prompt_embeds [B, D], txt_ids [T, 3])``."""
        device = device or self._device()
        dtype = dtype or self._dtype()
        embeds, pooled = self.prompt_encoder.encode(prompt, device=device, dtype=dtype)
        return embeds, pooled, text_ids(embeds.shape[1], device=device, dtype=dtype)

    def prepare_latents(self, batch_size, height, width, dtype, device, generator=None, latents=None):
        if latents is not None:
            if latents.ndim == 4:  # unpacked [B, C, H, W]
                latents = pack_images(latents)
            return latents.to(device=device, dtype=dtype)
        shape = (batch_size, self.num_channels, height, width)
        noise = randn_tensor(shape, generator=generator, device=torch.device(device), dtype=dtype)
        return pack_images(noise)

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str],
        height: int = 32,
        width: int = 32,
        num_inference_steps: int = DEFAULT_NUM_INFERENCE_STEPS,
        guidance_scale: float = 1.0,
        num_images_per_prompt: int = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        callback_on_step_end: Callable[[Any, int, torch.Tensor, dict], dict] | None = None,
        callback_on_step_end_tensor_inputs: list[str] = ["latents"],  # noqa: B006 (diffusers convention)
    ):
        """Generates images for ``prompt``.

        Args:
            prompt: one prompt or a list, e.g. ``"a red circle on a blue background"``.
            height, width: multiples of 4, at least 16 (trained at 32x32).
            num_inference_steps: Euler steps (default 10).
            guidance_scale: classifier-free guidance against the empty prompt; ``1.0`` (default)
                disables it (one transformer call per step), ``> 1`` does two calls per step.
            generator: torch generator(s) for the initial noise (same seed -> same image).
            latents: optional initial noise, packed [B, (H/2)*(W/2), 12] or unpacked [B, 3, H, W].
            output_type: ``"pil"``, ``"np"`` (float [B, H, W, 3] in [0, 1]) or ``"pt"``
                (float [B, 3, H, W] in [0, 1]); ``"latent"`` returns the packed latents.
            callback_on_step_end: called as ``callback_on_step_end(self, i, t, callback_kwargs)``
                after each scheduler step; may return a dict overriding ``latents``.
        """
        if height % 4 or width % 4 or height < 16 or width < 16:
            raise ValueError(f"height and width must be multiples of 4 and >= 16, got {height}x{width}")
        if output_type not in ("pil", "np", "pt", "latent"):
            raise ValueError(f"output_type must be 'pil', 'np', 'pt' or 'latent', got {output_type!r}")
        for k in callback_on_step_end_tensor_inputs:
            if k not in self._callback_tensor_inputs:
                raise ValueError(f"callback tensor input {k!r} not in {self._callback_tensor_inputs}")

        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        prompts = [p for p in prompts for _ in range(num_images_per_prompt)]
        batch_size = len(prompts)
        device = self._device()
        dtype = self._dtype()
        self._guidance_scale = guidance_scale
        do_cfg = guidance_scale != 1.0

        prompt_embeds, pooled_prompt_embeds, txt_ids = self.encode_prompt(prompts, device=device, dtype=dtype)
        if do_cfg:
            neg_embeds, neg_pooled, _ = self.encode_prompt([""] * batch_size, device=device, dtype=dtype)
        latents = self.prepare_latents(batch_size, height, width, dtype, device, generator, latents)
        img_ids = image_ids(height, width, device=device, dtype=dtype)

        sigmas = np.linspace(1.0, 1.0 / num_inference_steps, num_inference_steps)
        self.scheduler.set_timesteps(sigmas=sigmas, device=device)
        self.scheduler.set_begin_index(0)
        timesteps = self.scheduler.timesteps
        self._num_timesteps = len(timesteps)

        with self.progress_bar(total=num_inference_steps) as progress_bar:
            for i, t in enumerate(timesteps):
                timestep = t.expand(latents.shape[0]).to(latents.dtype) / 1000

                def predict(embeds, pooled):
                    # self.transformer is looked up per call: a compiled replacement is picked up
                    return self.transformer(
                        hidden_states=latents,
                        timestep=timestep,
                        pooled_projections=pooled,
                        encoder_hidden_states=embeds,
                        txt_ids=txt_ids,
                        img_ids=img_ids,
                        return_dict=False,
                    )[0]

                noise_pred = predict(prompt_embeds, pooled_prompt_embeds)
                if do_cfg:
                    neg_pred = predict(neg_embeds, neg_pooled)
                    noise_pred = neg_pred + guidance_scale * (noise_pred - neg_pred)

                latents = self.scheduler.step(noise_pred, t, latents, return_dict=False)[0]
                latents = latents.to(dtype)

                if callback_on_step_end is not None:
                    callback_kwargs = {}
                    for k in callback_on_step_end_tensor_inputs:
                        callback_kwargs[k] = locals()[k]
                    callback_outputs = callback_on_step_end(self, i, t, callback_kwargs) or {}
                    latents = callback_outputs.pop("latents", latents)
                    prompt_embeds = callback_outputs.pop("prompt_embeds", prompt_embeds)
                    pooled_prompt_embeds = callback_outputs.pop("pooled_prompt_embeds", pooled_prompt_embeds)

                progress_bar.update()

        self.maybe_free_model_hooks()

        if output_type == "latent":
            image = latents
        else:
            image = unpack_images(latents.float(), height, width)
            image = (image / 2 + 0.5).clamp(0, 1)
            if output_type == "np":
                image = image.permute(0, 2, 3, 1).cpu().numpy()
            elif output_type == "pil":
                image = self.numpy_to_pil(image.permute(0, 2, 3, 1).cpu().numpy())

        if not return_dict:
            return (image,)
        return ImagePipelineOutput(images=image)
