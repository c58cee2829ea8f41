"""Tests for the shipped tiny text-to-image model (``fx_fp8.tools.tiny_model``); CPU, offline."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from diffusers import FluxTransformer2DModel

from fx_fp8.tools.tiny_model import (
    COLORS,
    SHAPES,
    TINY_MODEL_DIR,
    TinyPromptEncoder,
    TinyShapesPipeline,
    load_tiny_pipeline,
    random_prompt,
    render_prompt_image,
)
from fx_fp8.tools.tiny_model.shapes import all_prompts, color_match_rates, dominant_colors, parse_prompt

N_QUALITY = 30  # prompts (each with its own seed) for the colour-match check


@pytest.fixture(scope="module")
def pipe() -> TinyShapesPipeline:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    p = load_tiny_pipeline()
    p.set_progress_bar_config(disable=True)
    return p


def _quality_prompts(n: int = N_QUALITY) -> list[str]:
    rng = np.random.default_rng(2024)
    return [random_prompt(rng) for _ in range(n)]


def _color_match_rates(pipe: TinyShapesPipeline, prompts: list[str]) -> tuple[float, float]:
    """Fraction of images whose (shape colour, background colour), measured by classifying
    each pixel to the nearest palette colour, match the prompt."""
    generators = [torch.Generator().manual_seed(1000 + i) for i in range(len(prompts))]
    images = pipe(prompts, generator=generators, output_type="np").images
    return color_match_rates(prompts, images)


# --------------------------------------------------------------------------- data / grammar


def test_vocabulary_and_grammar():
    assert len(COLORS) == 6 and set(SHAPES) == {"circle", "square", "triangle", "cross"}
    prompts = all_prompts()
    assert len(prompts) == 6 * 4 * 5 == len(set(prompts))
    assert parse_prompt("a red circle on a blue background") == ("red", "circle", "blue")
    rng = np.random.default_rng(0)
    for _ in range(50):
        c, s, b = parse_prompt(random_prompt(rng))
        assert c != b and s in SHAPES


@pytest.mark.parametrize("bad", ["purple", "hexagon", "under"])
def test_parser_rejects_unknown_word(bad):
    prompt = {
        "purple": "a purple circle on a blue background",
        "hexagon": "a red hexagon on a blue background",
        "under": "a red circle under a blue background",
    }[bad]
    with pytest.raises(ValueError, match=repr(bad)):
        parse_prompt(prompt)
    with pytest.raises(ValueError, match=repr(bad)):
        render_prompt_image(prompt)
    with pytest.raises(ValueError, match=repr(bad)):
        TinyPromptEncoder().tokenize(prompt)


def test_parser_rejects_bad_grammar():
    with pytest.raises(ValueError):
        parse_prompt("a red circle on a red background")
    with pytest.raises(ValueError):
        parse_prompt("red a circle on a blue background")


def test_renderer_and_colour_metric():
    rng = np.random.default_rng(0)
    for prompt in all_prompts():
        img = render_prompt_image(prompt, rng)
        assert img.shape == (32, 32, 3) and img.dtype == np.uint8
        color, _, background = parse_prompt(prompt)
        assert dominant_colors(img) == (color, background)
    assert render_prompt_image("a red square on a blue background", height=16, width=24).shape == (16, 24, 3)


# --------------------------------------------------------------------------- shipped weights


def test_weights_folder_layout():
    for rel in [
        "model_index.json",
        "transformer/config.json",
        "transformer/diffusion_pytorch_model.safetensors",
        "prompt_encoder/config.json",
        "prompt_encoder/diffusion_pytorch_model.safetensors",
        "scheduler/scheduler_config.json",
    ]:
        assert (TINY_MODEL_DIR / rel).is_file(), rel
    total = sum(f.stat().st_size for f in TINY_MODEL_DIR.rglob("*") if f.is_file())
    assert total < 8 * 2**20


def test_transformer_loads_standalone():
    tr = FluxTransformer2DModel.from_pretrained(TINY_MODEL_DIR / "transformer", local_files_only=True)
    assert tr.config.in_channels == 12 and tr.config.patch_size == 1
    # every Linear except the 12-channel patch embedding / output projection is FP8-friendly
    odd = [
        n
        for n, m in tr.named_modules()
        if isinstance(m, torch.nn.Linear)
        and (m.in_features % 16 or m.out_features % 16 or min(m.in_features, m.out_features) < 32)
    ]
    assert set(odd) == {"x_embedder", "proj_out"}, odd


def test_pipeline_loads_offline(pipe):
    assert isinstance(pipe, TinyShapesPipeline)
    assert isinstance(pipe.transformer, FluxTransformer2DModel)
    assert isinstance(pipe.prompt_encoder, TinyPromptEncoder)
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    again = TinyShapesPipeline.from_pretrained(TINY_MODEL_DIR)
    assert again.transformer.config == pipe.transformer.config


def test_output_types_and_sizes(pipe):
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    prompt = "a red circle on a blue background"
    pil = pipe(prompt, generator=g()).images[0]
    assert pil.size == (32, 32) and pil.mode == "RGB"
    np_img = pipe(prompt, generator=g(), output_type="np").images
    assert np_img.shape == (1, 32, 32, 3) and 0.0 <= np_img.min() and np_img.max() <= 1.0
    pt = pipe([prompt, prompt], height=16, width=24, generator=g(), output_type="pt").images
    assert pt.shape == (2, 3, 16, 24)
    (tup,) = pipe(prompt, generator=g(), output_type="np", return_dict=False)
    np.testing.assert_array_equal(tup, np_img)
    with pytest.raises(ValueError):
        pipe(prompt, height=30)


def test_same_seed_same_image(pipe):
    prompt = "a yellow triangle on a black background"
    a = pipe(prompt, generator=torch.Generator().manual_seed(7), output_type="np").images
    b = pipe(prompt, generator=torch.Generator().manual_seed(7), output_type="np").images
    c = pipe(prompt, generator=torch.Generator().manual_seed(8), output_type="np").images
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_denoising_loop_contract(pipe, monkeypatch):
    """One scheduler.step per step, the ``transformer`` attribute is called each step, callbacks work."""
    steps = 6
    calls = {"transformer": 0, "step": 0, "callback": []}
    original = pipe.transformer

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.config = inner.config  # like a torch.compile'd module: no `.device` / `.dtype` of its own

        def forward(self, *args, **kwargs):
            calls["transformer"] += 1
            return self.inner(*args, **kwargs)

    real_step = pipe.scheduler.step

    def counting_step(*args, **kwargs):
        calls["step"] += 1
        return real_step(*args, **kwargs)

    def callback(p, i, t, kwargs):
        assert p is pipe and calls["step"] == i + 1
        calls["callback"].append((i, float(t), tuple(kwargs["latents"].shape)))
        return {"latents": kwargs["latents"]}

    monkeypatch.setattr(pipe.scheduler, "step", counting_step)
    pipe.transformer = Wrapper(original)
    try:
        pipe(
            "a red circle on a blue background",
            num_inference_steps=steps,
            output_type="np",
            callback_on_step_end=callback,
            generator=torch.Generator().manual_seed(0),
        )
    finally:
        pipe.transformer = original
    assert calls["transformer"] == steps and calls["step"] == steps
    assert [c[0] for c in calls["callback"]] == list(range(steps))
    assert calls["callback"][0][1] == pytest.approx(1000.0)
    assert calls["callback"][0][2] == (1, 256, 12)


# --------------------------------------------------------------------------- quality


@pytest.mark.slow
def test_prompt_colour_quality(pipe):
    shape_rate, bg_rate = _color_match_rates(pipe, _quality_prompts())
    print(
        f"\ntrained tiny model: shape colour match {shape_rate:.1%}, background match {bg_rate:.1%} "
        f"({N_QUALITY} prompts)"
    )
    assert shape_rate >= 0.9
    assert bg_rate >= 0.9


@pytest.mark.slow
def test_random_transformer_fails_quality(pipe):
    """The quality check is not trivial: an untrained transformer of the same config fails it."""
    torch.manual_seed(0)
    random_tr = FluxTransformer2DModel.from_config(pipe.transformer.config).eval()
    rand_pipe = TinyShapesPipeline(transformer=random_tr, prompt_encoder=pipe.prompt_encoder, scheduler=pipe.scheduler)
    rand_pipe.set_progress_bar_config(disable=True)
    shape_rate, bg_rate = _color_match_rates(rand_pipe, _quality_prompts())
    print(f"\nrandom transformer: shape colour match {shape_rate:.1%}, background match {bg_rate:.1%}")
    assert shape_rate < 0.5
    assert bg_rate < 0.5


# --------------------------------------------------------------------------- FP8-aware fine-tuning


def test_fake_quant_matches_reference_lowering():
    """The fake quantization used to fine-tune the shipped weights (examples/train_tiny_dit.py
    --fp8-aware) computes what the CPU reference lowering computes, and lets gradients through."""
    from fx_fp8 import FP8Config
    from fx_fp8.ops import quant
    from fx_fp8.ops.reference import LOWERING
    from fx_fp8.tools.tiny_model.fake_quant import fake_fp8_attention, fake_quant_rows, fake_quant_weight

    torch.manual_seed(0)
    a = FP8Config().attention
    q, k, v = (torch.randn(2, 2, 264, 32) * 3 for _ in range(3))
    q.requires_grad_(True)
    ref = LOWERING.attention(
        q.detach(),
        k,
        v,
        attn_mask=None,
        softmax_scale=32**-0.5,
        granularity=a.granularity,
        q_block=a.q_block,
        kv_block=a.kv_block,
        hadamard=a.hadamard,
        smooth_k=a.smooth_k,
        quantize_p=a.quantize_p,
        p_scale=a.p_scale,
        kernel=a.kernel,
        return_lse=False,
    )
    fake = fake_fp8_attention(q, k, v, None, 32**-0.5, a)
    native = torch.nn.functional.scaled_dot_product_attention(q.detach(), k, v)
    assert (fake - ref).abs().max() < 1e-3 * (native - ref).abs().max()  # fp32 summation order only
    fake.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0

    x, w = torch.randn(40, 64, requires_grad=True), torch.randn(128, 64, requires_grad=True)
    wq, ws = quant.quantize_weight(w.detach(), "channel")
    xq, xs = quant.quantize_activation(x.detach(), "token")
    ref = LOWERING.scaled_mm(
        xq, xs, wq, ws, None, method="fp8", weight_granularity="channel", weight_block=None, out_dtype=torch.float32
    )
    fake = fake_quant_rows(x) @ fake_quant_weight(w, "channel").t()
    torch.testing.assert_close(fake, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(x.detach() @ w.detach().t(), ref, rtol=1e-3, atol=1e-3)  # quantization is visible
    fake.sum().backward()
    # straight-through: d/dw of (xq @ wq^T).sum() is taken as if wq were w
    torch.testing.assert_close(w.grad, fake_quant_rows(x.detach()).sum(0).expand(128, 64))


def test_fake_fp8_context_is_scoped(pipe):
    """Inside fake_fp8 the transformer runs quantized (the default config's 34 linears + attention);
    on exit the model and torch's SDPA are back to native."""
    from fx_fp8.tools.tiny_model.fake_quant import fake_fp8
    from fx_fp8.tools.tiny_model.pipeline import image_ids, text_ids

    tr = pipe.transformer
    sdpa = torch.nn.functional.scaled_dot_product_attention
    embeds, pooled = pipe.prompt_encoder.encode(["a red circle on a blue background"])
    kw = dict(
        hidden_states=torch.randn(1, 256, 12, generator=torch.Generator().manual_seed(0)),
        timestep=torch.tensor([0.5]),
        pooled_projections=pooled,
        encoder_hidden_states=embeds,
        txt_ids=text_ids(embeds.shape[1]),
        img_ids=image_ids(32, 32),
        return_dict=False,
    )
    with torch.no_grad():
        before = tr(**kw)[0]
        with fake_fp8(tr) as names:
            quantized = tr(**kw)[0]
        after = tr(**kw)[0]
    assert len(names) == 34 and "x_embedder" not in names and "proj_out" not in names
    assert torch.nn.functional.scaled_dot_product_attention is sdpa
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    rel = ((quantized - before).norm() / before.norm()).item()
    assert 1e-3 < rel < 0.2, rel


def test_heldout_prompt_set_is_apart_from_the_tuning_set():
    from fx_fp8.tools.tiny_model.prompt_sets import HELDOUT, heldout_cases, prompt_cases, tuning_cases

    tuning = tuning_cases()
    assert len(tuning) == 16 and tuning[3][1] == 3
    assert len(HELDOUT) == 48 and len(set(HELDOUT)) == 48
    # never a tuning prompt, never a tuning noise seed, every prompt in the grammar
    assert not {p for p, _ in HELDOUT} & {p for p, _ in tuning}
    assert not {s for _, s in HELDOUT} & {s for _, s in tuning}
    assert all(parse_prompt(p) and p in all_prompts() for p, _ in HELDOUT)
    assert heldout_cases(5) == list(HELDOUT[:5]) and prompt_cases("heldout") == list(HELDOUT)
    with pytest.raises(ValueError, match="got 49"):
        heldout_cases(49)
    with pytest.raises(ValueError, match="'validation'"):
        prompt_cases("validation")
    confirm = prompt_cases("confirm")  # the third set: apart from both
    assert len(confirm) == 48 and not {p for p, _ in confirm} & ({p for p, _ in HELDOUT} | {p for p, _ in tuning})
    assert {s for _, s in confirm} == set(range(2000, 2048))


def test_tiny_quality_takes_the_heldout_set_and_refuses_bad_counts(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "tiny_quality", os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "tiny_quality.py")
    )
    tq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tq)
    assert tq.prompts_and_seeds(2) == tq.prompt_cases("tuning", 2)
    with pytest.raises(SystemExit):
        tq.main(["--prompt-set", "heldout", "--num-prompts", "60"])
    assert "--num-prompts: heldout_cases: n must be in 1..48, got 60" in capsys.readouterr().err
