#!/usr/bin/env python
"""Sensitive linears of a model Dynamo splits into many pieces: diffusers' WanAnimate2Transformer3DModel
(tiny random config, graph breaks, some frames eager) under backend="fp8" with FP8 linears.

Prints, per input seed, the relative L2 error against fp32 native of: backend="fp8" (quantization fp8,
default sensitive handling), the same with the name fallback emptied (structure only), and bf16
(the model cast to bfloat16: the noise floor). Then the decisions: which linears stay native and why.

    OMP_NUM_THREADS=1 python benchmarks/wan_animate_sensitive.py --inputs 3
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
import warnings

import torch

import fx_fp8
from fx_fp8.quant import rules


def build():
    from diffusers import WanAnimate2Transformer3DModel

    from fx_fp8.tools.model_zoo.registry import reinit_zero_layers

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = WanAnimate2Transformer3DModel(
            patch_size=(1, 2, 2),
            text_len=16,
            in_dim=36,
            dim=128,
            ffn_dim=256,
            freq_dim=64,
            text_dim=32,
            out_dim=16,
            num_heads=4,
            num_layers=2,
            cross_attn_norm=True,
            use_img_emb=True,
        ).eval()
    reinit_zero_layers(model)
    return model


def inputs(seed: int, dtype=torch.float32) -> dict:
    from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

    g = torch.Generator().manual_seed(seed)
    # kv_cache_mode 'extract' (the reference pass) runs at a fixed timestep: the seed varies the tensors
    return dict(
        hidden_states=[torch.randn(16, 2, 4, 4, generator=g).to(dtype)],
        timestep=torch.tensor([1.0]),
        encoder_hidden_states=[torch.randn(8, 32, generator=g).to(dtype)],
        condition_latents=[torch.randn(20, 2, 4, 4, generator=g).to(dtype)],
        encoder_hidden_states_image=torch.randn(1, 4, 1280, generator=g).to(dtype),
        kv_cache=WanAnimate2KVCache(2),
        kv_cache_mode="extract",
        seq_len=8,
        offset_grid_sizes=torch.tensor([[2, 2, 2]]),
        return_dict=False,
    )


def rel(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


@contextlib.contextmanager
def no_name_fallback():
    saved = rules.SENSITIVE_LAYER_PATTERNS
    rules.SENSITIVE_LAYER_PATTERNS = ()
    try:
        yield
    finally:
        rules.SENSITIVE_LAYER_PATTERNS = saved


@contextlib.contextmanager
def timed_analysis(spent: list):
    """Adds the seconds each call of the structural analysis takes to `spent`."""
    from fx_fp8.compile import backend

    real = backend.find_sensitive_linears

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t0)

    backend.find_sensitive_linears = timed
    try:
        yield
    finally:
        backend.find_sensitive_linears = real


def run(model, seeds, names: bool, spent: list):
    torch._dynamo.reset()
    with (
        torch.no_grad(),
        warnings.catch_warnings(),
        timed_analysis(spent),
        contextlib.nullcontext() if names else no_name_fallback(),
    ):
        warnings.simplefilter("ignore")
        c = torch.compile(model, backend="fp8", options={"quantization": "fp8"})
        t0 = time.perf_counter()
        outs = [c(**inputs(s))[0][0] for s in seeds[:1]]
        first = time.perf_counter() - t0
        outs += [c(**inputs(s))[0][0] for s in seeds[1:]]
    rows = {e.module: e for r in fx_fp8.get_reports(c) for e in r.entries if e.op == "linear"}
    return outs, rows, first, len(fx_fp8.get_reports(c))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=3, help="input seeds (mean over them)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    seeds = list(range(args.inputs))
    model = build()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        refs = [model(**inputs(s))[0][0] for s in seeds]
        bf = copy.deepcopy(model).to(torch.bfloat16)
        floor = [rel(bf(**inputs(s, torch.bfloat16))[0][0], r) for s, r in zip(seeds, refs)]
    spent: list = []
    full, rows, t_full, graphs = run(model, seeds, names=True, spent=spent)
    struct, rows_s, t_struct, _ = run(model, seeds, names=False, spent=[])
    err = [rel(o, r) for o, r in zip(full, refs)]
    err_s = [rel(o, r) for o, r in zip(struct, refs)]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(f"WanAnimate2Transformer3DModel (tiny), {graphs} compiled graphs, {len(rows)} linears, {len(seeds)} seeds")
    print("| column | rel. error (mean) | per seed | first call (s) |")
    print("|---|---|---|---|")
    print(f"| bf16 model (noise floor) | {mean(floor):.2%} | {', '.join(f'{e:.2%}' for e in floor)} | |")
    print(f"| fp8, structure + names | {mean(err):.2%} | {', '.join(f'{e:.2%}' for e in err)} | {t_full:.1f} |")
    print(f"| fp8, structure only | {mean(err_s):.2%} | {', '.join(f'{e:.2%}' for e in err_s)} | {t_struct:.1f} |")
    print(
        f"structural analysis: {sum(spent) * 1e3:.1f} ms over {len(spent)} graphs "
        f"({sum(spent) / t_full:.2%} of the first compiled call, {t_full:.1f} s)"
    )
    print()
    print("| linear | structure + names | structure only |")
    print("|---|---|---|")
    for name in sorted(rows):
        a, b = rows[name], rows_s.get(name)
        short = lambda e: e.action if e.action != "native" else f"native: {e.reason.split(';')[0]}"  # noqa: E731
        print(f"| {name} | {short(a)} | {short(b) if b else '-'} |")


if __name__ == "__main__":
    main()
