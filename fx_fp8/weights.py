"""Quantized weights are model state: quantized once per weight version, owned by that weight.

Every quantized weight is made by fx_fp8.weight_recipe.WeightRecipe.quantize (one recipe,
one smoothing rule); this module is where the results live. They have two homes, because
there are two kinds of model:
* A prepared model owns its FP8/INT8 weights. `fx_fp8.prepare_model(model, config)`
  (fx_fp8/prepare.py; recommended, `compile_pipeline` calls it) replaces eligible linears
  by QuantizedLinear modules that hold only the quantized weight, its fp32 scales and (with
  smoothing) 1/s, as a parameter and buffers: module state that the graph reads, the state
  dict saves and `.to()` moves like any other. The original weights are freed.
* An unprepared model keeps its own weights, and the backend keeps a copy per weight
  version. `torch.compile(model, backend="fp8")` alone quantizes each weight at compile
  time into the weight's WeightState: a side table keyed by the weight tensor (never
  attributes on the model's Parameter), one entry per recipe/smoothing, found at run time
  from the weight the graph is called with, so every graph of the model, both step variants
  and another instance of the same class each use their own weight's copy.

Weights change after compiling (LoRA fusion, loaders, EMA swaps), often through
`.data`, which bumps no version counter. Each weight the backend quantizes (and
each prepared weight) becomes a WatchedParameter: an nn.Parameter whose `.data`
accessor counts its uses. A copy is valid for one fingerprint (version counter,
storage address, `.data` uses, dtype, device) and is remade, once, on the first
call after the fingerprint moved. A prepared weight has no original to
re-quantize from: when its fingerprint moves and its bytes changed, the call
raises naming the layer (a read through `.data` changes no byte and passes).

With SmoothQuant-style smoothing (quantization_config.smoothing_alpha) the
quantized copy is that of W * s (its key includes alpha and a digest of s), and
the Smoothing (s and 1/s) is kept in the weight's state per alpha, for the
fx_fp8::input_smoothing op to read at run time (never baked into a graph:
Dynamo shares one graph between model instances).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from fx_fp8.ops.lowering import resolve_lowering_name
from fx_fp8.weight_recipe import Smoothing, WeightRecipe, recipe

QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.int8)
#: a QuantizedLinear's act_granularity when it is weight-only (W8A16): activations stay unquantized
WEIGHT_ONLY = "weight_only"


class WatchedParameter(nn.Parameter):
    """An nn.Parameter that counts uses of its `.data` accessor (reads and writes alike:
    `w.data.add_(d)`, `w.data.copy_(v)`, `w.data = v` bump no version counter, so a
    quantized copy of this weight cannot otherwise tell it is stale)."""

    @property
    def data(self):
        self.__dict__["_data_uses"] = self.__dict__.get("_data_uses", 0) + 1
        return nn.Parameter.data.__get__(self)

    @data.setter
    def data(self, value):
        self.__dict__["_data_uses"] = self.__dict__.get("_data_uses", 0) + 1
        nn.Parameter.data.__set__(self, value)


def watch(weight: torch.Tensor) -> bool:
    """Make `weight` a WatchedParameter in place (same object, same storage); False where it
    cannot be (a plain tensor or another Parameter subclass): then only in-place writes that
    bump its version counter are seen."""
    if type(weight) is WatchedParameter:
        return True
    if type(weight) is nn.Parameter:
        weight.__class__ = WatchedParameter
        return True
    return False


def watch_weights(model: nn.Module) -> int:
    """Watch every weight-like (2-D or larger) parameter of `model` (returns how many are
    watched). Done before Dynamo guards on their type (the backend, prepare_model and
    compile_pipeline call it), so every instance of a class keeps sharing one graph."""
    return sum(watch(p) for p in model.parameters() if p.dim() >= 2)


def fingerprint(weight: torch.Tensor) -> tuple:
    """What changes when the weight's values may have changed (cheap: no byte is read)."""
    return (weight._version, weight.data_ptr(), weight.__dict__.get("_data_uses", 0), weight.dtype, weight.device)


@dataclass(eq=False)
class WeightState:
    """What fx_fp8 keeps for one weight tensor: its quantized copies, its group's smoothing,
    its calibrated activation scale, and (for a prepared weight) the digest of its bytes."""

    name: str = ""                                   # the owning linear's name, for messages
    copies: dict = field(default_factory=dict)       # key -> (fingerprint, wq, ws)
    smoothing: dict = field(default_factory=dict)    # alpha -> Smoothing
    input_scale: Optional[torch.Tensor] = None
    input_step_scales: Optional[tuple] = None        # per-step scales: (flat step groups, fp32 [n_groups])
    prepared: Optional[tuple] = None                 # (fingerprint, digest) of a prepared weight's accepted bytes
    quantizations: int = 0                           # how often a copy of this weight was (re)made
    left_by_prepare: str = ""                        # why prepare_model left its linear unreplaced (hooks)


#: weight tensor -> WeightState; an entry lives as long as its weight (or until released)
_STATES: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: total (re)quantizations of unprepared weights in this process (tests count re-quantization with it)
QUANTIZATIONS = {"count": 0}


def state_of(weight: torch.Tensor, name: str = "") -> WeightState:
    st = _STATES.get(weight)
    if st is None:
        st = _STATES[weight] = WeightState(name=name)
        watch(weight)
    elif name and not st.name:
        st.name = name
    return st


def quantized_weight(weight: torch.Tensor, recipe: WeightRecipe, smoothing: Optional[Smoothing] = None,
                     name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """(quantized weight, fp32 scale) of `weight` (of W * s with `smoothing`) by `recipe`, made
    once per recipe (and smoothing) and weight fingerprint, kept in the weight's WeightState."""
    key = recipe.key + ((smoothing.key,) if smoothing is not None else ())
    st = state_of(weight, name)
    fp = fingerprint(weight)
    entry = st.copies.get(key)
    if entry is None or entry[0] != fp:
        wq, ws = recipe.quantize(weight, smoothing)
        entry = st.copies[key] = (fp, wq, ws)
        st.quantizations += 1
        QUANTIZATIONS["count"] += 1
    return entry[1], entry[2]


def mark_left_by_prepare(weight: torch.Tensor, name: str, reason: str) -> None:
    """prepare_model left the linear owning `weight` unreplaced (`reason`): the backend quantizes
    it at compile time and says why the model still holds that original weight."""
    state_of(weight, name).left_by_prepare = reason


def left_by_prepare(weight: torch.Tensor) -> str:
    """Why prepare_model left the linear owning `weight` unreplaced ("" if it did not)."""
    st = _STATES.get(weight)
    return st.left_by_prepare if st is not None else ""


def _digest(weight: torch.Tensor) -> str:
    data = weight.detach().contiguous().view(torch.uint8).cpu()
    return hashlib.blake2b(data.numpy().tobytes(), digest_size=16).hexdigest()


def accept_prepared_weight(weight: torch.Tensor, name: str = "") -> None:
    """Record a prepared (FP8/INT8) weight's bytes as valid for its scales: prepare_model and a
    state-dict load that sets data and scales together call it."""
    st = state_of(weight, name)
    st.prepared = (fingerprint(weight), _digest(weight))


def check_prepared_weight(weight: torch.Tensor) -> None:
    """Raise if a prepared weight's bytes changed since they were accepted (a write through
    `.data` or in place: its scales no longer describe it). Cheap unless its fingerprint moved."""
    st = _STATES.get(weight)
    if weight.dtype not in QUANTIZED_DTYPES:
        raise RuntimeError(
            f"fx_fp8: prepared layer {st.name if st is not None and st.name else '(unnamed)'} holds a {weight.dtype} "
            "weight: it was replaced through `.data` after prepare_model. Load full-precision weights with "
            "model.load_state_dict(...) (prepared layers re-quantize them), or fuse LoRA before prepare_model")
    if st is None or st.prepared is None:
        return
    fp = fingerprint(weight)
    if st.prepared[0] == fp:
        return
    if _digest(weight) == st.prepared[1]:
        st.prepared = (fp, st.prepared[1])  # read through .data, or moved: same bytes
        return
    raise RuntimeError(
        f"fx_fp8: the quantized weight of prepared layer {st.name or '(unnamed)'} was written after "
        "prepare_model (its scales describe other bytes). Load full-precision weights with "
        "model.load_state_dict(...) (prepared layers re-quantize them), fuse LoRA before prepare_model, or "
        "restore the model and prepare it again")


def attach_smoothing(weight: torch.Tensor, smoothing: Smoothing, name: str = "") -> None:
    """Keep the smoothing of the group the linear owning `weight` belongs to (one per alpha:
    a later compile with the same alpha replaces it)."""
    state_of(weight, name).smoothing[smoothing.alpha] = smoothing


def smoothing_of(weight: torch.Tensor, alpha: float) -> Smoothing:
    st = _STATES.get(weight)
    entry = st.smoothing.get(float(alpha)) if st is not None else None
    if entry is None:
        raise RuntimeError(
            f"fx_fp8: no smoothing (alpha {alpha:g}) recorded for this weight (a graph compiled for another model "
            "instance?); call fx_fp8.prepare_model(model, config) before torch.compile")
    return entry


def smoothed_quantized_weight(weight: torch.Tensor, alpha: float, recipe: WeightRecipe) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantized W * s of `weight` for its recorded smoothing of `alpha` (run time)."""
    return quantized_weight(weight, recipe, smoothing_of(weight, alpha))


def quantized_copies(weight: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The quantized copies kept for `weight` (for memory accounting; a smoothing's 1/s
    vector is counted with its copy)."""
    st = _STATES.get(weight)
    if st is None:
        return []
    copies = [(wq, ws) for _, wq, ws in st.copies.values()]
    return copies + [(sm.inverse, sm.factors) for sm in st.smoothing.values()]


def release_quantized_copies(module: nn.Module) -> int:
    """Drop every quantized copy, smoothing and static scale the compile path made for the
    parameters and buffers of `module` (prepared layers keep their own weights). Returns the
    bytes released; a graph compiled before re-quantizes on its next call."""
    released = 0
    for t in list(module.parameters()) + [b for b in module.buffers() if b is not None]:
        st = _STATES.get(t)
        if st is None:
            continue
        released += sum(wq.numel() * wq.element_size() + ws.numel() * ws.element_size()
                        for _, wq, ws in st.copies.values())
        st.copies.clear()  # smoothing vectors and static scales are tiny: a compiled graph still needs them
    return released


def carry_state(old: torch.Tensor, new: torch.Tensor) -> None:
    """`new` is `old` moved (same bytes, another device or object): it keeps old's record, and
    a prepared weight's accepted digest (no byte is read)."""
    st = _STATES.get(old)
    if st is None:
        return
    moved = st if new is old else state_of(new, st.name)  # the same object moved through .data: its own record
    moved.smoothing = dict(st.smoothing)
    moved.input_scale = st.input_scale.to(new.device) if st.input_scale is not None else None
    if st.input_step_scales is not None:
        moved.input_step_scales = (st.input_step_scales[0], st.input_step_scales[1].to(new.device))
    if st.prepared is not None:
        moved.prepared = (fingerprint(new), st.prepared[1])


def attach_static_input_scale(weight: torch.Tensor, scale: float, name: str = "", steps=None) -> None:
    """Keep the calibrated activation scale of the linear that owns `weight`; `steps`:
    (flat step groups, [scale per group]) for per-step scales (linear_scales.step_scale_table)."""
    st = state_of(weight, name)
    st.input_scale = torch.tensor(scale, dtype=torch.float32, device=weight.device)
    st.input_step_scales = None if steps is None else (
        tuple(steps[0]), torch.tensor(steps[1], dtype=torch.float32, device=weight.device))


def static_step_input_scales(weight: torch.Tensor) -> tuple:
    """(flat step groups, fp32 [n_groups] scales, all-steps scale) attached to `weight`; a weight
    with one static scale gives ((), None, scale)."""
    fallback = static_input_scale(weight)
    steps = _STATES[weight].input_step_scales
    return (steps[0], steps[1], fallback) if steps is not None else ((), None, fallback)


def static_input_scale(weight: torch.Tensor) -> torch.Tensor:
    st = _STATES.get(weight)
    scale = st.input_scale if st is not None else None
    if scale is None:
        raise RuntimeError(
            "fx_fp8: no static activation scale recorded for this weight (a graph compiled for another "
            "model instance?); call fx_fp8.prepare_model(model, config) before torch.compile"
        )
    return scale


class QuantizedLinear(nn.Module):
    """A linear layer holding only a quantized weight (float8_e4m3fn or int8) and fp32 scales.

    `.to(dtype)` / `.half()` convert the bias and the output dtype and leave the
    quantized weight and its scales as they are; `.to(device)` moves everything.
    """

    _FROZEN_DTYPE = ("weight", "weight_scale", "input_scale", "input_smoothing", "input_step_scales")

    def __init__(self, weight_q, weight_scale, bias, *, method, weight_granularity, weight_block, act_granularity,
                 input_scale: Optional[torch.Tensor] = None, orig_dtype=torch.bfloat16,
                 input_smoothing: Optional[torch.Tensor] = None, input_step_scales: Optional[torch.Tensor] = None,
                 input_step_groups=None):
        """`input_smoothing`: 1/s (fp32 [in_features]) when the weight was quantized as W * s
        (SmoothQuant): the input is multiplied by it before it is quantized.
        `input_step_scales` (fp32 [n_groups]) with `input_step_groups` (flat [first0, last0, ...]):
        per-step static scales; the group of the published step picks the scale per call
        (`input_scale` when no step is published)."""
        super().__init__()
        self.in_features, self.out_features = weight_q.shape[1], weight_q.shape[0]
        # the bias first: diffusers' ModelMixin.dtype is the first floating parameter's, and a quantized
        # (FP8) weight must not become the model's dtype when a prepared layer is its first module
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        self.weight = WatchedParameter(weight_q, requires_grad=False)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("input_scale", input_scale)
        self.register_buffer("input_smoothing", input_smoothing)
        if (input_step_scales is None) != (input_step_groups is None) or (input_step_scales is not None and (
                input_scale is None or 2 * input_step_scales.numel() != len(input_step_groups))):
            raise ValueError(f"per-step input scales need input_scale, input_step_scales [n] and 2n step group "
                             f"bounds; got input_step_groups={input_step_groups!r}")
        self.register_buffer("input_step_scales", input_step_scales)
        self.input_step_groups = tuple(int(v) for v in input_step_groups) if input_step_groups is not None else None
        self.method = method
        self.weight_granularity = weight_granularity
        self.weight_block = list(weight_block or [])
        self.act_granularity = act_granularity
        self.orig_dtype = orig_dtype

    @property
    def recipe(self) -> WeightRecipe:
        """How this layer's weight was quantized (a full-precision load is quantized the same way)."""
        return recipe(self.method, self.weight_granularity, tuple(self.weight_block) or None)

    @property
    def weight_only(self) -> bool:
        """W8A16: the quantized weight is dequantized into a matmul with unquantized activations."""
        return self.act_granularity == WEIGHT_ONLY

    def forward(self, x):
        # Eagerly the lowering follows the device; under fx_fp8's backends the linear pass
        # rewrites this call into the compiled form for the chosen lowering.
        scale = self.input_scale
        if self.input_step_scales is not None:  # looked up from the published step per call (no recompile)
            scale = torch.ops.fx_fp8.step_scale(self.input_step_scales, self.input_scale,
                                                groups=list(self.input_step_groups))
        return torch.ops.fx_fp8.quantized_linear(
            x, self.weight, self.weight_scale, self.bias, scale, self.input_smoothing, method=self.method,
            weight_granularity=self.weight_granularity, weight_block=self.weight_block,
            act_granularity=self.act_granularity, lowering=resolve_lowering_name("auto", x.device),
        )

    def _apply(self, fn, recurse=True):
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
                            moved = WatchedParameter(moved.detach(), requires_grad=False)
                    carry_state(t, moved)
                    t = moved
                store[name] = t
        if self.bias is not None:
            self.orig_dtype = self.bias.dtype
        else:
            probe = fn(torch.empty((), dtype=self.orig_dtype))
            self.orig_dtype = probe.dtype if probe.is_floating_point() else self.orig_dtype
        return self

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.method} {self.weight_granularity} scales"
                + (", weight-only" if self.weight_only else "")
                + (", smoothed inputs" if self.input_smoothing is not None else "")
                + (f", per-step input scales ({self.input_step_scales.numel()} step groups)"
                   if self.input_step_scales is not None else ""))

    # -- loading state: a full-precision weight is re-quantized, a quantized one comes with its scale
    _FULL_PRECISION = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

    def _check_incoming(self, state_dict, prefix: str) -> Optional[str]:
        """What is wrong with this layer's entries in `state_dict` (None: loadable)."""
        st = _STATES.get(self.weight)
        name = prefix[:-1] or (st.name if st is not None and st.name else "(unnamed)")
        w, s = state_dict.get(prefix + "weight"), state_dict.get(prefix + "weight_scale")
        if w is None:
            return None if s is None else (f"{name}: a weight_scale without its weight (the scale of a quantized "
                                           "weight is only valid with that weight)")
        if tuple(w.shape) != (self.out_features, self.in_features):
            return (f"{name}: weight of shape {list(w.shape)}, the layer is "
                    f"[{self.out_features}, {self.in_features}]")
        if w.dtype in self._FULL_PRECISION:
            if s is not None:
                return (f"{name}: a full-precision ({w.dtype}) weight comes with a weight_scale; give the "
                        "full-precision weight alone (it is re-quantized) or the quantized weight with its scale")
            smoothing = state_dict.get(prefix + "input_smoothing")
            if smoothing is not None and tuple(smoothing.shape) != (self.in_features,):
                return f"{name}: input_smoothing of shape {list(smoothing.shape)}, expected [{self.in_features}]"
            return None
        if w.dtype != self.weight.dtype:
            return (f"{name}: a {w.dtype} weight, the layer holds {self.weight.dtype} ({self.method}); "
                    "load a full-precision weight to re-quantize it")
        if s is None:
            return (f"{name}: {w.dtype} weight data without its weight_scale (quantized codes alone "
                    "cannot be dequantized)")
        if tuple(s.shape) != tuple(self.weight_scale.shape):
            return (f"{name}: weight_scale of shape {list(s.shape)}, the layer's {self.weight_granularity} "
                    f"scales are {list(self.weight_scale.shape)}")
        return None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
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
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if w is not None and not self.weight.is_meta:  # new bytes and their scales, set together
            st = _STATES.get(self.weight)
            accept_prepared_weight(self.weight, prefix[:-1] or (st.name if st is not None else ""))


def reachable_tensor_bytes(obj) -> int:
    """Bytes of every distinct tensor storage reachable from a model or compiled model:
    parameters, buffers, and the quantized copies kept on its weights."""
    seen, total = set(), 0

    def add(t: torch.Tensor):
        nonlocal total
        st = t.untyped_storage()
        key = (st.data_ptr(), st.device.type)
        if key not in seen:
            seen.add(key)
            total += st.nbytes()

    module = getattr(obj, "_orig_mod", obj)
    tensors = list(module.parameters()) + list(module.buffers()) if isinstance(module, nn.Module) else []
    for t in tensors:
        add(t)
    for t in tensors:
        for wq, ws in quantized_copies(t):
            add(wq)
            add(ws)
    return total
