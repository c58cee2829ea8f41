"""What the backend derives from a model's own weights, owned by the module that holds each weight.

`torch.compile(model, backend="fp8")` on an unprepared model quantizes each eligible weight at
compile time. The result (a QuantizedCopy: the quantized weight and its fp32 scales, per
recipe and smoothing), the smoothing factors of its group and its calibrated activation scale
live in a WeightState kept in the owning module's `__dict__` (STATE_ATTR), keyed by the
weight's attribute name: they die with the module, move with nothing but themselves, and
appear in no state dict (the model's state dict keeps saying what the model holds: its
original weights). Nothing is attached to the user's Parameter and nothing is keyed by it.

The compiled graph takes a copy's tensors as extra inputs that fx_fp8 appends (see
fx_fp8/quant/weight_feeds.py): once per graph call, outside the graph, each source weight's
fingerprint (object, version counter (none for an inference tensor), storage address, dtype, device,
shape) is compared with the one its copy was made from, and a moved one is re-quantized in place
(same addresses, so CUDA graphs replay the new values). That sees a Parameter replaced, `w.data = new`, in-place
writes to the Parameter (its version counter: `copy_`, `load_state_dict`, `add_` under
no_grad) and device or dtype moves. An in-place write through the `.data` alias
(`w.data.add_(d)`, PEFT's unsafe merge `w.data += d`) bumps the alias's version counter, not
the Parameter's, so no per-call check can see it without reading the bytes: `refresh_weights`
compares byte digests and re-quantizes what changed; every compile and every `compile_pipeline`
call do it for the weights they run, each compiled graph after a followed writer ran (EMA's
copy_to / restore, PEFT's merge / unmerge: fx_fp8/quant/weight_writers.py), and
`fx_fp8.refresh_weights(model)` on request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.nn as nn

from fx_fp8.graph.dynamo_internals import unwrap_compiled
from fx_fp8.graph.owners import OWNERS, held
from fx_fp8.quant.recipe import Smoothing, WeightRecipe

#: the attribute of a module's __dict__ holding {weight attribute name: WeightState}
STATE_ATTR = "_fx_fp8_weight_states"


def fingerprint(weight: torch.Tensor) -> tuple:
    """What moves when a weight's values may have moved without a byte being read (cheap).
    A tensor made under torch.inference_mode (a model built or loaded inside it) has no version
    counter: it is written in place only inside inference_mode or through `.data`, and such a
    write is as invisible per call as any write through `.data` (refresh_copies' digest sees
    it); its other moves (replaced, `w.data = v`, dtype, device) are seen as for any weight."""
    try:
        version = weight._version
    except RuntimeError:  # "Inference tensors do not track version counter" (also after `w.data = v`)
        version = INFERENCE
    return (id(weight), version, weight.data_ptr(), weight.dtype, weight.device, weight.shape)


#: the version field of an inference tensor's fingerprint (it has no version counter)
INFERENCE = "inference"


#: odd 64-bit multipliers of the digest, per device
_MULTIPLIERS: dict = {}
_DIGEST_ROW = 4096


def _digest_words(weight: torch.Tensor) -> torch.Tensor:
    """Two 64-bit words of the weight's bytes, computed where the weight is: position-weighted
    sums in two's-complement arithmetic (so the order of summation does not matter, and the
    same bytes give the same words on every device)."""
    data = weight.detach().contiguous().view(torch.uint8).reshape(-1)
    n = data.numel()
    words = torch.nn.functional.pad(data, (0, (-n) % (8 * _DIGEST_ROW))).view(torch.int64).view(-1, _DIGEST_ROW)
    mult = _MULTIPLIERS.get(data.device)
    if mult is None:
        gen = torch.Generator().manual_seed(0x5EED)
        mult = torch.randint(-(2**62), 2**62, (_DIGEST_ROW,), generator=gen, dtype=torch.int64) * 2 + 1
        mult = _MULTIPLIERS[data.device] = mult.to(data.device)
    rows = (words * mult).sum(dim=1)
    index = torch.arange(rows.numel(), device=data.device, dtype=torch.int64) * 2 + 1
    return torch.stack([(rows * index).sum(), rows.sum() + n])


def digests(weights: list) -> list[str]:
    """A digest of each weight's bytes (reads them all once; one device-to-host copy per device)."""
    words = [_digest_words(w) for w in weights]
    host = {}
    for device in {w.device for w in words}:
        idx = [i for i, w in enumerate(words) if w.device == device]
        for i, pair in zip(idx, torch.stack([words[i] for i in idx]).cpu().tolist()):
            host[i] = pair
    return [f"{host[i][0] & (2**64 - 1):016x}{host[i][1] & (2**64 - 1):016x}" for i in range(len(weights))]


def digest(weight: torch.Tensor) -> str:
    return digests([weight])[0]


def _quantize(recipe: WeightRecipe, weight: torch.Tensor, smoothing: Optional[Smoothing]) -> tuple:
    """A copy's tensors, never inference tensors (a copy made during a call under
    torch.inference_mode is rewritten in place by a later call outside it)."""
    with torch.inference_mode(False):
        return recipe.quantize(weight, smoothing)


@dataclass(eq=False)
class QuantizedCopy:
    """One weight quantized by one recipe (of W * s with a smoothing): the tensors a compiled
    graph reads, rewritten in place when the source weight changes."""

    recipe: WeightRecipe
    smoothing: Optional[Smoothing]
    wq: torch.Tensor
    ws: torch.Tensor
    quantizations: int = 1  # how often it was (re)made

    def refresh(self, weight: torch.Tensor) -> None:
        """Re-quantize from `weight`: in place where shapes, dtypes and device agree (the
        addresses a CUDA graph recorded stay valid), else new tensors."""
        wq, ws = _quantize(self.recipe, weight, self.smoothing)
        if (wq.shape, wq.dtype, wq.device, ws.shape, ws.device) == (
            self.wq.shape,
            self.wq.dtype,
            self.wq.device,
            self.ws.shape,
            self.ws.device,
        ):
            self.wq.copy_(wq)
            self.ws.copy_(ws)
        else:
            self.wq, self.ws = wq, ws
        self.quantizations += 1

    @property
    def nbytes(self) -> int:
        return self.wq.numel() * self.wq.element_size() + self.ws.numel() * self.ws.element_size()


@dataclass(eq=False)
class WeightState:
    """What fx_fp8 derived from one weight of a module: its quantized copies are of the bytes
    the weight held at `source` (fingerprint) / `source_digest`."""

    name: str = ""  # the owning linear's name, for messages
    copies: dict = field(default_factory=dict)  # recipe key (+ smoothing key) -> QuantizedCopy
    smoothing: dict = field(default_factory=dict)  # alpha -> Smoothing of the weight's group
    input_scale: Optional[torch.Tensor] = None  # calibrated static activation scale (fp32 [])
    input_step_scales: Optional[tuple] = None  # per-step scales: (flat step groups, fp32 [n_groups])
    left_by_prepare: str = ""  # why prepare_model left its linear unreplaced (hooks)
    source: Optional[tuple] = None
    source_digest: Optional[str] = None
    generation: int = 0  # bumped whenever a copy's tensors may be new objects

    def copy(
        self,
        weight: torch.Tensor,
        recipe: WeightRecipe,
        smoothing: Optional[Smoothing] = None,
        *,
        check_bytes: bool = False,
    ) -> QuantizedCopy:
        """The copy of `weight` by `recipe` (and smoothing), made now if missing, current (by
        fingerprint; with check_bytes, as at compile time, by a digest of the bytes too)."""
        self.sync(weight, check_bytes=check_bytes and bool(self.copies))
        key = copy_key(recipe, smoothing)
        entry = self.copies.get(key)
        if entry is None:
            wq, ws = _quantize(recipe, weight, smoothing)
            entry = self.copies[key] = QuantizedCopy(recipe, smoothing, wq, ws)
            self.generation += 1
            if self.source_digest is None:  # the bytes every copy is now of (refresh_copies compares)
                self.source_digest = digest(weight)
        return entry

    def sync(self, weight: torch.Tensor, check_bytes: bool = False, known_digest: Optional[str] = None) -> bool:
        """Bring every copy up to `weight`; True when they were re-quantized. Per call
        (check_bytes False): by fingerprint only, no byte read, no device sync. With
        check_bytes (refresh_copies): by a digest of the bytes as well."""
        fp = fingerprint(weight)
        if not check_bytes:
            if fp == self.source:
                return False
            self.source = fp
            self.source_digest = None  # unknown until refresh_copies reads the bytes
            return self._refresh_all(weight)
        now = known_digest if known_digest is not None else digest(weight)
        stale = fp != self.source or self.source_digest is None or now != self.source_digest
        self.source, self.source_digest = fp, now
        return self._refresh_all(weight) if stale else False

    def _refresh_all(self, weight: torch.Tensor) -> bool:
        with torch.no_grad():
            for c in self.copies.values():
                c.refresh(weight)
        self.generation += 1
        return bool(self.copies)

    def released_bytes(self) -> int:
        return sum(c.nbytes for c in self.copies.values())


def copy_key(recipe: WeightRecipe, smoothing: Optional[Smoothing] = None) -> tuple:
    return recipe.key + ((smoothing.key,) if smoothing is not None else ())


# -- owners --------------------------------------------------------------------------------------------
def module_states(module: nn.Module) -> dict:
    """{weight attribute name: WeightState} kept on `module` (created empty)."""
    states = module.__dict__.get(STATE_ATTR)
    if states is None:
        states = module.__dict__[STATE_ATTR] = {}
    return states


def state_on(module: nn.Module, attr: str, name: str = "") -> WeightState:
    states = module_states(module)
    st = states.get(attr)
    if st is None:
        st = states[attr] = WeightState(name=name)
    elif name and not st.name:
        st.name = name
    return st


def states_in(model: nn.Module) -> Iterator[tuple[nn.Module, str, WeightState]]:
    """Every WeightState kept on `model`'s modules: (module, weight attribute, state)."""
    model = unwrap_compiled(model)
    for module in model.modules():
        for attr, st in list(module.__dict__.get(STATE_ATTR, {}).items()):
            yield module, attr, st


# -- model-level operations -------------------------------------------------------------------------
def refresh_copies(model: nn.Module) -> list[str]:
    """Re-quantize, in place, every compile-time copy whose source weight's bytes changed since it
    was made (a write through `.data`, which no per-call check sees). Reads every source weight
    that has copies once (a byte digest; one device-to-host copy per device). Returns the names of
    the weights re-quantized."""
    todo = [(attr, st, held(module, attr)) for module, attr, st in states_in(model) if st.copies]
    todo = [(attr, st, w) for attr, st, w in todo if w is not None]
    changed = []
    for (attr, st, weight), now in zip(todo, digests([w for _, _, w in todo])):
        if st.sync(weight, check_bytes=True, known_digest=now):
            changed.append(st.name or attr)
    return changed


def release_quantized_copies(module: nn.Module) -> int:
    """Drop every quantized copy the compile path made for the weights of `module` and its
    children (prepared layers keep their own weights). Returns the bytes released; a graph
    compiled before re-quantizes on its next call."""
    released = 0
    for _, _, st in states_in(module):
        released += st.released_bytes()
        st.copies.clear()  # smoothing vectors and static scales are tiny: a compiled graph still needs them
        st.source = st.source_digest = None
        st.generation += 1
    return released


def quantized_copies_of(module: nn.Module) -> list[torch.Tensor]:
    """Every tensor the compile path keeps for `module`'s weights (copies, scales, 1/s vectors)."""
    out = []
    for _, _, st in states_in(module):
        for c in st.copies.values():
            out += [c.wq, c.ws]
        out += [sm.inverse for sm in st.smoothing.values()]
        if st.input_scale is not None:
            out.append(st.input_scale)
    return out


def compile_quantizations(module: nn.Module) -> int:
    """How many times the compile path (re)made a quantized copy of `module`'s weights."""
    return sum(c.quantizations for _, _, st in states_in(module) for c in st.copies.values())


def state_of(model: nn.Module, weight: torch.Tensor) -> Optional[WeightState]:
    """The WeightState the backend keeps for `weight` of `model` (None: it derived nothing from it)."""
    owner = OWNERS.holding(unwrap_compiled(model), weight)
    return None if owner is None else owner[0].__dict__.get(STATE_ATTR, {}).get(owner[1])
