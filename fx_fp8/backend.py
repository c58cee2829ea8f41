"""The Dynamo backends `fp8` and `fp8_npu`: options -> config -> passes -> downstream compiler.

Registered through the `torch_dynamo_backends` entry point, so
`torch.compile(model, backend="fp8")` works without importing fx_fp8 first.

Per graph Dynamo hands over:
  1. names: each node is resolved to the compiled model's real module name
     (passes/names.py), once, into the node's meta;
  2. the passes run on a copy of the graph for each step variant (one, or
     "fp8" and "native" when diffusion_kv_cache_skip_steps is set);
  3. each variant goes to the downstream compiler (eager, Inductor, npugraph_ex);
  4. the reports go to the compiled model (fx_fp8.get_reports(compiled)) and to
     the bounded recent-compiles log.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

import torch
import torch.fx

from fx_fp8.calibration import check_scales_match, load_activation_scales
from fx_fp8.config import FP8Config
from fx_fp8.ops.lowering import get_lowering, npu_available, resolve_lowering_name
from fx_fp8.passes import CompileContext, PassManager
from fx_fp8.passes.attention import is_attention
from fx_fp8.passes.names import (INSTANCE_KEY, LayerMap, module_name, module_names_of, rename_instance,
                                 resolve_graph, runtime_instance)
from fx_fp8.passes.sensitive import find_sensitive_linears
from fx_fp8.report import RECENT, CompileReport, ModelRecord
from fx_fp8.steps import variant_for_step
from fx_fp8.weights import QuantizedLinear

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


def _copy_graph(gm: torch.fx.GraphModule, with_meta: bool = False) -> tuple[torch.fx.GraphModule, dict]:
    """A GraphModule sharing gm's submodules and constants, with its own copy of the graph
    (node meta copied); and the map from gm's nodes to the copy's."""
    new = torch.fx.Graph()
    node_map: dict = {}
    out = new.graph_copy(gm.graph, node_map)
    new.output(out)
    copy = torch.fx.GraphModule(gm, new)
    if with_meta:
        copy.meta.update(gm.meta)
    return copy, node_map


def _layer_map(gm: torch.fx.GraphModule, model) -> LayerMap:
    attention = [module_name(n) for n in gm.graph.nodes if is_attention(n)]
    if model is not None:
        return LayerMap.from_model(model, set(attention))
    return LayerMap.from_graph(attention, [module_name(n) for n in gm.graph.nodes])


class StepDispatch:
    """Two compiled variants, picked per call by whether the published step is skipped."""

    def __init__(self, variants: dict, skip_steps, record: ModelRecord):
        self.variants = variants
        self.skip_steps = skip_steps
        self.record = record
        self.calls = {"fp8": 0, "native": 0}

    def _unpublished(self) -> None:
        self.record.warn(
            "fx_fp8: diffusion_kv_cache_skip_steps is set but no denoising step was published "
            "(use fx_fp8.compile_pipeline, fx_fp8.set_step(i) or `with fx_fp8.denoising_step(i):`); "
            "running the native-attention graph for these calls")

    def __call__(self, *args):
        variant = variant_for_step(self.skip_steps, self._unpublished)
        self.calls[variant] += 1
        return self.variants[variant](*args)


class InstanceDispatch:
    """Dynamo runs one graph for every instance of a module class (each transformer block, when
    blocks are compiled on their own after a graph break or under a hook), but fx_fp8's
    decisions depend on the instance: its layer index (diffusion_kv_cache_skip_layers), its
    name (ignored_layers), its weights (static scales). This callable finds, per call, the
    instance running the graph (the innermost module of the model on the Python stack) and
    runs the variant compiled for it, compiling it on first use; instances whose decisions
    are the same share one compiled variant."""

    def __init__(self, gm, instance: str, first, build, names: dict):
        self.gm, self.instance, self.build, self.names = gm, instance, build, names
        self.by_instance = {instance: first[1]}
        self.by_decisions = {first[0]: first[1]}
        self.lock = threading.Lock()

    def __call__(self, *args):
        path = runtime_instance(self.names)
        fn = self.by_instance.get(path) if path is not None else self.by_instance[self.instance]
        if fn is None:
            with self.lock:
                fn = self.by_instance.get(path) or self._build_for(path, list(args))
        return fn(*args)

    def _build_for(self, path: str, inputs: list):
        graph_copy, _ = _copy_graph(self.gm, with_meta=True)
        rename_instance(graph_copy, self.instance, path)
        decisions, fn = self.build(graph_copy, inputs)
        fn = self.by_decisions.setdefault(decisions, fn)
        self.by_instance[path] = fn
        return fn


def compile_graph(gm: torch.fx.GraphModule, example_inputs, *, backend: str, options: Optional[dict] = None,
                  mode: Optional[str] = None, model=None, owner=None):
    """The whole backend for one Dynamo graph; `model`/`owner` default to what the Python
    stack shows (see passes/names.find_compiled_model). Returns the callable Dynamo runs."""
    config, backend_opts = config_from_options(options)
    mode = mode or backend_opts.get("mode")
    model, owner = resolve_graph(gm, example_inputs, model=model, owner=owner)
    record = ModelRecord.of(owner)
    device = _graph_device(example_inputs)
    lowering = choose_lowering(backend, config, device, record.warn)
    downstream = choose_downstream(config, lowering, mode)
    qcfg = config.quantization_config
    static_scales = (load_activation_scales(qcfg.activation_scales)
                     if config.linear_enabled and qcfg.activation_scheme == "static" else None)
    if static_scales is not None and model is not None:
        check_scales_match(static_scales, [n for n, m in model.named_modules()
                                           if isinstance(m, (torch.nn.Linear, QuantizedLinear))])
    layer_map = _layer_map(gm, model)
    # graph analyses, once per Dynamo graph (node keys are mapped onto each variant's copy)
    # (the last linear of a block compiled on its own is no final projection: only the model's graph has one)
    sensitive = (find_sensitive_linears(gm, model_output=gm.meta.get(INSTANCE_KEY) in ("", None))
                 if config.linear_enabled else {})
    variants = ("fp8", "native") if config.has_step_skips else (None,)

    def build(graph: torch.fx.GraphModule, inputs: list):
        """Passes + downstream for every step variant of `graph` -> (decisions, callable)."""
        compiled, decisions = {}, []
        for variant in variants:
            graph_copy, node_map = _copy_graph(graph)
            report = CompileReport(backend=backend, lowering=lowering, downstream=downstream, step_variant=variant)
            ctx = CompileContext(gm=graph_copy, example_inputs=inputs, config=config,
                                 lowering=get_lowering(lowering), report=report, layer_map=layer_map,
                                 warn=record.warn, step_variant=variant, static_scales=static_scales,
                                 analysis={"sensitive": {node_map[n]: why for n, why in sensitive.items()
                                                         if n in node_map}},
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
            compiled[variant] = _downstream_compile(downstream, graph_copy, inputs, mode)
        fn = compiled[None] if not config.has_step_skips else StepDispatch(
            compiled, config.diffusion_kv_cache_skip_steps, record)
        return tuple(decisions), fn

    first = build(gm, example_inputs)
    instance = gm.meta.get(INSTANCE_KEY)
    if model is None or not instance or not _has_siblings(model, instance):
        return first[1]
    return InstanceDispatch(gm, instance, first, build, module_names_of(model))


def _has_siblings(model: torch.nn.Module, instance: str) -> bool:
    """Does the model hold another module of the same class as `instance` (so Dynamo may run
    this graph for it too)?"""
    target = model.get_submodule(instance)
    return any(type(m) is type(target) and m is not target for m in model.modules())


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
