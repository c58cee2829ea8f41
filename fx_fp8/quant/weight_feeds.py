"""Inputs fx_fp8 appends to a rewritten graph, and the once-per-call step that supplies them.

A graph Dynamo hands the backend reads the model's own weights as inputs. Where the linear
pass quantizes an unprepared weight, the rewritten graph reads its quantized copy instead:
the pass appends placeholders (a Feed each: the copy's quantized weight and scales, its
group's 1/s, its calibrated static scale, per-step scales), derived from the weight at
input `slot`. The graph stays one artifact for every instance that decides alike; what
differs per instance (whose weights) is resolved when an instance is planned, into a Feeder:
once per graph call, outside the graph, it checks each source weight's fingerprint
(re-quantizing in place when it moved: fx_fp8/quant/weight_state.py), checks prepared layers' weights
were not written (fx_fp8/quant/quantized_linear.py), and returns the tensors to append. No Python runs per
linear inside the graph, and the appended tensors keep their addresses (CUDA graphs record
them as static inputs).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.fx

from fx_fp8.graph.owners import OWNERS
from fx_fp8.quant.recipe import WeightRecipe
from fx_fp8.quant.weight_state import WeightState, copy_key, digests, state_on
from fx_fp8.quant.weight_writers import WRITES, follow_writers

#: what a Feed supplies
KINDS = ("wq", "ws", "inverse", "input_scale", "step_scales")
#: placeholder meta that tells AOTAutograd (and so CUDA graphs) the input keeps its address
STATIC_INPUT = {"_dynamo_static_input_type": "unguarded"}


@dataclass(frozen=True)
class Feed:
    """An appended graph input, derived per call from the weight at input `slot`."""

    slot: int
    kind: str  # one of KINDS
    recipe: Optional[WeightRecipe] = None  # wq / ws: the copy's recipe
    alpha: Optional[float] = None  # the smoothing the copy (or 1/s) belongs to

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown feed kind {self.kind!r}")

    def tensor(self, st: WeightState, weight: torch.Tensor) -> torch.Tensor:
        if self.kind in ("wq", "ws"):
            smoothing = st.smoothing[self.alpha] if self.alpha is not None else None
            entry = st.copies.get(copy_key(self.recipe, smoothing))
            if entry is None:  # released since (restore_pipeline, release_quantized_copies): made again
                entry = st.copy(weight, self.recipe, smoothing)
            return entry.wq if self.kind == "wq" else entry.ws
        if self.kind == "inverse":
            return st.smoothing[self.alpha].inverse
        if self.kind == "input_scale":
            return st.input_scale
        return st.input_step_scales[1]


class FeedPlan:
    """The feeds a rewrite appended to one graph, in placeholder order."""

    def __init__(self, graph: torch.fx.Graph, fake_mode=None):
        self.graph = graph
        self.fake_mode = fake_mode
        self.feeds: list[Feed] = []
        self.nodes: dict[Feed, torch.fx.Node] = {}
        self.examples: list[torch.Tensor] = []  # the planning instance's tensors (real)
        self.prepared: list[int] = []  # input slots of prepared layers' weights (checked per call)

    def placeholder(self, feed: Feed, example: torch.Tensor, hint: str) -> torch.fx.Node:
        """The placeholder of `feed` (appended once), with `example` as its value."""
        node = self.nodes.get(feed)
        if node is not None:
            return node
        last = self.nodes[self.feeds[-1]] if self.feeds else [n for n in self.graph.nodes if n.op == "placeholder"][-1]
        with self.graph.inserting_after(last):
            node = self.graph.placeholder(f"fx_fp8_{feed.kind}_{hint}")
        node._dynamo_source = None  # AOTAutograd reads it on every placeholder
        node.meta["tensor_dict"] = dict(STATIC_INPUT)
        if self.fake_mode is not None:
            fake = self.fake_mode.from_tensor(example, static_shapes=True)
            node.meta["example_value"] = node.meta["val"] = fake
        self.feeds.append(feed)
        self.nodes[feed] = node
        self.examples.append(example)
        return node

    @property
    def signature(self) -> tuple:
        """What a compiled artifact of this graph is called with beyond the graph's own inputs."""
        return tuple(self.feeds)

    def feeder(self, inputs: list, resolver: "Resolver") -> Optional["Feeder"]:
        """The per-call step of one instance (None: nothing to feed or check)."""
        if not self.feeds and not self.prepared:
            return None
        return Feeder(self.feeds, self.prepared, inputs, resolver)

    def example_inputs(self, fake: bool) -> list:
        """The appended inputs' example values: fake (the graph's fake mode) or the real tensors."""
        if fake and self.fake_mode is not None:
            return [self.nodes[f].meta["example_value"] for f in self.feeds]
        return list(self.examples)


class Resolver:
    """The WeightState of the weight an instance is called with at a slot: kept on the module
    owning it (found in the instance's model), else on this resolver (a weight that no module
    of the model holds, e.g. a tensor passed as an argument)."""

    def __init__(self, model):
        self._model = (
            weakref.ref(model) if isinstance(model, torch.nn.Module) else None
        )  # compiled graphs outlive models
        self.orphans: dict[int, WeightState] = {}

    def model(self):
        """The instance's model, or None (gone, or none given)."""
        return self._model() if self._model is not None else None

    def owner(self, weight):
        if not isinstance(weight, torch.Tensor):
            return None
        model = self._model() if self._model is not None else None
        return OWNERS.holding(model, weight) if model is not None else None

    def state(self, slot: int, weight: torch.Tensor, name: str = "") -> WeightState:
        owner = self.owner(weight)
        if owner is None:
            st = self.orphans.get(slot)
            if st is None:
                st = self.orphans[slot] = WeightState(name=name)
            return st
        return state_on(owner[0], owner[1], name)

    def module(self, weight: torch.Tensor):
        owner = self.owner(weight)
        return owner[0] if owner is not None else None


class Feeder:
    """One instance's feeds for one rewritten graph: per call, `extras(args)`."""

    def __init__(self, feeds: list[Feed], prepared: list[int], inputs: list, resolver: Resolver):
        self.resolver = resolver
        slots = sorted({f.slot for f in feeds})
        self.slots = [[s, *self._resolve(s, inputs[s])] for s in slots]
        index = {s: i for i, s in enumerate(slots)}
        self.feeds = [(index[f.slot], f) for f in feeds]
        self.prepared = []
        for s in prepared:  # prepared layers: their own weights, checked not written since accepted
            module = resolver.module(inputs[s])
            if module is not None and hasattr(module, "check_weight"):
                self.prepared.append((s, weakref.ref(module)))
        self._out: Optional[list] = None
        self._made_of: tuple = ()
        follow_writers()
        self._writes = WRITES.count  # the followed writers' count these weights' bytes were checked at

    def _resolve(self, slot: int, weight: torch.Tensor) -> list:
        """[state (a weak reference, or the state itself for a weight no module holds: then this
        feeder keeps it), owner module (weakly) or None, attribute]."""
        owner = self.resolver.owner(weight)
        st = self.resolver.state(slot, weight)
        if owner is None:
            return [lambda st=st: st, None, None]
        return [weakref.ref(st), weakref.ref(owner[0]), owner[1]]

    def _state(self, entry: list, weight: torch.Tensor) -> WeightState:
        slot, ref, owner, attr = entry
        st = ref()
        if st is not None and (st.source is None or st.source[0] == id(weight)):
            return st
        if owner is not None:  # another tensor at this slot: the same module's new parameter, or not its
            module = owner()
            if module is not None and (module._parameters.get(attr) is weight or module._buffers.get(attr) is weight):
                return st
            if self.resolver.owner(weight) is None:
                raise RuntimeError(
                    f"fx_fp8: a compiled graph was called with a weight its model instance does not hold (input "
                    f"{slot}, shape {list(weight.shape)}; its quantized copy belongs to another module). Call the "
                    "compiled model itself (its dispatch picks each instance's copies), or compile this model again"
                )
            entry[1:] = self._resolve(slot, weight)  # a parameter moved to another module of the model
            return entry[1]()
        return st

    def extras(self, args) -> list:
        states = []
        for entry in self.slots:
            weight = args[entry[0]]
            st = self._state(entry, weight)
            st.sync(weight)
            states.append(st)
        if self._writes != WRITES.count:  # a followed writer (EMA swap, LoRA merge) ran: read the bytes once
            self._check_bytes(args, states)
        for slot, ref in self.prepared:
            module = ref()
            if module is not None:
                module.check_weight(args[slot])
        # the tensors to append are looked up again only when a state made new ones
        made_of = tuple((id(st), st.generation) for st in states)
        if self._out is None or made_of != self._made_of:
            self._out = [f.tensor(states[i], args[f.slot]) for i, f in self.feeds]
            self._made_of = made_of
        return self._out

    def _check_bytes(self, args, states: list) -> None:
        """Re-quantize the copies whose source bytes changed (one digest of each weight, one
        device-to-host copy per device)."""
        self._writes = WRITES.count
        weights = [args[entry[0]] for entry in self.slots]
        for st, weight, now in zip(states, weights, digests(weights)):
            st.sync(weight, check_bytes=True, known_digest=now)


class Fed:
    """A compiled graph called with the inputs its rewrite appended."""

    def __init__(self, fn: Callable, feeder: Feeder):
        self.fn, self.feeder = fn, feeder

    def __call__(self, *args):
        return self.fn(*args, *self.feeder.extras(args))
