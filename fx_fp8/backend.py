"""The Dynamo backends `fp8` and `fp8_npu`: options -> config -> passes -> downstream compiler.

Registered through the `torch_dynamo_backends` entry point, so
`torch.compile(model, backend="fp8")` works without importing fx_fp8 first.
"""
from __future__ import annotations

import logging
import warnings
from typing import Callable, Optional

import torch
import torch.fx

from fx_fp8.config import FP8Config
from fx_fp8.ops.lowering import get_lowering, npu_available, resolve_lowering_name
from fx_fp8.report import CompileReport, record_report
from fx_fp8.steps import variant_for_current_step

log = logging.getLogger("fx_fp8")

#: graphs compiled by the fx_fp8 backends since import (one per step variant)
STATS = {"graphs": 0}
_WARNED: set[str] = set()
BACKEND_OPTION_KEYS = ("config", "dump_graphs")


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, stacklevel=3)


def config_from_options(options: Optional[dict]) -> tuple[FP8Config, dict]:
    """Split torch.compile options into an FP8Config and backend-only settings."""
    options = dict(options or {})
    backend_opts = {k: options.pop(k) for k in BACKEND_OPTION_KEYS if k in options}
    base = backend_opts.pop("config", None)
    if base is None:
        return FP8Config.from_kwargs(**options), backend_opts
    return FP8Config.load(base, **options), backend_opts


def _graph_device(example_inputs) -> Optional[torch.device]:
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            return t.device
    return None


def choose_lowering(backend: str, config: FP8Config, device) -> str:
    if config.lowering != "auto":
        return config.lowering
    if backend == "fp8_npu":
        if npu_available() or (device is not None and device.type in ("npu", "privateuseone")):
            return "npu"
        _warn_once("fx_fp8: backend 'fp8_npu' found no Ascend NPU (torch_npu not importable or no device); "
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


def compile_variant(gm, example_inputs, config: FP8Config, *, backend: str, lowering: str, downstream: str,
                    step_variant: Optional[str], mode: Optional[str] = None, dump_graphs: bool = False):
    """Run the passes on a copy of `gm` for one step variant; returns (callable, report)."""
    from fx_fp8.passes import CompileContext, PassManager

    graph_copy = torch.fx.GraphModule(gm, _copy_graph(gm.graph))  # shares submodules/constants, not the graph
    report = CompileReport(backend=backend, lowering=lowering, downstream=downstream, step_variant=step_variant)
    ctx = CompileContext(gm=graph_copy, example_inputs=example_inputs, config=config, lowering=get_lowering(lowering),
                         report=report, step_variant=step_variant, dumps=[] if dump_graphs else None)
    PassManager().run(ctx)
    report.layer_map = ctx.layer_map.as_dict()
    _warn_about_selectors(ctx, config)
    if ctx.dumps is not None:
        report.notes.append(f"{len(ctx.dumps)} graph dumps attached")
        report.graphs = dict(ctx.dumps)
    record_report(report)
    STATS["graphs"] += 1
    return _downstream_compile(downstream, graph_copy, example_inputs, mode), report


def _copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    new = torch.fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new


def _warn_about_selectors(ctx, config: FP8Config) -> None:
    n = ctx.layer_map.num_layers
    beyond = sorted(i for i in config.diffusion_kv_cache_skip_layers if i >= n)
    if config.attention_enabled and beyond:
        _warn_once(f"fx_fp8: diffusion_kv_cache_skip_layers names layers {beyond} but this graph has {n} layers (0-{n - 1})")
    unmatched = ctx.extras.get("unmatched_ignored_layers")
    if unmatched:
        _warn_once(f"fx_fp8: ignored_layers patterns matched no linear in this graph: {unmatched}")


#: callables `hook(variant)` told which variant each StepDispatch call runs
#: (fx_fp8.pipelines records the per-step variant sequence of a pipeline run with it)
DISPATCH_HOOKS: list[Callable[[str], None]] = []


class StepDispatch:
    """Two compiled variants, picked per call by whether the published step is skipped."""

    def __init__(self, variants: dict, skip_steps: frozenset):
        self.variants = variants
        self.skip_steps = skip_steps
        self.calls = {"fp8": 0, "native": 0}

    def __call__(self, *args):
        variant = variant_for_current_step(self.skip_steps)
        self.calls[variant] += 1
        for hook in DISPATCH_HOOKS:
            hook(variant)
        return self.variants[variant](*args)


def _compile(gm: torch.fx.GraphModule, example_inputs, *, backend: str, options: Optional[dict], mode: Optional[str]):
    config, backend_opts = config_from_options(options)
    device = _graph_device(example_inputs)
    lowering = choose_lowering(backend, config, device)
    downstream = choose_downstream(config, lowering, mode)
    common = dict(backend=backend, lowering=lowering, downstream=downstream, mode=mode,
                  dump_graphs=bool(backend_opts.get("dump_graphs")))
    if not config.has_step_skips:
        fn, _ = compile_variant(gm, example_inputs, config, step_variant=None, **common)
        return fn
    variants = {v: compile_variant(gm, example_inputs, config, step_variant=v, **common)[0] for v in ("fp8", "native")}
    return StepDispatch(variants, config.diffusion_kv_cache_skip_steps)


def fp8_backend(gm: torch.fx.GraphModule, example_inputs, options: Optional[dict] = None, mode: Optional[str] = None):
    """`torch.compile(model, backend="fp8", options={...})`: lowering from the tensors' device."""
    return _compile(gm, example_inputs, backend="fp8", options=options, mode=mode)


def fp8_npu_backend(gm: torch.fx.GraphModule, example_inputs, options: Optional[dict] = None, mode: Optional[str] = None):
    """`torch.compile(model, backend="fp8_npu", options={...})`: the Ascend lowering
    (CPU reference, with a warning, where no NPU is present)."""
    return _compile(gm, example_inputs, backend="fp8_npu", options=options, mode=mode)
