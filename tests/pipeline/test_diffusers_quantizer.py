"""fx_fp8 as a diffusers quantization backend (fx_fp8.DiffusersConfig): linears quantized while
from_pretrained reads them, as prepare_model would quantize them; save_pretrained / from_pretrained
bit-identical; PipelineQuantizationConfig; the compiled model uses the loaded weights as they are;
peak memory while loading; what load time refuses."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

import fx_fp8
from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs, output_tensor
from fx_fp8.quant.weight_state import compile_quantizations
from fx_fp8.ops.formats import WEIGHT_ONLY
from fx_fp8.quant.quantized_linear import QuantizedLinear
from expected_layers import RULES_PICK_FLUX, differences

from diffusers import FluxTransformer2DModel, PipelineQuantizationConfig  # noqa: E402


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def layers_of(model) -> dict:
    return {
        n: (m.method, m.weight_granularity, tuple(m.weight_block), m.act_granularity, m.orig_dtype)
        for n, m in model.named_modules()
        if isinstance(m, QuantizedLinear)
    }


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )


def state_equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(same_bytes(sa[k], sb[k]) for k in sa)


def run(model, kw):
    with torch.no_grad():
        return output_tensor(model(**kw))


def save_family(family: str, folder, dtype=torch.bfloat16):
    model = quiet(build_tiny_transformer, family, dtype=dtype)
    model.save_pretrained(folder)
    return type(model)


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux") / "transformer"
    save_family("flux", folder)
    return folder


def load(folder, cls=FluxTransformer2DModel, **kw):
    return quiet(cls.from_pretrained, folder, **kw)


# -- registration ------------------------------------------------------------------------------
def test_fx_fp8_is_in_diffusers_mappings():
    from diffusers.quantizers import auto

    from fx_fp8.pipeline.diffusers_quantizer import DiffusersConfig, FxFp8Quantizer

    assert auto.AUTO_QUANTIZER_MAPPING["fx_fp8"] is FxFp8Quantizer
    assert auto.AUTO_QUANTIZATION_CONFIG_MAPPING["fx_fp8"] is DiffusersConfig
    assert fx_fp8.DiffusersConfig is DiffusersConfig
    cfg = fx_fp8.DiffusersConfig()
    assert cfg.quant_method.value == "fx_fp8" and cfg.quant_method == "fx_fp8"  # diffusers reads .value
    # the dict form (a config.json's quantization_config) reaches fx_fp8 through diffusers' own reader
    assert isinstance(auto.DiffusersAutoQuantizer.from_dict(cfg.to_dict()), DiffusersConfig)
    assert isinstance(auto.DiffusersAutoQuantizer.from_config(cfg, pre_quantized=False), FxFp8Quantizer)


#: fresh interpreters: what `import fx_fp8` does to diffusers in each import order, and without it
ORDERS = {
    "fx_fp8-first": """
import sys
import fx_fp8
assert "diffusers" not in sys.modules, "import fx_fp8 imported diffusers"
from diffusers import FluxTransformer2DModel   # loads diffusers' quantizers: fx_fp8 registers right after
from diffusers.quantizers import auto
from fx_fp8.after_import import AfterImport
assert not [f for f in sys.meta_path if isinstance(f, AfterImport) and "diffusers.quantizers.auto" in f.names], \
    "the finder stayed"
print(auto.AUTO_QUANTIZER_MAPPING["fx_fp8"].__name__, auto.AUTO_QUANTIZATION_CONFIG_MAPPING["fx_fp8"].__name__)
""",
    "diffusers-first": """
from diffusers import FluxTransformer2DModel
import fx_fp8
from diffusers.quantizers import auto
print(auto.AUTO_QUANTIZER_MAPPING["fx_fp8"].__name__, auto.AUTO_QUANTIZATION_CONFIG_MAPPING["fx_fp8"].__name__)
""",
    "config-first": """
import fx_fp8
cfg = fx_fp8.DiffusersConfig()   # the quantizer module itself imports diffusers' quantizers: no half-loaded module
from diffusers.quantizers import auto
print(auto.AUTO_QUANTIZER_MAPPING["fx_fp8"].__name__, type(cfg).__name__)
""",
    "no-diffusers": """
import sys
class NoDiffusers:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "diffusers":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoDiffusers())
import fx_fp8
try:
    fx_fp8.DiffusersConfig
except ImportError as e:
    print(e)
""",
}


@pytest.mark.parametrize("order", list(ORDERS))
def test_import_registers_without_importing_diffusers(order):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", ORDERS[order]], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    if order == "no-diffusers":
        assert "fx_fp8.DiffusersConfig needs diffusers and accelerate" in out.stdout
    else:
        assert out.stdout.split() == ["FxFp8Quantizer", "DiffusersConfig"]


def test_a_diffusers_with_another_layout_is_refused_naming_expected_and_found(monkeypatch):
    import types

    from fx_fp8.pipeline import diffusers_registration as reg

    fake = types.ModuleType("diffusers.quantizers.auto")
    fake.AUTO_QUANTIZER_MAPPING = [("torchao", object)]  # a list, not a dict
    fake.AUTO_QUANTIZATION_CONFIG_MAPPING = {}
    with pytest.raises(reg.DiffusersLayoutError) as e:
        reg.register(fake)
    text = str(e.value)
    assert "AUTO_QUANTIZER_MAPPING: expected a dict (quant_method name -> quantizer class), found list" in text
    assert (
        "DiffusersAutoQuantizer.from_config: expected a classmethod of that module" in text and "found nothing" in text
    )
    assert fake.AUTO_QUANTIZATION_CONFIG_MAPPING == {}  # nothing registered

    from diffusers.quantizers import auto

    taken = types.ModuleType("diffusers.quantizers.auto")
    taken.__dict__.update({k: v for k, v in vars(auto).items() if not k.startswith("__")})
    taken.AUTO_QUANTIZER_MAPPING = {"fx_fp8": auto.TorchAoHfQuantizer}
    problems = reg.layout_problems(taken)
    assert any(
        "AUTO_QUANTIZER_MAPPING['fx_fp8']: expected free (or fx_fp8's), found" in p and "TorchAoHfQuantizer" in p
        for p in problems
    ), problems
    # the import hook warns instead of breaking diffusers' import; DiffusersConfig then raises the same text
    monkeypatch.setitem(reg._STATE, "result", None)
    with pytest.warns(UserWarning, match="cannot register its diffusers quantization backend"):
        reg._register_or_warn(fake)
    with pytest.raises(reg.DiffusersLayoutError, match="AUTO_QUANTIZER_MAPPING: expected a dict"):
        fx_fp8.DiffusersConfig()
    assert reg.layout_problems(auto) == []  # the installed diffusers matches


# -- options ----------------------------------------------------------------------------------------
def test_options_are_fp8config_options_from_kwargs_yaml_and_cli(tmp_path):
    import argparse

    from fx_fp8.tools.cli_flags import add_fp8_flags, config_from_args

    kwargs = fx_fp8.DiffusersConfig(
        quantization="int8", ignored_layers=["to_q"], quantization_config={"sensitive": "native"}
    )
    yaml = tmp_path / "stage.yaml"
    yaml.write_text(
        "stage_args:\n  - stage_type: diffusion\n    engine_args:\n      quantization: int8\n"
        "      quantization_config:\n        ignored_layers: [to_q]\n        sensitive: native\n"
    )
    from_yaml = fx_fp8.DiffusersConfig(str(yaml))
    args = add_fp8_flags(argparse.ArgumentParser()).parse_args(
        ["--quantization", "int8", "--ignored-layers", "to_q", "--config", str(yaml)]
    )
    from_cli = fx_fp8.DiffusersConfig(config_from_args(args))
    assert kwargs == from_yaml == from_cli
    q = kwargs.fp8_config.quantization_config
    assert (q.method, q.ignored_layers, q.sensitive) == ("int8", ("to_q",), "native")
    data = kwargs.to_dict()
    assert data["quant_method"] == "fx_fp8" and data["quantization"] == "int8"
    assert fx_fp8.DiffusersConfig.from_dict(json.loads(json.dumps(data))) == kwargs  # through config.json


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(quantization=None), "quantization is None"),
        (dict(quantization_config={"smoothing_alpha": 0.5, "activation_scales": {"x": 1.0}}), "smoothing_alpha 0.5"),
        (
            dict(quantization_config={"activation_scheme": "static", "activation_scales": {"x": 1.0}}),
            "activation_scheme 'static'",
        ),
        (dict(quantization_config={"weight_granularity": "rows"}), "weight_granularity"),
    ],
)
def test_settings_load_time_cannot_honour_are_refused(options, match):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=match):
            fx_fp8.DiffusersConfig(**options)


# -- loading a full-precision checkpoint --------------------------------------------------------------
def test_loading_quantizes_the_linears_the_rules_pick(tmp_path):
    """One small load (the fast run's end-to-end check): every linear the rules quantize is a
    QuantizedLinear of its kind, the others stay nn.Linear, and the model's config records them. The
    expected layers are pinned lists (tests/helpers/expected_layers.py), not the rules' own answer."""
    model = quiet(build_tiny_transformer, "flux", layers=1, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    cfg = fx_fp8.DiffusersConfig(ignored_layers=["re:.*\\.to_v"])  # at this width every other linear quantizes
    loaded = load(tmp_path, torch_dtype=torch.bfloat16, quantization_config=cfg)
    layers = layers_of(loaded)
    pinned = RULES_PICK_FLUX
    assert all(pinned.values()), "each kind is pinned with at least one layer"
    for kind, got in (
        ("fp8", {n for n, v in layers.items() if v[3] != WEIGHT_ONLY}),
        ("weight_only", {n for n, v in layers.items() if v[3] == WEIGHT_ONLY}),
        ("native", {n for n, m in loaded.named_modules() if type(m) is nn.Linear}),
    ):
        assert not differences(kind, got, pinned[kind]), differences(kind, got, pinned[kind])
    record = loaded.config.quantization_config.quantized_layers
    assert sorted(n for e in record for n in e["layers"]) == sorted(layers)
    assert loaded.hf_quantizer.quantization_config is loaded.config.quantization_config


def test_load_time_quantization_is_prepare_model(family, tmp_path):
    """The same layers (sensitive ones weight-only), the same bytes, the same outputs as
    prepare_model on the model loaded in bf16; Wan keeps modules in float32 on both paths."""
    folder = tmp_path / family
    cls = save_family(family, folder)
    loaded = load(folder, cls, torch_dtype=torch.bfloat16, quantization_config=fx_fp8.DiffusersConfig())
    ref = load(folder, cls, torch_dtype=torch.bfloat16)
    result = fx_fp8.prepare_model(ref)
    assert result["quantized"] and result["weight_only"]
    assert sorted(layers_of(loaded)) == sorted(result["quantized"])
    assert {n for n, v in layers_of(loaded).items() if v[3] == WEIGHT_ONLY} == set(result["weight_only"])
    assert layers_of(loaded) == layers_of(ref) and state_equal(loaded, ref)
    kw = example_inputs(family, ref, dtype=torch.bfloat16)
    assert torch.equal(run(loaded, kw), run(ref, kw))
    assert getattr(loaded, "is_quantized", False) and not loaded.training


def test_options_decide_the_layers_as_in_prepare_model(flux_folder):
    options = dict(
        quantization="int8",
        ignored_layers=["re:transformer_blocks\\.0\\.attn\\.to_q"],
        quantization_config={"weight_granularity": "block", "sensitive": "native"},
    )
    loaded = load(flux_folder, torch_dtype=torch.bfloat16, quantization_config=fx_fp8.DiffusersConfig(**options))
    ref = load(flux_folder, torch_dtype=torch.bfloat16)
    result = fx_fp8.prepare_model(ref, **options)
    assert type(loaded.transformer_blocks[0].attn.to_q) is nn.Linear  # ignored
    assert isinstance(loaded.transformer_blocks[0].attn.to_k, QuantizedLinear)
    assert layers_of(loaded) == layers_of(ref) and state_equal(loaded, ref)
    assert {v[:3] for v in layers_of(loaded).values()} == {("int8", "block", (128, 128))} and not result["weight_only"]


def test_loading_onto_a_device_map(flux_folder):
    loaded = load(
        flux_folder, torch_dtype=torch.bfloat16, device_map="cpu", quantization_config=fx_fp8.DiffusersConfig()
    )
    assert loaded.hf_device_map == {"": torch.device("cpu")}
    ref = load(flux_folder, torch_dtype=torch.bfloat16, quantization_config=fx_fp8.DiffusersConfig())
    assert state_equal(loaded, ref)
    with pytest.raises(ValueError, match="offloads to disk"):
        load(
            flux_folder,
            torch_dtype=torch.bfloat16,
            device_map={"": "disk"},
            offload_folder="x",
            quantization_config=fx_fp8.DiffusersConfig(),
        )


# -- save_pretrained / from_pretrained ------------------------------------------------------------------
def test_save_pretrained_round_trip_is_bit_identical(flux_folder, tmp_path):
    loaded = load(flux_folder, torch_dtype=torch.bfloat16, quantization_config=fx_fp8.DiffusersConfig())
    loaded.save_pretrained(tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fx_fp8" and config["quantization"] == "fp8"
    recorded = {n: (e["method"], e["act_granularity"]) for e in config["quantized_layers"] for n in e["layers"]}
    assert recorded == {n: (v[0], v[3]) for n, v in layers_of(loaded).items()}
    stored = load_file(tmp_path / "q" / "diffusion_pytorch_model.safetensors")
    assert {stored[f"{n}.weight"].dtype for n in recorded} <= {torch.float8_e4m3fn, torch.int8}

    again = load(tmp_path / "q", torch_dtype=torch.bfloat16)  # fx_fp8 imported: no quantization_config needed
    assert layers_of(again) == layers_of(loaded) and state_equal(again, loaded)
    kw = example_inputs("flux", loaded, dtype=torch.bfloat16)
    assert torch.equal(run(again, kw), run(loaded, kw))
    again.save_pretrained(tmp_path / "q2", max_shard_size="60KB")  # and again, in shards: a layer's tensors may part
    quantization = lambda folder: json.loads((folder / "config.json").read_text())["quantization_config"]  # noqa: E731
    assert quantization(tmp_path / "q2") == quantization(tmp_path / "q")
    assert len(list((tmp_path / "q2").glob("*.safetensors"))) > 2
    assert state_equal(load(tmp_path / "q2", torch_dtype=torch.bfloat16), loaded)


def test_a_quantized_checkpoint_that_disagrees_with_its_record_is_refused(flux_folder, tmp_path):
    loaded = load(flux_folder, torch_dtype=torch.bfloat16, quantization_config=fx_fp8.DiffusersConfig())
    loaded.save_pretrained(tmp_path / "q")
    path = tmp_path / "q" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(path)
    name = "transformer_blocks.0.attn.to_k"
    del tensors[f"{name}.weight_scale"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match=f"{name}: recorded as quantized, the checkpoint has no weight_scale"):
        load(tmp_path / "q", torch_dtype=torch.bfloat16)
    tensors[f"{name}.weight_scale"] = torch.ones(3, 1)  # a scale of the wrong shape
    save_file(tensors, path)
    with pytest.raises(ValueError, match=f"{name}.weight_scale in the checkpoint is torch.float32 \\[3, 1\\]"):
        load(tmp_path / "q", torch_dtype=torch.bfloat16)
    # quantized files without their record: a fresh config refuses them rather than quantizing codes
    tensors[f"{name}.weight_scale"] = loaded.transformer_blocks[0].attn.to_k.weight_scale
    save_file(tensors, path)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="already holds quantized linears"):
        load(tmp_path / "q", torch_dtype=torch.bfloat16, quantization_config=fx_fp8.DiffusersConfig())


# -- pipelines -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def flux_pipeline_folder(tmp_path_factory):
    from fx_fp8.tools.model_zoo.registry import build_tiny_pipeline

    pipe, _ = quiet(build_tiny_pipeline, "flux")
    folder = tmp_path_factory.mktemp("pipe") / "flux"
    quiet(pipe.save_pretrained, folder)
    return folder


#: the tiny pipeline has no text encoders: from_pretrained needs them named
NO_TEXT = dict(text_encoder=None, text_encoder_2=None, tokenizer=None, tokenizer_2=None)


def test_pipeline_quantization_config_quantizes_the_transformer(flux_pipeline_folder, tmp_path):
    from diffusers import FluxPipeline

    qc = PipelineQuantizationConfig(quant_mapping={"transformer": fx_fp8.DiffusersConfig()})
    pipe = quiet(
        FluxPipeline.from_pretrained,
        flux_pipeline_folder,
        torch_dtype=torch.bfloat16,
        quantization_config=qc,
        **NO_TEXT,
    )
    ref = load(flux_pipeline_folder / "transformer", torch_dtype=torch.bfloat16)
    fx_fp8.prepare_model(ref)
    assert layers_of(pipe.transformer) == layers_of(ref) and state_equal(pipe.transformer, ref)
    assert not any(isinstance(m, QuantizedLinear) for m in pipe.vae.modules())
    quiet(pipe.save_pretrained, tmp_path / "qpipe")
    again = quiet(FluxPipeline.from_pretrained, tmp_path / "qpipe", torch_dtype=torch.bfloat16, **NO_TEXT)
    assert state_equal(again.transformer, pipe.transformer)


# -- compiling the loaded model ------------------------------------------------------------------------
EAGER = {"downstream": "eager"}  # the graph fx_fp8 hands on is what is checked; no Inductor needed


def test_compiled_loaded_model_runs_its_stored_weights_without_requantizing(flux_folder, downstream_graphs):
    loaded = load(flux_folder, torch_dtype=torch.bfloat16, quantization_config=fx_fp8.DiffusersConfig())
    kw = example_inputs("flux", loaded, dtype=torch.bfloat16)
    layers = layers_of(loaded)
    before = compile_quantizations(loaded)
    compiled = torch.compile(loaded, backend="fp8", options=EAGER)
    out = run(compiled, kw)
    assert compile_quantizations(loaded) == before  # no weight quantized at compile time
    targets = [str(n.target) for gm in downstream_graphs for n in gm.graph.nodes if n.op == "call_function"]
    w8a8 = sum(v[3] != WEIGHT_ONLY for v in layers.values())
    assert targets.count("fx_fp8.scaled_mm.default") == w8a8
    assert targets.count("fx_fp8.weight_only_linear.default") == len(layers) - w8a8
    entries = [e for e in fx_fp8.get_reports(compiled)[-1].entries if e.op == "linear" and e.module in layers]
    assert entries  # not vacuous: all() of nothing is True
    assert len(entries) == len(layers) and all(e.action in ("fp8", "weight-only") for e in entries)
    ref = load(flux_folder, torch_dtype=torch.bfloat16)
    fx_fp8.prepare_model(ref)
    torch._dynamo.reset()
    assert torch.equal(out, run(torch.compile(ref, backend="fp8", options=EAGER), kw))


# -- memory ------------------------------------------------------------------------------------------------
def test_loading_holds_one_full_precision_layer_at_a_time(tmp_path):
    """fp32 files loaded as bf16, measured by torch's CPU allocator (its profiler memory events; the
    memory-mapped files left out: what is counted is what loading allocates on top of them). The peak
    is the quantized model plus one bf16 layer (the loader's converted copy) plus the workspace of
    quantizing a slice of rows; loading in bf16 and preparing afterwards holds the whole bf16 model.
    The model's size is its state's storage bytes, counted here."""
    from memory_oracles import AllocatorPeak, state_storage_bytes

    torch.manual_seed(0)
    model = quiet(
        FluxTransformer2DModel,
        patch_size=1,
        in_channels=64,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=64,
        num_attention_heads=4,
        joint_attention_dim=128,
        pooled_projection_dim=64,
        axes_dims_rope=(16, 24, 24),
    )
    model.save_pretrained(tmp_path / "fp32")
    largest = max(m.weight.numel() * 2 for m in model.modules() if isinstance(m, nn.Linear))
    files = sorted((tmp_path / "fp32").glob("*.safetensors"))
    with AllocatorPeak(mapped=files) as mem:
        loaded = load(tmp_path / "fp32", torch_dtype=torch.bfloat16, quantization_config=fx_fp8.DiffusersConfig())
    final = state_storage_bytes(loaded)
    assert mem.events and final > 0 and mem.mapped == len(files)
    assert mem.net >= final  # the allocator made every tensor the model holds (none is a view of the files)
    assert mem.peak <= final + 1.5 * largest, (mem.peak - final) / largest
    with AllocatorPeak(mapped=files) as mem:
        ref = load(tmp_path / "fp32", torch_dtype=torch.bfloat16)
        bf16 = state_storage_bytes(ref)
        fx_fp8.prepare_model(ref)
    assert mem.peak >= bf16 > final + 1.5 * largest


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_loading_onto_a_gpu_holds_the_quantized_model_and_less_than_one_bf16_layer(tmp_path):
    """device_map="cuda": only slices of each bf16 weight reach the GPU (the checkpoint stays in
    host memory), so the GPU's peak is the quantized model plus about one bf16 layer (an H200
    measured 1.0001 layers on 2026-12-04: one layer and 1.5 KB of scales)."""
    torch.manual_seed(0)
    model = quiet(
        FluxTransformer2DModel,
        patch_size=1,
        in_channels=64,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=64,
        num_attention_heads=16,
        joint_attention_dim=1024,
        pooled_projection_dim=256,
        axes_dims_rope=(16, 24, 24),
    ).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    largest = max(m.weight.numel() * 2 for m in model.modules() if isinstance(m, nn.Linear))
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loaded = load(tmp_path, torch_dtype=torch.bfloat16, device_map="cuda", quantization_config=fx_fp8.DiffusersConfig())
    peak, final = torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base
    assert {p.device.type for p in loaded.parameters()} == {"cuda"}
    assert peak <= final + 1.01 * largest, (peak - final) / largest
    on_cpu = load(tmp_path, torch_dtype=torch.bfloat16, quantization_config=fx_fp8.DiffusersConfig())
    assert layers_of(loaded) == layers_of(on_cpu)


# -- the docs ------------------------------------------------------------------------------------------------
def test_the_docs_snippet_runs(flux_pipeline_folder, tmp_path, monkeypatch):
    """docs/diffusers_quantization.md's snippet, as written, on the tiny Flux pipeline: its paths
    point at temporary folders, the GPU is the CPU, and the pipeline's missing text encoders are
    named (the tiny pipeline has none)."""
    import re
    from pathlib import Path

    from diffusers import FluxPipeline

    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "diffusers_quantization.md").read_text()
    code = re.search(r"<!-- diffusers-quantization-snippet -->\n```python\n(.*?)```", text, re.S).group(1)
    for old, new in (
        ('"/models/FLUX.1-dev"', f'"{flux_pipeline_folder}"'),
        ('device_map="cuda"', 'device_map="cpu"'),
        ('"flux-fp8/', f'"{tmp_path}/'),
        ('"examples/', f'"{root / "examples"}/'),
    ):
        assert old in code, old
        code = code.replace(old, new)
    real = FluxPipeline.from_pretrained.__func__
    monkeypatch.setattr(
        FluxPipeline, "from_pretrained", classmethod(lambda cls, *a, **k: real(cls, *a, **NO_TEXT, **k))
    )
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, "docs/diffusers_quantization.md", "exec"), namespace)
    transformer, pipe = namespace["transformer"], namespace["pipe"]
    assert (tmp_path / "transformer" / "config.json").is_file()
    compiled = getattr(pipe.transformer, "_orig_mod", pipe.transformer)  # compile_pipeline's torch.compile
    assert layers_of(transformer._orig_mod) == layers_of(compiled) and layers_of(compiled)
    assert fx_fp8.pipeline_state(pipe).config == fx_fp8.FP8Config.load(root / "examples" / "configs" / "fp8_flat.yaml")
