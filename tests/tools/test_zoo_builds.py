"""The tiny model zoo (the registry fx_fp8.tools.model_zoo): every entry
builds, runs its 4 size variants, is seeded, and (slow) compiles to the graphs and attention kinds its
notes promise."""

from __future__ import annotations

import pytest
import torch

from fx_fp8.tools.model_zoo.inputs import VARIANTS
from fx_fp8.tools.model_zoo.registry import MODELS as ZOO, build, make_inputs, output_tensor

NAMES = list(ZOO)


def _require_class(name: str):
    import diffusers

    if not hasattr(diffusers, ZOO[name].class_name):
        pytest.skip(f"{ZOO[name].class_name} is not in diffusers {diffusers.__version__}")


def _flags(name: str) -> dict[str, str]:
    """The leading "; "-separated flags of an entry's notes: {"sdpa": "2", "cross-attn": "", ...}."""
    flags = {}
    for part in ZOO[name].notes.split("; "):
        key, _, value = part.partition("=")
        if key.replace("-", "").isalnum():
            flags[key] = value
    return flags


def _run(model, name, variant, seed=0):
    with torch.no_grad():
        return output_tensor(model(**make_inputs(name, model, seed=seed, variant=variant)))


def test_zoo_is_broad():
    assert len(ZOO) >= 30
    assert {e.kind for e in ZOO.values()} == {"image", "video", "audio"}
    for key, entry in ZOO.items():
        assert entry.name == key
        flags = _flags(key)
        assert "sdpa" in flags and ("cross-attn" in flags) != ("self-attn-only" in flags), entry.notes


@pytest.mark.parametrize("name", NAMES)
def test_builds_runs_and_is_seeded(name):
    _require_class(name)
    model = build(name, seed=0)
    assert type(model).__name__ == ZOO[name].class_name
    assert not model.training
    small, large = _run(model, name, 0), _run(model, name, VARIANTS - 1)
    assert torch.isfinite(small).all() and torch.isfinite(large).all()
    assert large.numel() > small.numel(), (small.shape, large.shape)
    again = build(name, seed=0).state_dict()
    assert all(torch.equal(again[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_all_variants_grow_and_seeds_matter(name):
    _require_class(name)
    model = build(name, seed=0)
    outs = [_run(model, name, v) for v in range(VARIANTS)]
    sizes = [o.numel() for o in outs]
    assert sizes == sorted(set(sizes)), f"variants do not grow: {[tuple(o.shape) for o in outs]}"
    assert all(torch.isfinite(o).all() for o in outs)
    # same seed, same output; another seed, other weights; inputs come from the seed only
    assert torch.equal(_run(build(name, seed=0), name, 0), outs[0])
    ref, other = model.state_dict(), build(name, seed=1).state_dict()
    assert any(not torch.equal(ref[k], v) for k, v in other.items())
    a, b = make_inputs(name, model, seed=3), make_inputs(name, model, seed=3)
    assert all(not isinstance(a[k], torch.Tensor) or torch.equal(a[k], b[k]) for k in a)


def _is_sdpa(node) -> bool:
    return node.op == "call_function" and "scaled_dot_product_attention" in getattr(node.target, "__name__", "")


def _val(node):
    meta = getattr(node, "meta", {})
    return meta.get("example_value", meta.get("val"))


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_compiles_like_eager_as_noted(name):
    """torch.compile(backend=eager-like) matches eager, with the graph count and SDPA kinds of the notes."""
    _require_class(name)
    model = build(name)
    kwargs = make_inputs(name, model, variant=0)
    with torch.no_grad():
        ref = output_tensor(model(**kwargs))

    graphs, sdpa = [], []

    def counting(gm, example_inputs):
        graphs.append(gm)
        for node in gm.graph.nodes:
            if _is_sdpa(node):
                args = list(node.args) + [None, None]
                q = args[0] if args[0] is not None else node.kwargs.get("query")
                k = args[1] if args[1] is not None else node.kwargs.get("key")
                sdpa.append((tuple(_val(q).shape), tuple(_val(k).shape)))
        return gm.forward

    with torch.no_grad():
        out = output_tensor(torch.compile(model, backend=counting)(**kwargs))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)

    flags = _flags(name)
    assert len(sdpa) == int(flags["sdpa"]), sdpa
    assert len(graphs) == int(flags.get("graphs", 1))
    cross = any(q[-2] != k[-2] for q, k in sdpa)
    assert cross == ("cross-attn" in flags), sdpa
