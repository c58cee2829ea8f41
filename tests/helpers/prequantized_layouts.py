"""Test helpers: tiny pre-quantized FP8 checkpoints written in the two layouts fx_fp8 recognises,
and the modules that hold them (docs/prequantized.md).

* BFL fp8r: diffusers' own quantize_fp8r (weight e4m3 [N, K], fp32 weight_scale [N]), loaded by
  diffusers' from_single_file with BFLQuantizationConfig into its BFLFP8RLinear modules.
* ModelOpt FP8 (the HF export vLLM serves): weight e4m3 [N, K], fp32 weight_scale [] (per tensor)
  or [N] (per channel), optional fp32 input_scale [] (static activations, x / input_scale clamped
  to +-448). ModelOptLayoutLinear holds it and dequantizes in its forward as ModelOpt's FP8QTensor
  does (`q.to(dtype) * scale.to(dtype)`), fake-quantizing its input with the static scale.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def modelopt_quantize(w: torch.Tensor, per_channel: bool, scale_shape=None):
    """(e4m3 weight, fp32 scale) as ModelOpt exports them: scale = amax / 448, per tensor or per row."""
    w = w.detach().float()
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax()
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    q = (w / (scale[:, None] if per_channel else scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.reshape(scale_shape) if scale_shape is not None else scale


def fake_quant_input(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """ModelOpt's static FP8 input quantizer, as a fake quantization in x's dtype."""
    return (x / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).to(x.dtype) * input_scale


class ModelOptLayoutLinear(nn.Module):
    """A linear holding a ModelOpt FP8 export's tensors, dequantizing them in its forward."""

    def __init__(self, weight, weight_scale, bias=None, input_scale=None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("input_scale", input_scale)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x):
        if self.input_scale is not None:
            x = fake_quant_input(x, self.input_scale)
        scale = self.weight_scale
        if scale.numel() > 1:
            scale = scale.reshape(-1, 1)
        return F.linear(x, self.weight.to(x.dtype) * scale.to(x.dtype), self.bias)


class Stack(nn.Module):
    """Linears in sequence with a GELU between (a tiny stand-in for a transformer's MLPs)."""

    def __init__(self, *layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == 0 else layer(F.gelu(x))
        return x


def float_stack(dims=(64, 96, 64), dtype=torch.bfloat16, seed=0) -> Stack:
    g = torch.Generator().manual_seed(seed)
    layers = []
    for k, n in zip(dims[:-1], dims[1:]):
        lin = nn.Linear(k, n)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
            lin.bias.copy_(torch.randn(n, generator=g) * 0.1)
        layers.append(lin.to(dtype))
    return Stack(*layers)


def input_amax(model: nn.Module, x: torch.Tensor) -> dict:
    """max |input| of every nn.Linear of `model` on `x` (a calibration, for static input scales)."""
    seen, hooks = {}, []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            hooks.append(
                m.register_forward_pre_hook(
                    lambda mod, args, name=name: seen.__setitem__(name, float(args[0].abs().amax()))
                )
            )
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return seen


def modelopt_state_dict(model: nn.Module, *, per_channel: bool, static_x=None, scale_shape=None, names=None) -> dict:
    """The ModelOpt FP8 export of `model`'s linears (all, or `names`): {name.weight, name.weight_scale,
    name.input_scale (with `static_x`, calibrated on it), name.bias} plus every other tensor as is."""
    amax = input_amax(model, static_x) if static_x is not None else {}
    sd = dict(model.state_dict())
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and (names is None or name in names):
            sd[f"{name}.weight"], sd[f"{name}.weight_scale"] = modelopt_quantize(m.weight, per_channel, scale_shape)
            if static_x is not None:
                sd[f"{name}.input_scale"] = torch.tensor(amax[name] / FP8_MAX, dtype=torch.float32)
    return sd


def modelopt_stack(sd: dict, n_layers: int) -> Stack:
    """A Stack of ModelOptLayoutLinear modules holding the export `sd` (the very tensors)."""
    return Stack(
        *[
            ModelOptLayoutLinear(
                sd[f"layers.{i}.weight"],
                sd[f"layers.{i}.weight_scale"],
                sd.get(f"layers.{i}.bias"),
                sd.get(f"layers.{i}.input_scale"),
            )
            for i in range(n_layers)
        ]
    )


def bfl_checkpoint(model: nn.Module, names=None) -> dict:
    """An fp8r checkpoint of `model` in diffusers' layout: quantize_fp8r on each linear (all, or
    `names`), the other tensors as they are."""
    from diffusers.quantizers.bfl.utils import quantize_fp8r

    sd = dict(model.state_dict())
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and (names is None or name in names):
            sd[f"{name}.weight"], sd[f"{name}.weight_scale"] = quantize_fp8r(m.weight)
    return sd


def bfl_stack(sd: dict, n_layers: int, dims, compute_dtype=torch.bfloat16) -> Stack:
    """A Stack of diffusers' BFLFP8RLinear modules holding the fp8r checkpoint `sd` (the very tensors)."""
    from diffusers.quantizers.bfl.utils import BFLFP8RLinear

    layers = []
    for i, (k, n) in enumerate(zip(dims[:-1], dims[1:])):
        lin = BFLFP8RLinear(k, n, True, compute_dtype=compute_dtype)
        lin.weight = nn.Parameter(sd[f"layers.{i}.weight"], requires_grad=False)
        lin.weight_scale = sd[f"layers.{i}.weight_scale"]
        lin.bias = nn.Parameter(sd[f"layers.{i}.bias"], requires_grad=False)
        layers.append(lin)
    return Stack(*layers)


def bfl_flux(tmp_path, dtype=torch.bfloat16):
    """(tiny Flux loaded through diffusers' BFL fp8r path, the checkpoint dict): every linear of its
    transformer blocks quantized with quantize_fp8r, the rest in `dtype`;
    FluxTransformer2DModel.from_single_file(checkpoint, config=..., quantization_config=BFLQuantizationConfig)."""
    from diffusers import BFLQuantizationConfig, FluxTransformer2DModel

    from fx_fp8.tools.model_zoo.registry import build_tiny_transformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny_transformer("flux")
    model.save_config(tmp_path)
    names = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and n.startswith(("transformer_blocks.", "single_transformer_blocks."))
    ]
    sd = bfl_checkpoint(model.to(dtype), names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = FluxTransformer2DModel.from_single_file(
            sd, config=str(tmp_path), quantization_config=BFLQuantizationConfig(compute_dtype=dtype), torch_dtype=dtype
        )
    return loaded.eval(), sd
