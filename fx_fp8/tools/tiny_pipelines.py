"""Real diffusers pipelines built offline from tiny random components, by name (see
fx_fp8/tools/model_zoo/pipelines.py): ``build_tiny_pipeline("flux")`` returns ``(pipe, call_kwargs)``.
The transformers are the families' entries of the registry fx_fp8.tools.model_zoo."""
from fx_fp8.tools.model_zoo import TINY_PIPELINES, build_tiny_pipeline
from fx_fp8.tools.model_zoo.pipelines import tiny_flux, tiny_qwen_image, tiny_sd3, tiny_wan, tiny_z_image

__all__ = ["TINY_PIPELINES", "build_tiny_pipeline", "tiny_flux", "tiny_qwen_image", "tiny_sd3", "tiny_wan",
           "tiny_z_image"]
