"""The Dynamo backends `fp8` and `fp8_npu`: options -> config -> passes -> downstream compiler.

Registered through the `torch_dynamo_backends` entry point, so
`torch.compile(model, backend="fp8")` works without importing fx_fp8 first.

Per graph Dynamo hands over:
  1. names: each node is resolved to the compiled model's real module name
     (fx_fp8/graph/names.py), once, into the node's meta;
  2. the passes run on a copy of the graph for each step variant the step
     selectors can produce (one, or up to four: fx_fp8.steps.variant_name);
  3. each variant goes to the downstream compiler (eager, Inductor, npugraph_ex)
     on its first call;
  4. the reports go to the compiled model (fx_fp8.get_reports(compiled)) and to
     the bounded recent-compiles log.
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Optional

import torch
import torch.fx

from fx_fp8.calibration import check_scales_match, load_activation_scales
from fx_fp8.config import FP8Config
from fx_fp8.ops.lowering import get_lowering, npu_available, resolve_lowering_name
from fx_fp8.passes import CompileContext, PassManager
from fx_fp8.graph.attention_forms import is_attention
from fx_fp8.graph.fx_utils import fill_example_values
from fx_fp8.graph.dynamo_internals import (compiling_under, current_tracing_context, fake_inputs, generate_code_now,
                                           lazy_graph_module, runtime_instance)
from fx_fp8.graph.names import (INSTANCE_KEY, OWNERS, LayerMap, instance_holding, module_name, module_names_of,
                                 rename_instance, resolve_graph)
from fx_fp8.graph.sensitive import find_sensitive_linears, holds_model_output
from fx_fp8.report import RECENT, CompileReport, ModelRecord
from fx_fp8.rules import is_plain_linear
from fx_fp8.steps import variant_for_step
from fx_fp8.weights import QuantizedLinear, watch_weights

#: torch.compile options that configure the backend rather than the FP8 config
BACKEND_OPTION_KEYS = ("config", "dump_graphs", "mode")
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def config_from_options(options: Optional[dict]) -> tuple[FP8Config, dict]:
    """Split torch.compile options into an FP8Config and backend-only settings."""
    options = dict(options or {})
    backend_opts = {k: options.pop(k) for k in BACKEND_OPTION_KEYS if k in options}
    base = backend_opts.pop("config", None)
    if backend_opts.get("mode") not in MODES:
        raise ValueError(f"invalid mode {backend_opts['mode']!r}: expected one of {', '.join(map(str, MODES[1:]))}")
    if base is None:
        return FP8Config.from_kwargs(**options), backend_opts
    return FP8Config.load(base, **options), backend_opts


def _graph_device(example_inputs) -> Optional[torch.device]:
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            return t.device
    return None


def choose_lowering(backend: str, config: FP8Config, device, warn: Callable[[str], None]) -> str:
    if config.lowering == "cuda" and (device is None or device.type != "cuda"):
        # its kernels take CUDA tensors only: every node would stay native, each row saying why
        warn(f"fx_fp8: lowering 'cuda' was asked for but the graph's tensors are on "
             f"{device.type if device is not None else 'no device'!r} (CUDA available: {torch.cuda.is_available()}): "
             "every attention and linear stays native; use lowering 'auto' or 'reference' here")
    if config.lowering != "auto":
        return config.lowering
    if backend == "fp8_npu":
        if npu_available() or (device is not None and device.type in ("npu", "privateuseone")):
            return "npu"
        warn("fx_fp8: backend 'fp8_npu' found no Ascend NPU (torch_npu not importable or no device); "
             "falling back to the CPU reference lowering ('reference')")
        return "reference"
    return resolve_lowering_name("auto", device)


def choose_downstream(config: FP8Config, lowering: str, mode: Optional[str]) -> str:
    if config.downstream != "auto":
        return config.downstream
    if mode:
        return "inductor"
    if lowering == "npu" and npu_available():
        return "npugraph_ex"
    if lowering == "cuda":
        return "inductor"
    return "eager"


def _downstream_compile(name: str, gm: torch.fx.GraphModule, example_inputs, mode: Optional[str]) -> Callable:
    if name == "eager":
        generate_code_now(gm)  # now, not on every call
        return gm.forward
    if name == "inductor":
        from torch._inductor.compile_fx import compile_fx

        patches = torch._inductor.list_mode_options(mode) if mode else {}
        return compile_fx(gm, example_inputs, config_patches=patches)
    if name == "npugraph_ex":
        try:
            backend = torch._dynamo.lookup_backend("npugraph_ex")
        except Exception as e:
            raise RuntimeError(f"downstream 'npugraph_ex' needs torch_npu (pip install 'fx-fp8[npu]'): {e}") from None
        return backend(gm, example_inputs)
    raise ValueError(f"unknown downstream compiler {name!r}")


def _copy_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule sharing gm's submodules and constants, with its own copy of the graph
    (node meta copied). Its Python code is generated lazily, on first call, if ever: the
    downstream compiler reads the graph, and regenerating a large graph's code is the main
    cost of a backend call that changed nothing."""
    new = torch.fx.Graph()
    out = new.graph_copy(gm.graph, {})
    new.output(out)
    return lazy_graph_module(gm, new)


def _layer_map(gm: torch.fx.GraphModule, model) -> LayerMap:
    attention = [module_name(n) for n in gm.graph.nodes if is_attention(n)]
    if model is not None:
        return LayerMap.from_model(model, set(attention))
    return LayerMap.from_graph(attention, [module_name(n) for n in gm.graph.nodes])


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
    (fx_fp8.graph.dynamo_internals.runtime_instance)."""

    def __init__(self, gm, instance: str, anchor_slot: Optional[int], anchor: str, first, plan, models: list):
        self.gm, self.instance, self.plan = gm, instance, plan
        self.anchor_slot, self.anchor = anchor_slot, anchor
        self.models = models                          # [(model, owner)] seen so far
        self.by_param: dict[int, tuple] = {}          # id(anchor parameter) -> (weakref, callable)
        self.by_name: dict[str, Callable] = {}        # instance name -> callable (graphs without parameters)
        self.lock = threading.Lock()
        self.first = first
        self.names = module_names_of(models[0][0]) if anchor_slot is None else None

    def remember(self, param, fn) -> None:
        self.by_param[id(param)] = (weakref.ref(param), fn)

    def __call__(self, *args):
        if self.anchor_slot is None:
            return self._by_stack(args)
        param = args[self.anchor_slot]
        entry = self.by_param.get(id(param))
        if entry is None or entry[0]() is not param:
            with self.lock:
                entry = self.by_param.get(id(param))
                if entry is None or entry[0]() is not param:
                    self.remember(param, self._build_for_param(param, list(args)))
                    entry = self.by_param[id(param)]
        return entry[1](*args)

    def _build_for_param(self, param, inputs: list):
        found = instance_holding(param, self.anchor, self.models)
        if found is None:  # not a parameter of any model we can name: the first instance's decisions
            return self.first
        model, owner, path = found
        if all(model is not m for m, _ in self.models):
            self.models.append((model, owner))
        return self.plan(inputs, model, owner, (self.instance, path))

    def _by_stack(self, args):
        path = runtime_instance(self.names)
        fn = self.by_name.get(path) if path is not None else self.first
        if fn is None:
            with self.lock:
                fn = self.by_name.get(path)
                if fn is None:
                    model, owner = self.models[0]
                    fn = self.by_name[path] = self.plan(list(args), model, owner, (self.instance, path))
        return fn(*args)


def compile_graph(gm: torch.fx.GraphModule, example_inputs, *, backend: str, options: Optional[dict] = None,
                  mode: Optional[str] = None, model=None, owner=None):
    """The whole backend for one Dynamo graph; `model`/`owner` default to what the Python
    stack shows (see fx_fp8.graph.dynamo_internals.find_compiled_model). Returns the callable Dynamo runs."""
    config, backend_opts = config_from_options(options)
    mode = mode or backend_opts.get("mode")
    model, owner = resolve_graph(gm, example_inputs, model=model, owner=owner)
    device = _graph_device(example_inputs)
    first_record = ModelRecord.of(owner)
    lowering = choose_lowering(backend, config, device, first_record.warn)
    downstream = choose_downstream(config, lowering, mode)
    qcfg = config.quantization_config
    static_scales = (load_activation_scales(qcfg.activation_scales)
                     if config.linear_enabled and qcfg.activation_scheme == "static" else None)
    if static_scales is not None and model is not None:
        check_scales_match(static_scales, [n for n, m in model.named_modules()
                                           if is_plain_linear(m) or isinstance(m, QuantizedLinear)])
    if model is not None and config.linear_enabled:
        watch_weights(model)  # before Dynamo guards on their type: every instance then shares this graph
    layer_map = _layer_map(gm, model)
    # graph analyses, once per Dynamo graph, keyed by node name (stable across the graph's copies)
    # (a block compiled on its own holds no final projection: see holds_model_output)
    sensitive = ({n.name: why for n, why in
                  find_sensitive_linears(gm, model_output=holds_model_output(gm)).items()}
                 if config.linear_enabled else {})
    variants = config.step_variants()
    artifacts: dict = {}  # (variant, decisions) -> compiled callable: instances that decide alike share them

    tracing_context = current_tracing_context()
    # the graph's own fake inputs (no memory held): a later compile sees the shapes Dynamo traced,
    # so the compile caches key it as they key a compile made inside Dynamo
    fake_args = fake_inputs(tracing_context, example_inputs)

    def plan(inputs: list, model_, owner_, rename: Optional[tuple] = None) -> Callable:
        """Passes for every step variant of the graph, its names moved from one instance to
        another by `rename` (reports to owner_'s record), then the downstream compile unless an
        instance with the same decisions already has one."""
        record = ModelRecord.of(owner_)
        rewritten, decisions = {}, []
        for variant in variants:
            graph_copy = _copy_graph(gm)
            if rename is not None:
                rename_instance(graph_copy, *rename)
            report = CompileReport(backend=backend, lowering=lowering, downstream=downstream, step_variant=variant)
            ctx = CompileContext(gm=graph_copy, example_inputs=inputs, config=config,
                                 lowering=get_lowering(lowering), report=report, layer_map=layer_map,
                                 warn=record.warn, step_variant=variant, static_scales=static_scales,
                                 analysis={"sensitive": {n: sensitive[n.name] for n in graph_copy.graph.nodes
                                                         if n.name in sensitive}},
                                 dumps=[] if backend_opts.get("dump_graphs") else None)
            PassManager().run(ctx)
            report.layer_map = layer_map.as_dict()
            _warn_about_selectors(ctx, config, record)
            if ctx.dumps is not None:
                report.notes.append(f"{len(ctx.dumps)} graph dumps attached")
                report.graphs = dict(ctx.dumps)
            record.add(report)
            RECENT.add(report)
            decisions.append(tuple((e.node, e.action, e.reason) for e in report.entries))
            rewritten[variant] = graph_copy
        keys = dict(zip(variants, decisions))

        def compile_variant(variant, inputs_) -> Callable:
            key = (variant, keys[variant])
            if key not in artifacts:
                # a variant or instance compiled on its first call runs outside Dynamo: Dynamo's
                # tracing context (fake mode, shape env) lets Inductor's caches take it
                # the compile caches need a fake value on every node the passes inserted (only for
                # a graph that is compiled: an instance that reuses an artifact skips it)
                fill_example_values(rewritten[variant].graph)
                with compiling_under(tracing_context):
                    artifacts[key] = _downstream_compile(downstream, rewritten[variant],
                                                         inputs_ if fake_args is None else fake_args, mode)
            return artifacts[key]

        if not config.has_step_skips:
            return compile_variant(None, inputs)
        ready = {v: artifacts.get((v, keys[v])) for v in variants}
        return StepDispatch(ready, config, record, compile_variant)

    first = plan(list(example_inputs), model, owner)
    if model is None:
        return first
    instance = gm.meta.get(INSTANCE_KEY) or ""
    anchor_slot, anchor = _anchor(example_inputs, model, instance)
    dispatch = InstanceDispatch(gm, instance, anchor_slot, anchor, first, plan, [(model, owner)])
    if anchor_slot is not None:
        dispatch.remember(example_inputs[anchor_slot], first)
    elif not instance:
        return first  # the model's own graph without parameters: nothing tells instances apart
    dispatch.by_name[instance] = first
    return dispatch


def _anchor(example_inputs, model: torch.nn.Module, instance: str) -> tuple[Optional[int], str]:
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


def _warn_about_selectors(ctx: CompileContext, config: FP8Config, record: ModelRecord) -> None:
    n = ctx.layer_map.num_layers
    beyond = config.diffusion_kv_cache_skip_layers.at_least(n)
    if config.attention_enabled and beyond:
        record.warn(f"fx_fp8: diffusion_kv_cache_skip_layers names layers {beyond} but the model has {n} layers"
                    + (f" (0-{n - 1})" if n else ""))
    if ctx.unmatched_ignored_layers:
        record.warn(f"fx_fp8: ignored_layers patterns matched no linear in this graph: {ctx.unmatched_ignored_layers}")


def fp8_backend(gm: torch.fx.GraphModule, example_inputs, options: Optional[dict] = None, mode: Optional[str] = None):
    """`torch.compile(model, backend="fp8", options={...})`: lowering from the tensors' device."""
    return compile_graph(gm, example_inputs, backend="fp8", options=options, mode=mode)


def fp8_npu_backend(gm: torch.fx.GraphModule, example_inputs, options: Optional[dict] = None, mode: Optional[str] = None):
    """`torch.compile(model, backend="fp8_npu", options={...})`: the Ascend lowering
    (CPU reference, with a warning, where no NPU is present)."""
    return compile_graph(gm, example_inputs, backend="fp8_npu", options=options, mode=mode)
