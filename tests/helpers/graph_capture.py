"""Test helpers: a Dynamo backend that keeps each graph it is given (names resolved as the
fx_fp8 backends resolve them) and runs it natively; and fx_fp8's backend on a stored graph."""
import fx_fp8
from fx_fp8.compile.backend import compile_graph
from fx_fp8.graph.forms import is_attention
from fx_fp8.graph.names import resolve_graph


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
