"""QuantizedLinear: a prepared linear layer that owns its quantized weight.

`fx_fp8.prepare_model(model, config)` (fx_fp8/quant/prepare.py; recommended, `compile_pipeline`
calls it) replaces eligible linears by QuantizedLinear modules that hold only the quantized
weight (fp8/int8), its fp32 scales and (with smoothing) 1/s, as a parameter and buffers:
module state that the graph reads, the state dict saves and `.to()` moves like any other. The
original weights are freed. Every quantized weight is made by
fx_fp8.quant.recipe.WeightRecipe.quantize. (An unprepared model keeps its own weights; the
backend's quantized copies of them live on their modules: fx_fp8/quant/weight_state.py.)

A prepared weight has no original to re-quantize from: its bytes are accepted together with
its scales (prepare_model, a state-dict load) and checked not written since, by fingerprint
once per compiled graph call (fx_fp8/quant/weight_feeds.py) and per eager call, by a byte digest
when the fingerprint moved, after a followed writer ran (fx_fp8/quant/weight_writers.py) or when
`fx_fp8.refresh_weights` / compile_pipeline ask; a write raises naming the layer.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from fx_fp8.graph.dynamo_internals import unwrap_compiled
from fx_fp8.ops.formats import METHODS, WEIGHT_ONLY
from fx_fp8.ops.lowering import resolve_lowering_name
from fx_fp8.quant.recipe import Smoothing, WeightRecipe, recipe
from fx_fp8.quant.weight_state import digest, fingerprint, quantized_copies_of, refresh_copies
from fx_fp8.quant.weight_writers import WRITES, follow_writers

QUANTIZED_DTYPES = tuple(dtype for dtype, _ in METHODS.values())  # fp8, int8
#: attributes in a QuantizedLinear's __dict__: its name for messages, its accepted (fingerprint, digest)
NAME_ATTR, ACCEPTED_ATTR = "_fx_fp8_name", "_fx_fp8_accepted"
#: attribute in a QuantizedLinear's __dict__: the followed writers' count its bytes were last checked at
WRITES_ATTR = "_fx_fp8_writes_seen"


class QuantizedLinear(nn.Module):
    """A linear layer holding only a quantized weight (float8_e4m3fn or int8) and fp32 scales.

    `.to(dtype)` / `.half()` convert the bias and the output dtype and leave the
    quantized weight and its scales as they are; `.to(device)` moves everything.
    """

    _FROZEN_DTYPE = ("weight", "weight_scale", "input_scale", "input_smoothing", "input_step_scales")

    def __init__(
        self,
        weight_q,
        weight_scale,
        bias,
        *,
        method,
        weight_granularity,
        weight_block,
        act_granularity,
        input_scale: Optional[torch.Tensor] = None,
        orig_dtype=torch.bfloat16,
        input_smoothing: Optional[torch.Tensor] = None,
        input_step_scales: Optional[torch.Tensor] = None,
        input_step_groups=None,
        origin: Optional[str] = None,
    ):
        """`input_smoothing`: 1/s (fp32 [in_features]) when the weight was quantized as W * s
        (SmoothQuant): the input is multiplied by it before it is quantized.
        `input_step_scales` (fp32 [n_groups]) with `input_step_groups` (flat [first0, last0, ...]):
        per-step static scales; the group of the published step picks the scale per call
        (`input_scale` when no step is published). `origin`: where the weight's bytes came from
        when they were not quantized here (a pre-quantized checkpoint; the report names it)."""
        super().__init__()
        self.in_features, self.out_features = weight_q.shape[1], weight_q.shape[0]
        # the bias first: diffusers' ModelMixin.dtype is the first floating parameter's, and a quantized
        # (FP8) weight must not become the model's dtype when a prepared layer is its first module
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        self.weight = nn.Parameter(weight_q, requires_grad=False)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("input_scale", input_scale)
        self.register_buffer("input_smoothing", input_smoothing)
        if (input_step_scales is None) != (input_step_groups is None) or (
            input_step_scales is not None
            and (input_scale is None or 2 * input_step_scales.numel() != len(input_step_groups))
        ):
            raise ValueError(
                f"per-step input scales need input_scale, input_step_scales [n] and 2n step group "
                f"bounds; got input_step_groups={input_step_groups!r}"
            )
        self.register_buffer("input_step_scales", input_step_scales)
        self.input_step_groups = tuple(int(v) for v in input_step_groups) if input_step_groups is not None else None
        self.method = method
        self.weight_granularity = weight_granularity
        self.weight_block = list(weight_block or [])
        self.act_granularity = act_granularity
        self.orig_dtype = orig_dtype
        self.origin = origin

    @classmethod
    def from_plan(
        cls,
        plan,
        weight_q,
        weight_scale,
        bias,
        *,
        orig_dtype,
        input_scale: Optional[torch.Tensor] = None,
        input_smoothing: Optional[torch.Tensor] = None,
        input_step_scales: Optional[torch.Tensor] = None,
        origin: Optional[str] = None,
    ) -> "QuantizedLinear":
        """The prepared layer of a quantized (W8A8 or weight-only) `plan` (a LinearPlan: fx_fp8/quant/linear_plan.py):
        its recipe and activation scheme; its static scale and per-step scales unless given as
        tensors (a smoothed layer's scale, a checkpoint's buffers)."""
        r = plan.quantized_recipe()
        device = weight_q.device
        if input_scale is None and plan.static_scale is not None:
            input_scale = torch.tensor(plan.static_scale, dtype=torch.float32, device=device)
        groups = None
        if plan.step_scales is not None:  # per-step scales: a buffer the published step indexes
            groups = plan.step_scales[0]
            if input_step_scales is None and plan.step_scales[1] is not None:
                input_step_scales = torch.tensor(plan.step_scales[1], dtype=torch.float32, device=device)
        return cls(
            weight_q,
            weight_scale,
            bias,
            method=r.method,
            weight_granularity=r.granularity,
            weight_block=r.block,
            act_granularity=plan.act,
            input_scale=input_scale,
            orig_dtype=orig_dtype,
            input_smoothing=input_smoothing,
            input_step_scales=input_step_scales,
            input_step_groups=groups,
            origin=origin,
        )

    @property
    def recipe(self) -> WeightRecipe:
        """How this layer's weight was quantized (a full-precision load is quantized the same way)."""
        return recipe(self.method, self.weight_granularity, tuple(self.weight_block) or None)

    @property
    def weight_only(self) -> bool:
        """W8A16: the quantized weight is dequantized into a matmul with unquantized activations."""
        return self.act_granularity == WEIGHT_ONLY

    # -- the accepted bytes ------------------------------------------------------------------------
    @property
    def layer_name(self) -> str:
        return self.__dict__.get(NAME_ATTR) or "(unnamed)"

    def accept_weight(self, name: str = "") -> None:
        """Record the weight's bytes as the ones its scales describe (prepare_model, a state-dict
        load that sets data and scales together)."""
        if name:
            self.__dict__[NAME_ATTR] = name
        self.__dict__[ACCEPTED_ATTR] = (fingerprint(self.weight), digest(self.weight))
        follow_writers()
        self.__dict__[WRITES_ATTR] = WRITES.count

    def check_weight(self, weight: Optional[torch.Tensor] = None, *, check_bytes: bool = False) -> None:
        """Raise if the weight was replaced by a full-precision tensor or its bytes changed since
        they were accepted (its scales no longer describe it). Cheap unless its fingerprint moved
        (or check_bytes: a digest of the bytes, which also sees writes through `.data`)."""
        w = self.weight if weight is None else weight
        if w.dtype not in QUANTIZED_DTYPES:
            raise RuntimeError(
                f"fx_fp8: prepared layer {self.layer_name} holds a {w.dtype} weight: it was replaced through "
                "`.data` after prepare_model. Load full-precision weights with model.load_state_dict(...) (prepared "
                "layers re-quantize them), or fuse LoRA before prepare_model"
            )
        accepted = self.__dict__.get(ACCEPTED_ATTR)
        if accepted is None:
            return
        fp = fingerprint(w)
        writes = WRITES.count  # a followed writer (EMA swap, LoRA merge) ran since: read the bytes once
        if accepted[0] == fp and not check_bytes and self.__dict__.get(WRITES_ATTR, writes) == writes:
            return
        if digest(w) == accepted[1]:
            self.__dict__[ACCEPTED_ATTR] = (fp, accepted[1])  # moved, or the same bytes written back
            self.__dict__[WRITES_ATTR] = writes
            return
        raise RuntimeError(
            f"fx_fp8: the quantized weight of prepared layer {self.layer_name} was written after prepare_model (its "
            "scales describe other bytes). Load full-precision weights with model.load_state_dict(...) (prepared "
            "layers re-quantize them), fuse LoRA before prepare_model, or restore the model and prepare it again"
        )

    def forward(self, x):
        # Eagerly the lowering follows the device; under fx_fp8's backends the linear pass
        # rewrites this call into the compiled form for the chosen lowering (and the compiled
        # graph's caller checks the weight once per call, outside the graph).
        if not torch.compiler.is_compiling():
            self.check_weight()
        scale = self.input_scale
        if self.input_step_scales is not None:  # looked up from the published step per call (no recompile)
            scale = torch.ops.fx_fp8.step_scale(
                self.input_step_scales, self.input_scale, groups=list(self.input_step_groups)
            )
        return torch.ops.fx_fp8.quantized_linear(
            x,
            self.weight,
            self.weight_scale,
            self.bias,
            scale,
            self.input_smoothing,
            method=self.method,
            weight_granularity=self.weight_granularity,
            weight_block=self.weight_block,
            act_granularity=self.act_granularity,
            lowering=resolve_lowering_name("auto", x.device),
        )

    def _apply(self, fn, recurse=True):
        accepted = self.__dict__.get(ACCEPTED_ATTR)
        accepted = accepted if accepted is not None and accepted[0] == fingerprint(self.weight) else None
        frozen = {}
        for name in self._FROZEN_DTYPE:
            store = self._parameters if name in self._parameters else self._buffers
            frozen[name] = (store, store.pop(name))
        try:
            super()._apply(fn, recurse)
        finally:
            for name, (store, t) in frozen.items():
                if t is not None:
                    moved = fn(t)  # only its device is kept: a dtype cast would destroy the quantized data
                    moved = moved if moved.dtype == t.dtype else t.to(moved.device)
                    if isinstance(t, nn.Parameter):
                        # the same Parameter object where the storage allows, as nn.Module._apply: group
                        # offloading and optimizers hold parameters by identity, a new object leaves theirs stale
                        if moved is not t and torch._has_compatible_shallow_copy_type(t, moved):
                            t.data = moved.detach()
                            moved = t
                        elif moved is not t:
                            moved = nn.Parameter(moved.detach(), requires_grad=False)
                    t = moved
                store[name] = t
        if accepted is not None:  # the same bytes moved: still accepted, no byte read
            self.__dict__[ACCEPTED_ATTR] = (fingerprint(self.weight), accepted[1])
        if self.bias is not None:
            self.orig_dtype = self.bias.dtype
        else:
            probe = fn(torch.empty((), dtype=self.orig_dtype))
            self.orig_dtype = probe.dtype if probe.is_floating_point() else self.orig_dtype
        return self

    def extra_repr(self):
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.method} {self.weight_granularity} scales"
            + (", weight-only" if self.weight_only else "")
            + (", smoothed inputs" if self.input_smoothing is not None else "")
            + (
                f", per-step input scales ({self.input_step_scales.numel()} step groups)"
                if self.input_step_scales is not None
                else ""
            )
        )

    # -- loading state: a full-precision weight is re-quantized, a quantized one comes with its scale
    _FULL_PRECISION = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

    def _check_incoming(self, state_dict, prefix: str) -> Optional[str]:
        """What is wrong with this layer's entries in `state_dict` (None: loadable)."""
        name = prefix[:-1] or self.layer_name
        w, s = state_dict.get(prefix + "weight"), state_dict.get(prefix + "weight_scale")
        if w is None:
            return (
                None
                if s is None
                else (
                    f"{name}: a weight_scale without its weight (the scale of a quantized "
                    "weight is only valid with that weight)"
                )
            )
        if tuple(w.shape) != (self.out_features, self.in_features):
            return f"{name}: weight of shape {list(w.shape)}, the layer is [{self.out_features}, {self.in_features}]"
        if w.dtype in self._FULL_PRECISION:
            if s is not None:
                return (
                    f"{name}: a full-precision ({w.dtype}) weight comes with a weight_scale; give the "
                    "full-precision weight alone (it is re-quantized) or the quantized weight with its scale"
                )
            smoothing = state_dict.get(prefix + "input_smoothing")
            if smoothing is not None and tuple(smoothing.shape) != (self.in_features,):
                return f"{name}: input_smoothing of shape {list(smoothing.shape)}, expected [{self.in_features}]"
            return None
        if w.dtype != self.weight.dtype:
            return (
                f"{name}: a {w.dtype} weight, the layer holds {self.weight.dtype} ({self.method}); "
                "load a full-precision weight to re-quantize it"
            )
        if s is None:
            return (
                f"{name}: {w.dtype} weight data without its weight_scale (quantized codes alone cannot be dequantized)"
            )
        if tuple(s.shape) != tuple(self.weight_scale.shape):
            return (
                f"{name}: weight_scale of shape {list(s.shape)}, the layer's {self.weight_granularity} "
                f"scales are {list(self.weight_scale.shape)}"
            )
        return None

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        problem = self._check_incoming(state_dict, prefix)
        if problem:
            raise ValueError(f"fx_fp8: cannot load into prepared layer {problem}")
        w = state_dict.get(prefix + "weight")
        if w is not None and w.dtype in self._FULL_PRECISION:
            # quantized with this layer's own recipe; smoothed layers store quantize(W * s), s = 1 / input_smoothing
            state_dict = {k: v for k, v in state_dict.items() if k.startswith(prefix)}
            for key in ("input_scale", "input_smoothing", "input_step_scales"):
                if prefix + key not in state_dict and getattr(self, key) is not None:
                    state_dict[prefix + key] = getattr(self, key)
            inverse = state_dict.get(prefix + "input_smoothing")
            wq, ws = self.recipe.quantize(w, Smoothing.from_inverse(inverse) if inverse is not None else None)
            state_dict[prefix + "weight"], state_dict[prefix + "weight_scale"] = wq, ws
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if w is not None and not self.weight.is_meta:  # new bytes and their scales, set together
            self.accept_weight(prefix[:-1])


def reachable_tensor_bytes(obj) -> int:
    """Bytes of every distinct tensor storage reachable from a model or compiled model:
    parameters, buffers, and the quantized copies the backend keeps on its modules."""
    seen, total = set(), 0

    def add(t: torch.Tensor):
        nonlocal total
        st = t.untyped_storage()
        key = (st.data_ptr(), st.device.type)
        if key not in seen:
            seen.add(key)
            total += st.nbytes()

    module = unwrap_compiled(obj)
    tensors = list(module.parameters()) + list(module.buffers()) if isinstance(module, nn.Module) else []
    for t in tensors:
        add(t)
    if isinstance(module, nn.Module):
        for t in quantized_copies_of(module):
            add(t)
    return total


def refresh_weights(model: nn.Module) -> list[str]:
    """After writing a compiled model's weights through `.data` in place (which no per-call
    check can see without reading the bytes): re-quantize, in place, every compile-time copy
    whose source bytes changed, and check every prepared layer's bytes (raising, naming the
    layer, for one written since prepare_model). Reads each weight once. compile_pipeline
    runs it at the start of every pipeline call. Returns the names of the re-quantized weights."""
    module = unwrap_compiled(model)
    if not isinstance(module, nn.Module):
        raise ValueError(f"refresh_weights expects a torch.nn.Module, got {type(model).__name__}")
    for m in module.modules():
        if isinstance(m, QuantizedLinear):
            m.check_weight(check_bytes=True)
    return refresh_copies(module)
