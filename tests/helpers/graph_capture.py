"""Test helpers: a Dynamo backend that keeps each graph it is given (names resolved as the
fx_fp8 backends resolve them) and runs it natively; fx_fp8's backend on a stored graph; and a
tiny model of each family traced once, to run the passes on."""

import warnings

import torch

import fx_fp8
from fx_fp8.compile.backend import compile_graph
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.graph.forms import LINEAR_TARGETS, is_attention
from fx_fp8.graph.names import module_name, resolve_graph
from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs, output_tensor


class Capture:
    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        resolve_graph(gm, example_inputs)
        self.graphs.append((gm, list(example_inputs)))
        return gm.forward

    def sdpa_nodes(self):
        return [n for gm, _ in self.graphs for n in gm.graph.nodes if is_attention(n)]


def graph_module_of(fn):
    """The GraphModule behind a callable the eager downstream returned (through the Fed wrapper
    that appends fx_fp8's inputs)."""
    fn = getattr(fn, "fn", fn)
    return fn.__self__


def compile_stored(gm, inputs, config, **overrides):
    """Run fx_fp8's backend on a captured graph with `config` (reference lowering, eager
    downstream unless overridden); returns (callable, report)."""
    cfg = config.replace(**{"lowering": "reference", "downstream": "eager", **overrides})
    fn = compile_graph(gm, inputs, backend="fp8", options={"config": cfg})
    # the callable compiled for the captured instance (an InstanceDispatch wraps it per model instance)
    return getattr(fn, "first", fn), fx_fp8.get_reports()[-1]


_RUNS = {}


def traced(family):
    """(model, gm, inputs, native output, {linear module name: nn.Linear}) traced once per family."""
    if family not in _RUNS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build_tiny_transformer(family)
        kw = example_inputs(family, model)
        cap = Capture()
        torch._dynamo.reset()
        with torch.no_grad():
            model(**kw)  # warm lazy caches (Z-Image RoPE) so the model traces to one graph
            native = output_tensor(torch.compile(model, backend=cap, fullgraph=True)(**kw))
        ((gm, inputs),) = cap.graphs
        nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in LINEAR_TARGETS]
        modules = dict(model.named_modules())
        linears = {module_name(n): modules[module_name(n)] for n in nodes}
        assert len(linears) == len(nodes)  # each linear runs once
        _RUNS[family] = (model, gm, inputs, native, linears)
    return _RUNS[family]


def run_pass(family, **kw):
    """fx_fp8's backend on the family's traced graph: (report, output, native output, linears)."""
    model, gm, inputs, native, linears = traced(family)
    cfg = FP8Config.from_kwargs(quantization=kw.pop("quantization", "fp8"), **kw)
    fn, report = compile_stored(gm, inputs, cfg)
    with torch.no_grad():
        res = fn(*inputs)
    out = output_tensor(res[0] if isinstance(res, (list, tuple)) else res)
    return report, out, native, linears
