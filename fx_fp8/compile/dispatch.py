"""What a compiled graph runs per call: the step variant for the published denoising step
(StepDispatch) and the module instance the graph is called for (InstanceDispatch).

fx_fp8.compile.backend.compile_graph builds them; the passes and downstream compiles they call
are planned there, so these classes only pick, once per call, which compiled callable runs."""

from __future__ import annotations

import operator
import threading
import weakref
from typing import Callable, Optional

import torch

from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.graph.dynamo_internals import find_compiled_model, runtime_instance
from fx_fp8.graph.names import instance_holding, module_names_of
from fx_fp8.graph.owners import OWNERS
from fx_fp8.report import ModelRecord
from fx_fp8.steps import variant_for_step


class StepDispatch:
    """The step variants of one graph (at most four), picked per call from the published step.
    Every variant's passes ran at compile time (its report exists); its downstream compile
    happens on its first call, so only the variants a run uses are compiled."""

    def __init__(self, variants: dict, config: FP8Config, record: ModelRecord, compile_variant: Callable):
        self.variants = variants  # variant -> compiled callable, or None until first used
        self.attention_steps = config.diffusion_kv_cache_skip_steps if config.attention_step_skips else ()
        qcfg = config.quantization_config
        self.linear_steps = qcfg.skip_steps if config.linear_step_skips else ()
        self.linear_mode = qcfg.skip_steps_mode
        self.record = record
        self.compile_variant = compile_variant
        self.calls = dict.fromkeys(variants, 0)
        self.lock = threading.Lock()

    def _unpublished(self) -> None:
        keys = [
            k
            for k, on in (
                ("diffusion_kv_cache_skip_steps", self.attention_steps),
                ("quantization_config.skip_steps", self.linear_steps),
            )
            if on
        ]
        self.record.warn(
            f"fx_fp8: {' and '.join(keys)} set but no denoising step was published "
            "(use fx_fp8.compile_pipeline, fx_fp8.set_step(i) or `with fx_fp8.denoising_step(i):`); "
            "running the skipped-step graph for these calls"
        )

    def __call__(self, *args):
        variant = variant_for_step(self.attention_steps, self._unpublished, self.linear_steps, self.linear_mode)
        fn = self.variants[variant]
        if fn is None:
            with self.lock:
                fn = self.variants[variant]
                if fn is None:
                    fn = self.variants[variant] = self.compile_variant(variant, list(args))
        self.calls[variant] += 1
        return fn(*args)


class InstanceDispatch:
    """One Dynamo graph, run for several module instances: every block of a class (regional
    compilation, graph breaks, hooks), two transformers of one class (Wan2.2's experts), a
    second model compiled on its own. fx_fp8's decisions and records depend on the instance:
    its layer index, its name, its model's record, its weights' static scales and smoothing.

    The instance is known from the parameters the graph is called with (the `anchors`: every
    input slot holding a parameter of the instance), by the identities of one parameter of each
    of its modules: one tuple of ids and one dict lookup per call, no stack walk. Not by one parameter: blocks that share a
    module (one LayerNorm object read by every block) or two models sharing an embedder hold
    the same first parameter. A set of parameters seen for the first time is resolved to
    (model, instance) once (an instance is named only where it holds every one of them); the
    passes run for an instance seen for the first time, and the compiled artifact of an instance
    that decides the same way is reused (one downstream compile per distinct set of decisions).
    A graph that reads no parameter falls back to the Python stack
    (fx_fp8.graph.dynamo_internals.runtime_instance): the running module in the first model, else
    in the compiled model found on the stack (another model of the class, compiled on its own:
    its own decisions and record, so its warnings are its own)."""

    def __init__(self, gm, instance: str, anchors: list, first, plan, models: list):
        self.gm, self.instance, self.plan = gm, instance, plan
        self.anchors = anchors  # [(input slot, module name relative to the instance)]
        # one parameter per module tells the modules apart (modules are what instances share), in half
        # the ids or less (a linear's weight and bias)
        held = {}
        for slot, relative in anchors:
            held.setdefault(relative, slot)
        self.slots = list(held.values())
        self._pick = operator.itemgetter(*self.slots) if len(self.slots) > 1 else None
        self.models = models  # [(model, owner)] seen so far
        self.by_params: dict = {}  # ids of the anchor parameters -> ((module ref, attr), callable)
        self.by_instance: dict = {}  # (id(model), instance name) -> (model ref, callable, key)
        self.by_name: dict[str, Callable] = {}  # instance name -> callable (graphs without parameters)
        self.lock = threading.Lock()
        self.first = first
        self.names = module_names_of(models[0][0]) if not anchors else None
        self.other_models: dict[
            int, tuple
        ] = {}  # graphs without parameters: id(model) -> (weakref, names, {path: callable})

    def key(self, args):
        """What tells instances apart, per call: the ids of every anchor parameter."""
        if self._pick is None:
            return id(args[self.slots[0]])
        return tuple(map(id, self._pick(args)))

    def remember(self, args, fn, model, instance: Optional[str] = None) -> None:
        """Route calls with these anchor parameters to `fn`. The entry holds the module that
        owns the first of them weakly and checks it still holds it: no reference of any kind on
        the user's parameters (torch's swap-based conversion refuses to swap a weakly referenced one)."""
        param = args[self.slots[0]]
        owner = OWNERS.holding(model, param)
        key = self.key(args)
        self.by_params[key] = ((weakref.ref(owner[0]), owner[1]) if owner is not None else None, fn)
        if instance is not None:  # an instance's parameters replaced since: its older key goes
            known = self.by_instance.get((id(model), instance))
            if known is not None and known[2] != key:
                self.by_params.pop(known[2], None)
            self.by_instance[(id(model), instance)] = (weakref.ref(model), fn, key)

    @staticmethod
    def _holds(entry, param) -> bool:
        if entry is None or entry[0] is None:
            return False
        module = entry[0][0]()
        return module is not None and module._parameters.get(entry[0][1]) is param

    def __call__(self, *args):
        if not self.slots:
            return self._by_stack(args)
        entry = self.by_params.get(self.key(args))
        if not self._holds(entry, args[self.slots[0]]):
            with self.lock:
                entry = self.by_params.get(self.key(args))
                if not self._holds(entry, args[self.slots[0]]):
                    self._build_for_params(list(args))
                    entry = self.by_params[self.key(args)]
        return entry[1](*args)

    def _build_for_params(self, inputs: list) -> None:
        """Route anchor parameters seen for the first time: to their instance's callable, planned
        now for an instance seen for the first time."""
        found = self._instance_holding_all(inputs)
        if found is None:  # not the parameters of any instance we can name: the first instance's decisions
            self.remember(inputs, self.first, self.models[0][0])
            return
        model, owner, path = found
        if all(model is not m for m, _ in self.models):
            self.models.append((model, owner))
        known = self.by_instance.get((id(model), path))
        if (
            known is not None and known[0]() is model
        ):  # its parameters replaced since: its weights are followed per call
            fn = known[1]
        else:
            fn = self.plan(inputs, model, owner, (self.instance, path))
        self.remember(inputs, fn, model, path)

    def _instance_holding_all(self, inputs: list) -> Optional[tuple]:
        """(model, owner, instance name) of the instance holding every anchor parameter where the
        first instance held its own: tried from each parameter in turn, since a shared one (a
        LayerNorm every block reads, an embedder two models share) names another instance first."""
        tried = set()
        for slot, relative in self.anchors:
            found = instance_holding(inputs[slot], relative, self.models)
            if found is None or (id(found[0]), found[2]) in tried:
                continue
            tried.add((id(found[0]), found[2]))
            if self._holds_all(found[0], found[2], inputs):
                return found
        return None

    def _holds_all(self, model, path: str, inputs: list) -> bool:
        for slot, relative in self.anchors:
            name = ".".join(p for p in (path, relative) if p)
            try:
                module = model.get_submodule(name)
            except AttributeError:
                return False
            if not any(p is inputs[slot] for p in module._parameters.values()):
                return False
        return True

    def _by_stack(self, args):
        path = runtime_instance(self.names)
        if path is None:
            fn = self._in_another_model(args)
            if fn is not None:
                return fn(*args)
        fn = self.by_name.get(path) if path is not None else self.first
        if fn is None:
            with self.lock:
                fn = self.by_name.get(path)
                if fn is None:
                    model, owner = self.models[0]
                    fn = self.by_name[path] = self.plan(list(args), model, owner, (self.instance, path))
        return fn(*args)

    def _in_another_model(self, args) -> Optional[Callable]:
        """The callable for the module running this graph in a model other than the first (found
        on the stack: torch.compile'd on its own, or holding the compiled block), planned once
        per instance; None when the stack holds no such model."""
        model, owner, _ = find_compiled_model(set())
        if model is None or model is self.models[0][0]:
            return None
        entry = self.other_models.get(id(model))
        if entry is None or entry[0]() is not model:
            entry = self.other_models[id(model)] = (weakref.ref(model), module_names_of(model), {})
        path = runtime_instance(entry[1])
        if path is None:
            return None
        fn = entry[2].get(path)
        if fn is None:
            with self.lock:
                fn = entry[2].get(path)
                if fn is None:
                    fn = entry[2][path] = self.plan(list(args), model, owner, (self.instance, path))
        return fn


def find_anchors(example_inputs, model: torch.nn.Module, instance: str) -> list[tuple[int, str]]:
    """[(input slot, name relative to `instance` of the module holding it)] of every parameter of
    `instance` in `model` the graph is called with; [] when it reads none."""
    anchors = []
    for i, t in enumerate(example_inputs):
        holder = OWNERS.name(model, t) if isinstance(t, torch.nn.Parameter) else None
        if holder is None:
            continue
        if not instance:
            anchors.append((i, holder))
        elif holder == instance:
            anchors.append((i, ""))
        elif holder.startswith(instance + "."):
            anchors.append((i, holder[len(instance) + 1 :]))
    return anchors
