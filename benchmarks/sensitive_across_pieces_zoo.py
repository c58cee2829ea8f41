#!/usr/bin/env python
"""Which zoo classes does finding the final projection across graph pieces change?

For every class of fx_fp8.tools.zoo and every family of fx_fp8.tools.families, each Dynamo graph
(traced once with a capturing backend: nothing is compiled) is analysed by
fx_fp8.graph.sensitive.find_sensitive_linears twice: with only the model's own graph allowed to hold
the model's output (the rule before), and with fx_fp8.graph.sensitive.holds_model_output (a direct
child Dynamo compiled on its own may hold it too). Prints, per class, its graph count, the
direct-child graphs, and every graph whose structural decisions differ.

    OMP_NUM_THREADS=1 python benchmarks/sensitive_across_pieces_zoo.py
"""

import time
import warnings

import torch

from fx_fp8.tools.model_zoo import registry as zoo
from fx_fp8.tools.model_zoo.registry import FAMILIES, build_tiny_transformer, example_inputs
from fx_fp8.graph.names import INSTANCE_KEY, is_resolved, module_name, resolve_graph
from fx_fp8.graph.sensitive import find_sensitive_linears, holds_model_output


def check(label, model, kw):
    """[(instance, before, after)] for the graphs of `model` whose decisions differ."""
    diffs, pieces = [], []

    def capture(gm, ex):
        resolve_graph(gm, ex, model=model)
        inst = gm.meta.get(INSTANCE_KEY)
        pieces.append(inst)
        old = find_sensitive_linears(gm, model_output=inst in ("", None))
        new = find_sensitive_linears(gm, model_output=holds_model_output(gm))
        old, new = ({module_name(n) if is_resolved(n) else n.name: w for n, w in d.items()} for d in (old, new))
        if old != new:
            diffs.append((inst, old, new))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(model, backend=capture)(**kw)
    direct = sorted({p for p in pieces if p and "." not in p and not p.isdigit()})
    print(f"{label}: {len(pieces)} graphs, direct-child graphs {direct}, changed {diffs}", flush=True)
    return diffs


def main() -> None:
    t0 = time.perf_counter()
    changed = []
    for name in sorted(zoo.MODELS):
        try:
            model = zoo.build(name, seed=0)
            kw = zoo.make_inputs(name, model)
            changed += check(name, model, kw)
        except Exception as e:
            print(f"{name}: ERROR {type(e).__name__}: {e}"[:300], flush=True)
    for fam in FAMILIES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build_tiny_transformer(fam)
        changed += check("family " + fam, model, example_inputs(fam, model))
    print(
        f"classes checked: {len(zoo.MODELS)} + {len(FAMILIES)} families; graphs with changed decisions: "
        f"{len(changed)}; {time.perf_counter() - t0:.0f} s"
    )


if __name__ == "__main__":
    main()
