"""The one registry of tiny random diffusers transformers (image, video, audio) for tests,
benchmarks, the CLI and the tiny pipelines. Everything is built offline and in-process: no hub,
no network.

Each model is declared once, as a :class:`TinyModel`: its diffusers class, its tiny config, its
input maker (4 size variants, 0 = fewest attention tokens, 3 = most) and, for the five named
families (flux, qwen-image, wan, z-image, sd3), a :class:`Family`: aliases, the config keys a
layer count sets, one input maker driven by a transformer config (model_source uses it for
checkpoints loaded from folders too), and the pipelines they build. Declared in::

    inputs.py    size tables, shared input makers, the families' config-driven input makers
    families.py  the five families (hidden sizes 64-128)
    image.py, video.py, audio.py   the other zoo classes (hidden sizes 16-64, 1-2 layers)
    pipelines.py the tiny pipelines (real diffusers pipelines around the families' transformers)
    registry.py  the table (MODELS), lookup by name or alias, building models, inputs, pipelines
    not_in_zoo.py the diffusers transformer classes the zoo does not build, each with its reason

Two ways to build, one config: ``build(name)`` (the zoo: any entry, zero-initialised output
layers re-initialised at random so that every layer affects the output, global RNG untouched)
and ``build_tiny_transformer(family, layers=2)`` (a family as diffusers initialises it, a layer
count to choose, seeded through ``torch.manual_seed``)::

    model = build("cogvideox", seed=0)
    kwargs = make_inputs("cogvideox", model, seed=0, variant=2)
    out = output_tensor(model(**kwargs))

``TinyModel.notes`` starts with facts measured at variant 0, as "; "-separated flags, then free text:

- ``sdpa=N``: Dynamo captures N F.scaled_dot_product_attention call_function nodes (diffusers'
  attention dispatcher and direct calls alike); N grows with the layer counts;
- ``cross-attn`` where some SDPA has query length != key length, else ``self-attn-only``
  (joint text+image attention over one concatenated sequence counts as self-attention);
- ``mask`` where some SDPA gets an attn_mask; ``gqa`` where some SDPA has fewer kv than query heads;
- ``graphs=N`` where torch.compile(backend="eager", fullgraph=False) makes N > 1 graphs (breaks);
  absent means one graph. Every entry's compiled output equals its eager output (allclose 1e-5)
  at all variants (tests/tools/test_zoo_builds.py).

Configs are tiny versions of those in diffusers' own model tests, adapted to diffusers 0.42; the
sizes are chosen for speed, not to resemble a real checkpoint.
"""
