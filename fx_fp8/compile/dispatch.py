"""What a compiled graph runs per call: the step variant for the published denoising step
(StepDispatch) and the module instance the graph is called for (InstanceDispatch).

fx_fp8.compile.backend.compile_graph builds them; the passes and downstream compiles they call
are planned there, so these classes only pick, once per call, which compiled callable runs."""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Optional

import torch

from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.graph.dynamo_internals import find_compiled_model, runtime_instance
from fx_fp8.graph.names import OWNERS, instance_holding, module_names_of
from fx_fp8.quant.weight_state import OWNERS as OWNERS_BY_TENSOR
from fx_fp8.report import ModelRecord
from fx_fp8.steps import variant_for_step


class StepDispatch:
    """The step variants of one graph (at most four), picked per call from the published step.
    Every variant's passes ran at compile time (its report exists); its downstream compile
    happens on its first call, so only the variants a run uses are compiled."""

    def __init__(self, variants: dict, config: FP8Config, record: ModelRecord, compile_variant: Callable):
        self.variants = variants                      # variant -> compiled callable, or None until first used
        self.attention_steps = config.diffusion_kv_cache_skip_steps if config.attention_step_skips else ()
        qcfg = config.quantization_config
        self.linear_steps = qcfg.skip_steps if config.linear_step_skips else ()
        self.linear_mode = qcfg.skip_steps_mode
        self.record = record
        self.compile_variant = compile_variant
        self.calls = dict.fromkeys(variants, 0)
        self.lock = threading.Lock()

    def _unpublished(self) -> None:
        keys = [k for k, on in (("diffusion_kv_cache_skip_steps", self.attention_steps),
                                ("quantization_config.skip_steps", self.linear_steps)) if on]
        self.record.warn(
            f"fx_fp8: {' and '.join(keys)} set but no denoising step was published "
            "(use fx_fp8.compile_pipeline, fx_fp8.set_step(i) or `with fx_fp8.denoising_step(i):`); "
            "running the skipped-step graph for these calls")

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

    The instance is known from a parameter the graph is called with (the `anchor` slot of the
    inputs), by identity: one dict lookup per call, no stack walk. A parameter seen for the
    first time is resolved to (model, instance) once, the passes run for it, and the compiled
    artifact of an instance that decides the same way is reused (one downstream compile per
    distinct set of decisions). A graph that reads no parameter falls back to the Python stack
    (fx_fp8.graph.dynamo_internals.runtime_instance): the running module in the first model, else
    in the compiled model found on the stack (another model of the class, compiled on its own:
    its own decisions and record, so its warnings are its own)."""

    def __init__(self, gm, instance: str, anchor_slot: Optional[int], anchor: str, first, plan, models: list):
        self.gm, self.instance, self.plan = gm, instance, plan
        self.anchor_slot, self.anchor = anchor_slot, anchor
        self.models = models                          # [(model, owner)] seen so far
        self.by_param: dict[int, tuple] = {}          # id(anchor parameter) -> ((module ref, attr), callable)
        self.by_name: dict[str, Callable] = {}        # instance name -> callable (graphs without parameters)
        self.lock = threading.Lock()
        self.first = first
        self.names = module_names_of(models[0][0]) if anchor_slot is None else None
        self.other_models: dict[int, tuple] = {}     # graphs without parameters: id(model) -> (weakref, names, {path: callable})

    def remember(self, param, fn, model) -> None:
        """Route calls with `param` at the anchor slot to `fn`. The entry holds the module that
        owns `param` weakly and checks it still holds `param`: no reference of any kind on the
        user's parameter (torch's swap-based conversion refuses to swap a weakly referenced one)."""
        owner = OWNERS_BY_TENSOR.owner(model, param)
        self.by_param[id(param)] = ((weakref.ref(owner[0]), owner[1]) if owner is not None else None, fn)

    @staticmethod
    def _holds(entry, param) -> bool:
        if entry is None or entry[0] is None:
            return False
        module = entry[0][0]()
        return module is not None and module._parameters.get(entry[0][1]) is param

    def __call__(self, *args):
        if self.anchor_slot is None:
            return self._by_stack(args)
        param = args[self.anchor_slot]
        entry = self.by_param.get(id(param))
        if not self._holds(entry, param):
            with self.lock:
                entry = self.by_param.get(id(param))
                if not self._holds(entry, param):
                    fn, model = self._build_for_param(param, list(args))
                    self.remember(param, fn, model)
                    entry = self.by_param[id(param)]
        return entry[1](*args)

    def _build_for_param(self, param, inputs: list) -> tuple:
        """(callable, model) for an anchor parameter seen for the first time."""
        found = instance_holding(param, self.anchor, self.models)
        if found is None:  # not a parameter of any model we can name: the first instance's decisions
            return self.first, self.models[0][0]
        model, owner, path = found
        if all(model is not m for m, _ in self.models):
            self.models.append((model, owner))
        return self.plan(inputs, model, owner, (self.instance, path)), model

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


def find_anchor(example_inputs, model: torch.nn.Module, instance: str) -> tuple[Optional[int], str]:
    """(input slot, name relative to `instance` of the module holding it) of the first
    parameter of `model` the graph is called with; (None, "") when it reads none."""
    for i, t in enumerate(example_inputs):
        holder = OWNERS.holder(model, t) if isinstance(t, torch.nn.Parameter) else None
        if holder is None:
            continue
        if not instance:
            return i, holder
        if holder == instance:
            return i, ""
        if holder.startswith(instance + "."):
            return i, holder[len(instance) + 1:]
    return None, ""
