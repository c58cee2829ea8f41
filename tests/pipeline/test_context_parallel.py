"""FP8 under diffusers' context parallelism (Ulysses, ring), two processes on CPU over gloo.

Multi-process tests (marked slow, ~20-40 s each on 2 cores): `cp_helpers.launch` starts two
Python processes on 127.0.0.1 (a free port, a timeout, every process killed and reaped), each
installs the CPU shims documented in cp_helpers.py and runs one `worker_*` function below; the
test asserts on what the ranks return. In every worker the single-process references are
computed in the same process from a model built with the same seed (no parallelism).

In-process tests (fast) check the pieces the workers rely on: the CPU flash-attention shim, the
ring's merge of FP8 partial attentions with their log-sum-exp, the option parsing and the errors
fx_fp8 gives instead of diffusers' (or the launcher's) failures.
"""

from __future__ import annotations

import io
import json
import math
import sys
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import cp_helpers

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]

#: linears the family defaults keep native (the model-family sensitive layers), by family
SENSITIVE = {
    "flux": (
        "x_embedder",
        "context_embedder",
        "time_text_embed.timestep_embedder.linear_1",
        "time_text_embed.text_embedder.linear_1",
        "norm_out.linear",
        "proj_out",
        "transformer_blocks.0.norm1.linear",
        "single_transformer_blocks.0.norm.linear",
    ),
    "wan": (
        "condition_embedder.time_embedder.linear_1",
        "condition_embedder.time_proj",
        "condition_embedder.text_embedder.linear_1",
        "proj_out",
    ),
}
#: attention modules per family: (self-attention, cross-attention)
ATTENTION = {
    "flux": (
        (
            "transformer_blocks.0.attn",
            "transformer_blocks.1.attn",
            "single_transformer_blocks.0.attn",
            "single_transformer_blocks.1.attn",
        ),
        (),
    ),
    "wan": (("blocks.0.attn1", "blocks.1.attn1"), ("blocks.0.attn2", "blocks.1.attn2")),
}
LAYER_OF = {
    "transformer_blocks.0.attn": 0,
    "transformer_blocks.1.attn": 1,
    "single_transformer_blocks.0.attn": 2,
    "single_transformer_blocks.1.attn": 3,
    "blocks.0.attn1": 0,
    "blocks.1.attn1": 1,
    "blocks.0.attn2": 0,
    "blocks.1.attn2": 1,
}
DEGREES = {"ulysses": (2, 1), "ring": (1, 2)}


# =================================================================================================
# workers (run in the launched processes)
# =================================================================================================
def _out(o) -> torch.Tensor:
    from fx_fp8.tools.model_zoo.registry import output_tensor

    return output_tensor(o).detach().float()


def _err(a: torch.Tensor, b: torch.Tensor) -> dict:
    """max |a - b|, and ||a - b|| / ||b|| (b the reference)."""
    return {"max_abs": float((a - b).abs().max()), "rel": float((a - b).norm() / b.norm())}


def _rows(compiled) -> list:
    import fx_fp8

    return [
        dict(
            graph=r.graph_id,
            variant=r.step_variant,
            module=e.module,
            layer=e.layer,
            op=e.op,
            action=e.action,
            reason=e.reason,
            form=e.form,
        )
        for r in fx_fp8.get_reports(compiled)
        for e in r.entries
    ]


def _lse_ops(compiled) -> dict:
    """fx_fp8 attention ops in each compiled graph's final code (dump_graphs)."""
    import fx_fp8

    out = {"fp8_attention_lse": 0, "fp8_attention": 0}
    for r in fx_fp8.get_reports(compiled):
        if r.step_variant == "native" or not r.graphs:
            continue
        code = list(r.graphs.values())[-1]
        out["fp8_attention_lse"] += code.count("fx_fp8.fp8_attention_lse.default(")
        out["fp8_attention"] += code.count("fx_fp8.fp8_attention.default(")
    return out


def worker_transformer(rank: int, world: int, family: str, ulysses: int, ring: int) -> dict:
    """One tiny transformer under Ulysses / ring: single-process references, then the same model
    with context parallelism, natively and under backend="fp8" (default config, selectors,
    attention only)."""
    import fx_fp8
    from fx_fp8.pipeline.context_parallel import enable_context_parallel
    from fx_fp8.pipeline.options import ParallelOptions
    from fx_fp8.config.fp8_config import FP8Config
    from fx_fp8.steps import variant_listener
    from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs

    warnings.simplefilter("ignore")

    def build():
        return build_tiny_transformer(family, layers=2, seed=0)

    def compile_(model, cfg, dump=False):
        torch._dynamo.reset()
        return torch.compile(model, backend="fp8", options={"config": cfg, "dump_graphs": dump})

    ref = build()
    kwargs = dict(example_inputs(family, ref), return_dict=False)  # the CP gather hook needs a tensor output
    base = FP8Config.from_kwargs(lowering="reference", downstream="eager")
    attn_only = base.replace(quantization=None)
    selectors = base.replace(diffusion_kv_cache_skip_layers="1", diffusion_kv_cache_skip_steps="0")
    res: dict = {}
    with torch.no_grad():
        ref_native = _out(ref(**kwargs))
        c = compile_(ref, base)
        ref_fp8 = _out(c(**kwargs))
        res["ref_rows"] = _rows(c)
        c = compile_(ref, attn_only)
        ref_attn = _out(c(**kwargs))

        cp = build()
        info = enable_context_parallel(cp, ParallelOptions(ulysses_degree=ulysses, ring_degree=ring))
        res["attention_backend"] = info["attention_backend"]
        cp_native = _out(cp(**kwargs))
        c = compile_(cp, base, dump=True)
        cp_fp8 = _out(c(**kwargs))
        res["rows"], res["ops"] = _rows(c), _lse_ops(c)
        res["graphs"] = len(fx_fp8.get_reports(c))
        c = compile_(cp, attn_only)
        cp_attn = _out(c(**kwargs))
        c = compile_(cp, selectors)
        variants = []
        outs = []
        with variant_listener(variants.append):
            for step in (0, 1):
                with fx_fp8.denoising_step(step):
                    outs.append(_out(c(**kwargs)))
        res["selector_rows"], res["selector_variants"] = _rows(c), variants
        gathered = [torch.empty_like(cp_fp8) for _ in range(world)]
        torch.distributed.all_gather(gathered, cp_fp8.contiguous())
    res["errors"] = {
        "cp_native_vs_single_native": _err(cp_native, ref_native),
        "cp_fp8_vs_single_fp8": _err(cp_fp8, ref_fp8),
        "cp_fp8_vs_single_native": _err(cp_fp8, ref_native),
        "single_fp8_vs_single_native": _err(ref_fp8, ref_native),
        "cp_attn_fp8_vs_single_attn_fp8": _err(cp_attn, ref_attn),
        "cp_attn_fp8_vs_single_native": _err(cp_attn, ref_native),
        "single_attn_fp8_vs_single_native": _err(ref_attn, ref_native),
        "step0_native_attention_vs_step1": _err(outs[0], outs[1]),
        "ranks_agree": _err(gathered[-1], gathered[0]),
    }
    return res


def _count_call(module, args) -> None:
    """Forward pre-hook: one more run of `module` (a tensor counter, so it also counts inside compiled graphs)."""
    module._fx_count.add_(1)


def worker_pipeline(rank: int, world: int, steps: int, threshold: float) -> dict:
    """compile_pipeline with parallel_config (Ulysses 2) and cache_backend first_block_cache on the
    tiny Flux pipeline, against the same pipeline in one process (FP8 + cache, and cache only)."""
    import fx_fp8
    from fx_fp8.pipeline.cache_hooks import enable_cache
    from fx_fp8 import pipeline_state
    from fx_fp8.tools.model_zoo.registry import build_tiny_pipeline

    warnings.simplefilter("ignore")
    cache = {"threshold": threshold}
    res: dict = {}

    def counted(pipe):
        """Count the runs of each block's attention (to_q is called iff the block computes)."""
        mods = []
        for name, m in (
            pipe.transformer._orig_mod.named_modules()
            if hasattr(pipe.transformer, "_orig_mod")
            else pipe.transformer.named_modules()
        ):
            if name.endswith("attn.to_q"):
                m._fx_count = torch.zeros((), dtype=torch.long)
                m.register_forward_pre_hook(_count_call)
                mods.append(m)
        return mods

    def run(pipe):
        return pipe(
            **kwargs, num_inference_steps=steps, generator=torch.Generator().manual_seed(0), output_type="latent"
        ).images.float()

    # one process: cache only (native), then FP8 + cache
    pipe, kwargs = build_tiny_pipeline("flux")
    enable_cache(pipe.transformer, "first_block_cache", cache)
    cache_native = run(pipe)
    pipe, kwargs = build_tiny_pipeline("flux")
    torch._dynamo.reset()
    fx_fp8.compile_pipeline(
        pipe,
        {"diffusion_kv_cache_skip_steps": "0", "lowering": "reference"},
        cache_backend="first_block_cache",
        cache_config=cache,
    )
    mods = counted(pipe)
    single = run(pipe)
    res["single_calls"] = [int(m._fx_count) for m in mods]
    # two processes: Ulysses 2 + the same cache, through compile_pipeline's options
    pipe, kwargs = build_tiny_pipeline("flux")
    torch._dynamo.reset()
    fx_fp8.compile_pipeline(
        pipe,
        {"diffusion_kv_cache_skip_steps": "0", "lowering": "reference", "parallel_config": {"ulysses_degree": world}},
        cache_backend="first_block_cache",
        cache_config=cache,
    )
    mods = counted(pipe)
    cp = run(pipe)
    res["cp_calls"] = [int(m._fx_count) for m in mods]
    from torch._dynamo.utils import counters

    counters.clear()
    cp_again = run(pipe)
    res["frames_second_run"] = dict(counters["frames"])
    res["step_variants"] = pipeline_state(pipe).step_variants()
    res["rows"] = _rows(pipe.transformer)
    res["extras"] = {
        "regions": list(pipeline_state(pipe).extras["transformer"].regions.modules),
        "fbc_synced": pipeline_state(pipe).extras["transformer"].fbc_synced,
        "backend": pipeline_state(pipe).extras["transformer"].parallel["attention_backend"],
    }
    res["errors"] = {
        "cp_vs_single_fp8": _err(cp, single),
        "cp_vs_cache_only_native": _err(cp, cache_native),
        "single_fp8_vs_cache_only_native": _err(single, cache_native),
        "second_run": _err(cp_again, cp),
    }
    return res


def worker_cli(rank: int, world: int, out_dir: str) -> dict:
    """What `torchrun --nproc-per-node 2 examples/text_to_image.py --ulysses-degree 2 ...` and
    `torchrun --nproc-per-node 2 -m fx_fp8 compare --ulysses-degree 2 ...` run on each rank (the
    launcher sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT / LOCAL_RANK as torchrun does)."""
    import importlib.util

    warnings.simplefilter("ignore")
    spec = importlib.util.spec_from_file_location("text_to_image", ROOT / "examples" / "text_to_image.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = Path(out_dir) / "t2i.png"
    buf = io.StringIO()
    with redirect_stdout(buf):
        code = example.main(
            [
                "--ulysses-degree",
                str(world),
                "--num-inference-steps",
                "3",
                "--output",
                str(out),
                "--cache-backend",
                "first_block_cache",
                "--cache-config",
                '{"threshold": 0.05}',
            ]
        )
    res = {"example_code": code, "example_stdout": buf.getvalue(), "example_wrote": out.exists()}
    from fx_fp8.tools import cli

    buf = io.StringIO()
    with redirect_stdout(buf):
        code = cli.main(
            [
                "compare",
                "--model",
                "flux",
                "--ulysses-degree",
                str(world),
                "--steps",
                "3",
                "--prompts",
                "1",
                "--format",
                "json",
            ]
        )
    res.update(compare_code=code, compare_stdout=buf.getvalue())
    return res


# =================================================================================================
# in-process tests
# =================================================================================================
def test_cpu_flash_shim_matches_sdpa():
    """Shim 2 of cp_helpers: the CPU aten::_scaled_dot_product_flash_attention gives SDPA's output
    and the natural-log log-sum-exp of the scaled scores, fp32 (B, H, Sq)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 16, generator=g) for _ in range(3))
    out, lse, *rest = cp_helpers.cpu_flash_attention(q, k, v, scale=0.3)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=0.3), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(q @ k.transpose(-1, -2) * 0.3, -1), atol=1e-5, rtol=1e-5)
    assert lse.dtype == torch.float32 and lse.shape == (2, 3, 40) and rest[2:4] == [40, 40]


def _ring_merge(parts):
    """diffusers' TemplatedRingAttention merge of (out (B,S,H,D), lse (B,S,H)) partials, in fp32."""
    prev_out = prev_lse = None
    for out, lse in parts:
        out, lse = out.float(), lse.float().unsqueeze(-1)
        if prev_out is not None:
            out = prev_out - torch.sigmoid(lse - prev_lse) * (prev_out - out)
            lse = prev_lse - F.logsigmoid(prev_lse - lse)
        prev_out, prev_lse = out, lse
    return prev_out


@pytest.mark.parametrize("offset", [0.0, 3.0])
def test_ring_merge_of_fp8_partials(offset):
    """Each ring step is fx_fp8::fp8_attention_lse on one key/value chunk; merged with the
    partials' log-sum-exp exactly as diffusers merges native ones, the result is as close to exact
    attention as single FP8 attention is. `offset` gives K a large per-chunk mean: the K-smoothing
    shift must be folded back into each chunk's LSE or the merge weights are wrong."""
    from fx_fp8.config.attention import AttentionQuantConfig

    c = AttentionQuantConfig()
    kw = dict(
        granularity=c.granularity,
        q_block=c.q_block,
        kv_block=c.kv_block,
        hadamard=c.hadamard,
        smooth_k=c.smooth_k,
        quantize_p=c.quantize_p,
        p_scale=float(c.p_scale),
        attention_kernel=c.kernel,
        lowering="reference",
    )
    g = torch.Generator().manual_seed(1)
    b, h, s, d = 1, 2, 96, 32
    q = torch.randn(b, h, s, d, generator=g)
    k = torch.randn(b, h, 2 * s, d, generator=g)
    k[..., s:, :] += offset * torch.randn(d, generator=g)  # the second chunk's keys share a large mean
    v = torch.randn(b, h, 2 * s, d, generator=g)
    scale = 1 / math.sqrt(d)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=scale).float()
    parts = []
    for sl in (slice(0, s), slice(s, 2 * s)):
        out, lse = torch.ops.fx_fp8.fp8_attention_lse(q, k[..., sl, :], v[..., sl, :], None, scale, **kw)
        parts.append((out.transpose(1, 2), lse.transpose(1, 2)))
    merged = _ring_merge(parts).transpose(1, 2)
    single = torch.ops.fx_fp8.fp8_attention(q, k, v, None, scale, **kw)
    err_ring = float((merged - exact).norm() / exact.norm())
    err_single = float((single - exact).norm() / exact.norm())
    assert err_ring < 0.1 and err_ring < 1.5 * err_single + 1e-3, (err_ring, err_single)
    if offset:
        # control: the LSE of the smoothed scores, without the shift folded back, merges wrongly
        shifted = []
        for (out, lse), sl in zip(parts, (slice(0, s), slice(s, 2 * s))):
            shift = (q @ k[..., sl, :].mean(-2, keepdim=True).transpose(-1, -2)).squeeze(-1) * scale  # (B, H, Sq)
            shifted.append((out, lse - shift.transpose(1, 2)))
        wrong = _ring_merge(shifted).transpose(1, 2)
        assert float((wrong - exact).norm() / exact.norm()) > 3 * err_single
    # the native partials merged the same way are exact: the merge itself is right
    native = [
        cp_helpers.cpu_flash_attention(q, k[..., sl, :], v[..., sl, :], scale=scale)[:2]
        for sl in (slice(0, s), slice(s, 2 * s))
    ]
    merged_native = _ring_merge([(o.transpose(1, 2), l.transpose(1, 2)) for o, l in native]).transpose(1, 2)
    torch.testing.assert_close(merged_native, exact, atol=1e-5, rtol=1e-5)


def test_a_linear_carrying_a_diffusers_hook_keeps_it_and_is_quantized_at_compile_time():
    """`fx-fp8 compare` applies context parallelism to the native run, which diffusers cannot undo,
    so compile_pipeline meets proj_out carrying its output gather (`cp_output---proj_out`). prepare_model
    leaves it unreplaced (the hook lives on the module and its patched forward), says so, and the
    backend quantizes it (weight-only: a sensitive layer) at compile time with the hook still running.
    The hook here doubles proj_out's output, so a lost hook shows in the latents."""
    import fx_fp8
    from diffusers.hooks import HookRegistry, ModelHook
    from fx_fp8 import pipeline_state
    from fx_fp8.tools.model_zoo.registry import build_tiny_pipeline

    class Doubling(ModelHook):
        def post_forward(self, module, output):
            return output * 2

    def run(pipe, kwargs):
        return pipe(
            **kwargs, num_inference_steps=2, output_type="latent", generator=torch.Generator().manual_seed(0)
        ).images.float()

    name = "cp_output---proj_out"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe, kwargs = build_tiny_pipeline("flux")
        plain = run(pipe, kwargs)
        hook = Doubling()
        HookRegistry.check_if_exists_or_initialize(pipe.transformer.proj_out).register_hook(hook, name)
        ref = run(pipe, kwargs)
    assert float((ref - plain).norm() / plain.norm()) > 0.1  # the hook matters
    transformer = pipe.transformer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fx_fp8.compile_pipeline(pipe, {"lowering": "reference", "downstream": "eager"})
        out = run(pipe, kwargs)
    assert any(
        "left 1 linear(s) carrying diffusers hooks unreplaced" in str(w.message) and "proj_out" in str(w.message)
        for w in caught
    )
    prepared = pipeline_state(pipe).prepared["transformer"]
    assert list(prepared["hooked"]) == ["proj_out"] and name in prepared["hooked"]["proj_out"]
    assert "proj_out" not in prepared["quantized"] and "proj_out" not in prepared["native"]
    assert prepared["weight_only"]  # the other sensitive layers were prepared weight-only
    assert type(transformer.proj_out) is torch.nn.Linear
    assert transformer.proj_out._diffusers_hook.get_hook(name) is hook
    row = [e for r in fx_fp8.get_reports(pipe.transformer) for e in r.entries if e.module == "proj_out"]
    assert row and {e.action for e in row} == {"weight-only"}, [(e.action, e.reason) for e in row]
    assert all("weights quantized at compile" in e.reason for e in row)
    assert 0 < float((out - ref).norm() / ref.norm()) < 0.05


def test_parallel_options_are_checked_and_named():
    from fx_fp8.pipeline.options import ParallelOptions, PipelineOptions

    assert ParallelOptions.from_value({"ulysses_degree": 2}).world_size == 2
    assert ParallelOptions.from_value({"ulysses_degree": 2, "ring_degree": 2}).world_size == 4
    assert not ParallelOptions.from_value(None).enabled
    for bad, words in (
        ({"ulysses_degree": 0}, "ulysses_degree 0"),
        ({"ring_degree": "x"}, "ring_degree 'x'"),
        ({"ulysses_degree": True}, "ulysses_degree True"),
        ({"cfg_parallel_size": 2}, "'cfg_parallel_size'"),
        ({"ulysess_degree": 2}, "did you mean"),
        ([2, 1], "expected a mapping"),
    ):
        with pytest.raises(ValueError, match=words.replace("(", r"\(")):
            PipelineOptions(parallel=bad)


def test_yaml_carries_pipeline_keys_next_to_fp8_keys(tmp_path):
    """A flat YAML and a vLLM-Omni stage config carry parallel_config / cache_backend /
    cache_config; FP8Config reads the FP8 keys and ignores them, PipelineOptions reads them."""
    import yaml

    from fx_fp8.config.fp8_config import FP8Config
    from fx_fp8.pipeline.options import PipelineOptions

    flat = {
        "diffusion_kv_cache_dtype": "fp8",
        "diffusion_kv_cache_skip_steps": "0",
        "parallel_config": {"ulysses_degree": 2, "ring_degree": 1},
        "cache_backend": "first_block_cache",
        "cache_config": {"threshold": 0.1},
    }
    stage = {"stage_args": [{"stage_id": 0, "stage_type": "diffusion", "engine_args": dict(flat)}]}
    for i, data in enumerate((flat, stage)):
        path = tmp_path / f"c{i}.yaml"
        path.write_text(yaml.safe_dump(data))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the pipeline keys are no "engine_args keys not used" warning
            cfg = FP8Config.load(str(path))
        assert cfg.attention_enabled and 0 in cfg.diffusion_kv_cache_skip_steps
        opts = PipelineOptions.load(str(path))
        assert opts.parallel.ulysses_degree == 2 and opts.cache_backend == "first_block_cache"
        assert opts.cache_config == {"threshold": 0.1}
        # explicit arguments win over the YAML; a different backend drops the YAML's cache_config
        opts = PipelineOptions.load(str(path), parallel_config={"ring_degree": 2}, cache_backend="taylorseer")
        assert (opts.parallel.ulysses_degree, opts.parallel.ring_degree) == (1, 2)
        assert opts.cache_backend == "taylorseer" and opts.cache_config == {}
    # as torch.compile options they are refused by name (they are pipeline options)
    with pytest.raises(ValueError, match="'parallel_config' is a pipeline option"):
        FP8Config.from_kwargs(parallel_config={"ulysses_degree": 2})


def test_context_parallel_needs_torchrun_and_says_how(monkeypatch):
    """Degrees > 1 outside a torch.distributed job: a ValueError naming the torchrun command."""
    from fx_fp8.pipeline.launch import init_distributed
    from fx_fp8.pipeline.options import ParallelOptions

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(sys, "argv", ["examples/text_to_image.py", "--ulysses-degree", "2"])
    with pytest.raises(
        ValueError,
        match=r"needs 2 processes.*torchrun --nproc-per-node 2 "
        r"examples/text_to_image.py --ulysses-degree 2",
    ):
        init_distributed(ParallelOptions(ulysses_degree=2))


def test_no_accelerator_is_a_clear_error(monkeypatch):
    """diffusers divides by torch.accelerator.device_count(): fx_fp8 says why instead (the tests
    shim the count in their worker processes only)."""
    from fx_fp8.pipeline.launch import check_accelerator

    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 0)
    with pytest.raises(RuntimeError, match="needs an accelerator.*device count 0"):
        check_accelerator()


def test_ring_without_a_flash_kernel_is_refused():
    """Ring attention needs aten._scaled_dot_product_flash_attention, which torch has no CPU kernel
    for (the tests register one in the workers): refused with the reason, not a dispatcher error."""
    from fx_fp8.pipeline.attention_backend import choose_attention_backend
    from fx_fp8.pipeline.options import ParallelOptions
    from fx_fp8.tools.model_zoo.registry import build_tiny_transformer

    if torch._C._dispatch_has_kernel_for_dispatch_key("aten::_scaled_dot_product_flash_attention", "CPU"):
        pytest.skip("a CPU flash kernel is registered in this process")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny_transformer("flux")
    with pytest.raises(RuntimeError, match="no cpu kernel.*use ulysses_degree"):
        choose_attention_backend(model, ParallelOptions(ring_degree=2))
    # Ulysses keeps diffusers' native backend, whatever the device
    assert choose_attention_backend(model, ParallelOptions(ulysses_degree=2)) == "native"


def test_heads_must_divide_by_ulysses_degree():
    from fx_fp8.pipeline.apply_options import check_pipeline_options
    from fx_fp8.pipeline.options import PipelineOptions
    from fx_fp8.tools.model_zoo.registry import build_tiny_transformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny_transformer("flux")  # 2 heads
    with pytest.raises(ValueError, match="ulysses_degree 4 does not divide FluxTransformer2DModel's 2 attention heads"):
        check_pipeline_options(PipelineOptions(parallel={"ulysses_degree": 4}), [model], compile_kwargs={})


def test_cli_flags_map_onto_pipeline_options(tmp_path):
    import argparse

    from fx_fp8.tools import cli_flags

    parser = cli_flags.add_pipeline_flags(cli_flags.add_fp8_flags(argparse.ArgumentParser()))
    args = parser.parse_args(
        ["--ulysses-degree", "2", "--cache-backend", "first_block_cache", "--cache-config", '{"threshold": 0.2}']
    )
    opts = cli_flags.pipeline_options_from_args(args)
    assert opts.parallel.ulysses_degree == 2 and opts.parallel.ring_degree == 1
    assert opts.cache_backend == "first_block_cache" and opts.cache_config == {"threshold": 0.2}
    # the YAML's degrees, one of them overridden by a flag
    path = tmp_path / "c.yaml"
    path.write_text("parallel_config: {ulysses_degree: 2, ring_degree: 2}\n")
    args = parser.parse_args(["--config", str(path), "--ring-degree", "1"])
    opts = cli_flags.pipeline_options_from_args(args)
    assert (opts.parallel.ulysses_degree, opts.parallel.ring_degree) == (2, 1)
    with pytest.raises(SystemExit), redirect_stderr(io.StringIO()) as err:
        parser.parse_args(["--ulysses-degree", "0"])
    assert "invalid degree '0'" in err.getvalue()


def test_compare_without_torchrun_exits_2_naming_the_command(capsys, monkeypatch):
    from fx_fp8.tools import cli

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(sys, "argv", ["fx-fp8", "compare", "--ring-degree", "2"])
    assert cli.main(["compare", "--model", "flux", "--ring-degree", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "torchrun --nproc-per-node 2 -m fx_fp8 compare --ring-degree 2" in err


# =================================================================================================
# multi-process tests
# =================================================================================================
def _attention_rows(rows, variant=None):
    return [r for r in rows if r["op"] == "attention" and r["variant"] == variant]


@pytest.mark.slow
@pytest.mark.parametrize("family,mode", [("flux", "ulysses"), ("flux", "ring"), ("wan", "ulysses"), ("wan", "ring")])
def test_context_parallel_fp8(tmp_path, family, mode):
    ulysses, ring = DEGREES[mode]
    results = cp_helpers.launch(
        HERE,
        "worker_transformer",
        nprocs=2,
        timeout=300,
        tmp_path=tmp_path,
        args=dict(family=family, ulysses=ulysses, ring=ring),
    )
    r0 = results[0]
    print(
        f"\n{family} {mode} ({r0['graphs']} graph(s), backend {r0['attention_backend']}): " + json.dumps(r0["errors"])
    )
    self_attn, cross_attn = ATTENTION[family]
    steps = 2 if mode == "ring" else 1  # ring: one partial attention per ring step
    assert r0["attention_backend"] == ("_native_flash" if mode == "ring" else "native")

    for r in results:
        e = r["errors"]
        # diffusers' context parallelism itself is exact on gloo
        assert e["cp_native_vs_single_native"]["rel"] < 1e-5
        # FP8 under CP stays within 1e-2 of single-process FP8, and as close to native as single FP8
        assert e["cp_fp8_vs_single_fp8"]["rel"] < 1e-2
        assert e["cp_fp8_vs_single_native"]["rel"] < 2 * e["single_fp8_vs_single_native"]["rel"] + 2e-3
        assert e["cp_attn_fp8_vs_single_attn_fp8"]["rel"] < (1e-3 if mode == "ulysses" else 1e-2)
        assert e["cp_attn_fp8_vs_single_native"]["rel"] < 2 * e["single_attn_fp8_vs_single_native"]["rel"] + 2e-3
        assert e["ranks_agree"]["max_abs"] == 0.0

    # every self-attention is FP8 (every ring step of it), cross-attention stays native
    attn = _attention_rows(r0["rows"])
    fp8 = sorted(a["module"] for a in attn if a["action"] == "fp8")
    assert fp8 == sorted(m for m in self_attn for _ in range(steps))
    assert sorted(a["module"] for a in attn if a["action"] == "native") == sorted(cross_attn)
    assert all("cross-attention" in a["reason"] for a in attn if a["action"] == "native")
    assert all(a["layer"] == LAYER_OF[a["module"]] for a in attn)
    if mode == "ring":
        # each ring step's partial attention is the FP8 op that returns the log-sum-exp
        assert {a["form"] for a in attn if a["action"] == "fp8"} == {"flash"}
        assert r0["ops"] == {"fp8_attention_lse": len(fp8), "fp8_attention": 0}
    else:
        assert {a["form"] for a in attn} == {"sdpa"} and r0["ops"]["fp8_attention_lse"] == 0
    if family == "flux":
        assert r0["graphs"] == 1  # Ulysses / ring between collectives: one graph

    # sensitive layers run weight-only by default (native where too small to quantize), never W8A8;
    # CP never quantizes a linear single-process FP8 keeps native
    linear = {x["module"]: x for x in r0["rows"] if x["op"] == "linear"}
    ref_linear = {x["module"]: x for x in r0["ref_rows"] if x["op"] == "linear"}
    for name in SENSITIVE[family]:
        row = linear[name]
        assert row["action"] == "weight-only" or "small layer" in row["reason"], (name, row["reason"])
    assert any(linear[name]["action"] == "weight-only" for name in SENSITIVE[family])
    assert {n for n, x in linear.items() if x["action"] == "fp8"} <= {
        n for n, x in ref_linear.items() if x["action"] == "fp8"
    }
    # ... and decides every linear exactly as one process does (the all_to_all is no pooling)
    differ = sorted(n for n in linear if linear[n]["action"] != ref_linear[n]["action"])
    assert not differ, (differ, linear[differ[0]]["reason"] if differ else "")

    # layer selector (layer 1) and step selector (step 0) under CP
    assert r0["selector_variants"][: len(r0["selector_variants"]) // 2] == ["native"] * (
        len(r0["selector_variants"]) // 2
    )
    assert set(r0["selector_variants"][len(r0["selector_variants"]) // 2 :]) == {"fp8"}
    for a in _attention_rows(r0["selector_rows"], "fp8"):
        if a["module"] not in self_attn:
            assert a["action"] == "native"  # cross-attention: its own reason comes first
        elif a["layer"] == 1:
            assert a["action"] == "native" and "layer 1 in diffusion_kv_cache_skip_layers" in a["reason"]
        else:
            assert a["action"] == "fp8"
    assert {a["action"] for a in _attention_rows(r0["selector_rows"], "native")} == {"native"}
    assert r0["errors"]["step0_native_attention_vs_step1"]["max_abs"] > 0


@pytest.mark.slow
def test_compile_pipeline_ulysses_with_first_block_cache(tmp_path):
    """compile_pipeline(parallel_config={ulysses_degree: 2}, cache_backend="first_block_cache") on the
    tiny Flux pipeline in two processes: the same blocks are skipped as in one process (the ranks
    decide on the whole sequence), FP8 is applied with the names and steps of the model, a second
    run compiles nothing, and the latents match the single-process run."""
    results = cp_helpers.launch(
        HERE, "worker_pipeline", nprocs=2, timeout=300, tmp_path=tmp_path, args=dict(steps=6, threshold=0.4)
    )
    r0 = results[0]
    print("\npipeline: " + json.dumps(r0["errors"]) + f" calls single {r0['single_calls']} cp {r0['cp_calls']}")
    for r in results:
        assert r["cp_calls"] == r["single_calls"] == r0["cp_calls"]
        assert r["errors"]["cp_vs_single_fp8"]["rel"] < 1e-2
        assert r["errors"]["second_run"]["max_abs"] == 0.0
        assert r["frames_second_run"] == {}
    assert r0["cp_calls"][0] == 6 and min(r0["cp_calls"][1:]) < 6  # blocks after the first were skipped
    assert r0["extras"]["backend"] == "native" and r0["extras"]["fbc_synced"] >= 1
    assert len(r0["extras"]["regions"]) == 4
    assert r0["step_variants"][0] == ["native"] and r0["step_variants"][1] == ["fp8"]
    attn = [x for x in r0["rows"] if x["op"] == "attention" and x["variant"] == "fp8"]
    assert sorted((a["module"], a["action"]) for a in attn) == sorted((m, "fp8") for m in ATTENTION["flux"][0])
    e = r0["errors"]
    assert e["cp_vs_cache_only_native"]["rel"] < 2 * e["single_fp8_vs_cache_only_native"]["rel"] + 5e-3


@pytest.mark.slow
def test_examples_and_compare_under_two_processes(tmp_path):
    """The text-to-image example and `fx-fp8 compare` with --ulysses-degree 2, as torchrun would
    start them: both ranks run, rank 0 alone prints and writes."""
    results = cp_helpers.launch(
        HERE, "worker_cli", nprocs=2, timeout=300, tmp_path=tmp_path, args=dict(out_dir=str(tmp_path))
    )
    r0, r1 = results
    assert r0["example_code"] == r1["example_code"] == 0
    assert "context parallel: ulysses 2 x ring 1 (2 processes)" in r0["example_stdout"]
    assert "fp8 (fp8) + ulysses 2 x ring 1 + first_block_cache" in r0["example_stdout"]
    assert r1["example_stdout"] == "" and r0["example_wrote"]
    assert r0["compare_code"] == r1["compare_code"] == 0 and r1["compare_stdout"] == ""
    data = json.loads(r0["compare_stdout"])
    assert data["pipeline_options"]["parallel_config"] == {"ulysses_degree": 2, "ring_degree": 1}
    assert data["latents_psnr_db"] > 25
