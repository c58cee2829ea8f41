"""Per-call cost of fx_fp8's dispatch in the launch-bound regime (tiny tensors).

A tiny Flux (2 double + 2 single blocks, width 64) is compiled block by block, as
diffusers' compile_repeated_blocks does, with Inductor downstream. Each compiled block call
goes through Dynamo's guards, then (fx_fp8) InstanceDispatch (which instance: a tuple of
the ids of the block's parameters, one dict lookup) and, with step skips, StepDispatch (which step variant).
Printed side by side in one run:
  * µs per block call of plain Inductor and of fx_fp8 with both features off, on, and on
    with step skips (the FP8 rows include the FP8 kernels' own CPU cost: CPU is not FP8's
    speed path);
  * the dispatch alone: the same InstanceDispatch / StepDispatch objects calling a no-op.

    python benchmarks/dispatch_overhead.py [--calls 100] [--rounds 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import fx_fp8
from fx_fp8.compile import backend
from fx_fp8.compile.dispatch import InstanceDispatch, StepDispatch
from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs

CONFIGS = {
    "inductor": {"backend": "inductor"},
    "fp8 (features off)": {
        "backend": "fp8",
        "options": {"downstream": "inductor", "quantization": None, "diffusion_kv_cache_dtype": None},
    },
    "fp8 (attention + linears)": {"backend": "fp8", "options": {"downstream": "inductor"}},
    "fp8 + step skips": {"backend": "fp8", "options": {"downstream": "inductor", "diffusion_kv_cache_skip_steps": "0"}},
}


def _blocks(model) -> list:
    return [m for m in model.modules() if type(m).__name__ in model._repeated_blocks]


def compiled_blocks(config: dict, device: str):
    """A tiny Flux compiled block by block with `config`, warmed up: (time_calls(n) -> µs per
    block call, the dispatchers fx_fp8 returned for it)."""
    _RETURNED.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny_transformer("flux").to(device)
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in example_inputs("flux", model).items()}
    model.compile_repeated_blocks(**config)
    blocks = _blocks(model)
    captured = {}  # each block's inputs, captured once; the hooks go before timing (a hook is traced too)

    def capture(block):
        def hook(_m, args, kwargs):
            captured[block] = (args, kwargs)

        return hook

    with torch.no_grad(), fx_fp8.denoising_step(1):
        handles = [b.register_forward_pre_hook(capture(b), with_kwargs=True) for b in blocks]
        model(**kw)
        for h in handles:
            h.remove()
        for _ in range(3):
            model(**kw)

    def time_calls(calls: int) -> float:
        with torch.no_grad(), fx_fp8.denoising_step(1):
            start = time.perf_counter()
            for _ in range(calls):
                for block in blocks:
                    args, kwargs = captured[block]
                    block(*args, **kwargs)
            return 1e6 * (time.perf_counter() - start) / (calls * len(blocks))

    returned = list(_RETURNED)
    inner = [
        fn
        for d in returned
        if isinstance(d, InstanceDispatch)
        for _, fn in d.by_params.values()
        if isinstance(fn, StepDispatch)
    ]
    steps = [d for d in returned if isinstance(d, StepDispatch)] + inner
    instances = [d for d in returned if isinstance(d, InstanceDispatch)]
    params = {id(p): p for p in model.parameters()}  # the dispatch alone is called with the block's own
    return time_calls, [(d, params) for d in steps[:1] + instances[:1]]  # the step layer is measured first


_RETURNED: list = []
_real_compile_graph = backend.compile_graph


def _spy(*args, **kwargs):
    fn = _real_compile_graph(*args, **kwargs)
    _RETURNED.append(fn)
    return fn


def dispatch_alone_us(dispatcher, calls: int, params: dict) -> float:
    """The dispatcher's own cost: the same object, its compiled variants replaced by a no-op
    (`params`: {id: parameter} of the model, to call an InstanceDispatch with its anchors)."""

    def noop(*_):
        return None

    if isinstance(dispatcher, InstanceDispatch):
        args = [None] * (max(dispatcher.slots) + 1) if dispatcher.slots else []
        if dispatcher.slots:
            key = next(iter(dispatcher.by_params))
            for slot, pid in zip(dispatcher.slots, key if isinstance(key, tuple) else (key,)):
                args[slot] = params[pid]  # the anchor parameters of the first instance
            dispatcher.by_params = {k: (owner, noop) for k, (owner, _) in dispatcher.by_params.items()}
    else:
        dispatcher.variants = {k: noop for k in dispatcher.variants}
        args = []
    with fx_fp8.denoising_step(1):
        t = time.perf_counter()
        for _ in range(calls):
            dispatcher(*args)
        return 1e6 * (time.perf_counter() - t) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    from tabulate import tabulate

    backend.compile_graph = _spy
    setups = {name: compiled_blocks(config, args.device) for name, config in CONFIGS.items()}
    best = {name: float("inf") for name in CONFIGS}
    for _ in range(args.rounds):  # interleaved rounds, best of each: other load on the machine hits all alike
        for name, (time_calls, _) in setups.items():
            best[name] = min(best[name], time_calls(args.calls))
    base = best["inductor"]
    rows = [[name, f"{us:.1f}", f"{us - base:+.1f}"] for name, us in best.items()]
    alone = [
        [name, type(d).__name__, f"{dispatch_alone_us(d, 20000, params):.2f}"]
        for name, (_, dispatchers) in setups.items()
        for d, params in dispatchers
    ]
    print(tabulate(rows, headers=["backend", "µs per block call", "vs inductor"], tablefmt="github"))
    print()
    print(tabulate(alone, headers=["backend", "dispatcher", "µs per call, dispatch alone"], tablefmt="github"))


if __name__ == "__main__":
    main()
