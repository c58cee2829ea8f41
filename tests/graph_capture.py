"""A Dynamo backend for tests: keeps each graph it is given and runs it natively."""
from fx_fp8.passes.attention import is_sdpa


class Capture:
    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append((gm, list(example_inputs)))
        return gm.forward

    def sdpa_nodes(self):
        return [n for gm, _ in self.graphs for n in gm.graph.nodes if is_sdpa(n)]
