"""The one path to quantize a weight: a WeightRecipe (method, granularity, block) and, with
SmoothQuant-style smoothing, the one rule that makes a group's Smoothing (group_smoothing).

Every quantized weight is made by WeightRecipe.quantize: prepare_model's QuantizedLinear
weights, the linear pass's compile-time copies (kept per weight version in fx_fp8.quant.weight_state's
WeightState), a prepared layer loading full-precision weights, and the fake quantization of
FP8-aware training. A change of recipe (a granularity, a smoothing rule) is made here.

group_smoothing takes the (channel maxima, weight) pairs of the linears that share one
activation quantization: prepare_model passes one layer (it sees no graph, so no groups), the
linear pass the members of a group (they read one smoothed activation, so one s for all).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from fx_fp8.ops import quant
from fx_fp8.ops.formats import METHODS

#: weight scale granularities: one per tensor, per output channel, per [rows, cols] block
GRANULARITIES = ("tensor", "channel", "block")


@dataclass(frozen=True, eq=False)
class Smoothing:
    """SmoothQuant factors of one activation-quantization group: the weight columns are
    multiplied by `factors` (s) before quantization, the activation by `inverse` (1/s)."""

    alpha: Optional[float]  # None: factors read back from a stored 1/s (a state-dict load)
    factors: torch.Tensor  # s, fp32 [in_features], on the CPU
    inverse: torch.Tensor  # 1/s, fp32 [in_features], on the weight's device
    key: tuple  # ("smooth", alpha, digest of s): part of a quantized copy's cache key

    @classmethod
    def make(cls, factors: torch.Tensor, alpha: Optional[float], device=None) -> "Smoothing":
        s = factors.detach().float().cpu().contiguous()
        digest = hashlib.sha1(s.numpy().tobytes()).hexdigest()[:16]
        alpha = None if alpha is None else float(alpha)
        return cls(alpha, s, (1.0 / s).to(device or "cpu"), ("smooth", alpha, digest))

    @classmethod
    def from_inverse(cls, inverse: torch.Tensor) -> "Smoothing":
        """The smoothing of a layer that stores 1/s (QuantizedLinear.input_smoothing)."""
        inv = inverse.detach().float()
        return cls.make(1.0 / inv, None, device=inv.device)


def group_smoothing(members: Iterable[tuple[torch.Tensor, torch.Tensor]], alpha: float, device=None) -> Smoothing:
    """One Smoothing for linears that share one activation quantization. `members`: their
    (calibrated per-channel |x| maxima [K], weight [N, K]) pairs; s = max_members(amax)^alpha /
    max_members(|W[:, j]|)^(1 - alpha) (quant.smoothing_factors). 1/s goes to `device`
    (default: the first weight's)."""
    members = list(members)
    if not members:
        raise ValueError("group_smoothing needs at least one (channel maxima, weight) pair, got none")
    for amax, w in members:
        if w.dim() != 2 or amax.numel() != w.shape[1]:
            raise ValueError(
                f"group_smoothing: channel maxima of {amax.numel()} values for a weight of shape "
                f"{list(w.shape)} (one value per input feature expected)"
            )
    with torch.no_grad():
        amax = functools.reduce(torch.maximum, [a for a, _ in members])
        wmax = functools.reduce(torch.maximum, [w.detach().abs().amax(dim=0).float().cpu() for _, w in members])
        factors = quant.smoothing_factors(amax, wmax, alpha)
    return Smoothing.make(factors, alpha, device=members[0][1].device if device is None else device)


@dataclass(frozen=True)
class WeightRecipe:
    """How a [out, in] weight is quantized: `method` (fp8 / int8), scale `granularity`
    (tensor, channel, block) and, for block, its [rows, cols]."""

    method: str = "fp8"
    granularity: str = "channel"
    block: Optional[tuple] = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown weight quantization method {self.method!r}: expected one of {sorted(METHODS)}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"unknown weight granularity {self.granularity!r}: expected one of {list(GRANULARITIES)}")
        block = None
        if self.granularity == "block":
            try:
                block = tuple(int(v) for v in self.block)
            except TypeError:
                block = ()
            if len(block) != 2 or min(block) < 1:
                raise ValueError(
                    f"weight granularity 'block' needs a block [rows, cols] of two positive integers, "
                    f"got {self.block!r}"
                )
        object.__setattr__(self, "block", block)  # tensor / channel scales have no block: one cache key

    @classmethod
    def w8a8(cls, qcfg) -> "WeightRecipe":
        """The weights of W8A8 linears: quantization_config method / weight_granularity / weight_block_size."""
        return recipe(qcfg.method, qcfg.weight_granularity, _tuple(qcfg.weight_block_size))

    @classmethod
    def weight_only(cls, qcfg, lowering) -> "WeightRecipe":
        """Weight-only (W8A16) storage: weight_only_method (None: method) as `lowering`'s weight-only
        matmul takes it, one scale per output channel, or per weight_only_group_size input columns."""
        method = lowering.weight_only_method(qcfg.weight_only_method or qcfg.method)
        return recipe(method, *quant.weight_only_layout(qcfg.weight_only_group_size))

    @property
    def key(self) -> tuple:
        return (self.method, self.granularity, self.block)

    def quantize(self, weight: torch.Tensor, smoothing: Optional[Smoothing] = None):
        """(quantized weight, fp32 scale) of `weight` (of W * s with `smoothing`); never tracks grad."""
        if weight.dim() != 2:
            raise ValueError(f"a weight to quantize must be [out, in], got shape {list(weight.shape)}")
        with torch.no_grad():
            w = weight.detach()
            if smoothing is not None:
                if smoothing.factors.numel() != w.shape[1]:
                    raise ValueError(
                        f"smoothing of {smoothing.factors.numel()} factors for a weight of shape {list(w.shape)}"
                    )
                w = w.float() * smoothing.factors.to(w.device)
            return quant.quantize_weight(w, self.granularity, self.block, self.method)

    def dequantize(self, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
        """float32 weight back from its quantized form (the values the kernels multiply)."""
        return quant.dequantize_weight(wq, ws, self.granularity, self.block)


def _tuple(block):
    return tuple(block) if block is not None else None


@functools.lru_cache(maxsize=None)
def recipe(method: str, granularity: str, block: Optional[tuple] = None) -> WeightRecipe:
    """The WeightRecipe of these attributes, made once (the run-time ops look it up per call)."""
    return WeightRecipe(method, granularity, block)
