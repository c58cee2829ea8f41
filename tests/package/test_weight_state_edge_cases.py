"""Round five of hostile use, the model's state: prepare_model under torch.inference_mode, models
built inside it, instances told apart by what really differs per instance, writes through `.data`
aliases, and the FX_FP8_CHECK_REUSE variable."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import fx_fp8
import fx_fp8.quant.prepare as prepare_module
from fx_fp8.quant.quantized_linear import QuantizedLinear
from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs, output_tensor

from toy_models import ToyPipe

REF = {"lowering": "reference", "downstream": "eager"}  # the rewritten graph runs as it is: no Inductor


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def three_linears(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)).eval()


def snapshot(model: nn.Module) -> dict:
    """Each submodule object and each tensor object with its bytes: what "as it was" means."""
    return {
        "modules": dict(model.named_modules()),
        "tensors": {k: (v, v.detach().clone()) for k, v in model.state_dict(keep_vars=True).items()},
    }


def assert_as_it_was(model: nn.Module, before: dict) -> None:
    now = dict(model.named_modules())
    assert now.keys() == before["modules"].keys()
    assert all(now[k] is m for k, m in before["modules"].items()), "a module object was replaced"
    tensors = model.state_dict(keep_vars=True)
    assert tensors.keys() == before["tensors"].keys()
    for k, (obj, values) in before["tensors"].items():
        assert tensors[k] is obj and torch.equal(tensors[k].detach(), values), k
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    assert "save_pretrained" not in model.__dict__  # no guard left behind


# -- item 1: prepare_model validates, then mutates ---------------------------------------------------
def test_prepare_model_under_inference_mode_prepares_every_layer_as_outside_it():
    x = torch.randn(4, 64)
    inside, outside = three_linears(), three_linears()
    with torch.inference_mode():
        result = fx_fp8.prepare_model(inside, quantization="fp8")
    fx_fp8.prepare_model(outside, quantization="fp8")
    assert result["quantized"] == ["0", "1", "2"]
    assert all(isinstance(m, QuantizedLinear) for m in inside)
    # the prepared tensors are normal ones: a later state-dict load outside inference_mode works
    assert not any(t.is_inference() for t in inside.state_dict().values())
    with torch.no_grad():
        assert torch.equal(inside(x), outside(x))
        inside.load_state_dict(three_linears(seed=1).state_dict())
        outside.load_state_dict(three_linears(seed=1).state_dict())
        assert torch.equal(inside(x), outside(x))


def test_a_failure_part_way_through_prepare_model_leaves_the_model_as_it_was(monkeypatch):
    model = three_linears()
    before = snapshot(model)
    real, calls = prepare_module.replace_module, []

    def fails_on_the_second_layer(model_, name, new, old=None):
        calls.append(name)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        real(model_, name, new, old=old)

    monkeypatch.setattr(prepare_module, "replace_module", fails_on_the_second_layer)
    with pytest.raises(RuntimeError, match="injected failure"):
        fx_fp8.prepare_model(model, quantization="fp8")
    assert calls[:2] == ["0", "1"]  # the first layer had been replaced
    assert_as_it_was(model, before)
    monkeypatch.undo()
    assert fx_fp8.prepare_model(model, quantization="fp8")["quantized"] == ["0", "1", "2"]  # and can be prepared


def test_a_failure_while_accepting_the_weights_changes_nothing(monkeypatch):
    model = three_linears()
    before = snapshot(model)
    real, calls = QuantizedLinear.accept_weight, []

    def fails_on_the_second_layer(self, name=""):
        calls.append(name)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        real(self, name)

    monkeypatch.setattr(QuantizedLinear, "accept_weight", fails_on_the_second_layer)
    with pytest.raises(RuntimeError, match="injected failure"):
        fx_fp8.prepare_model(model, quantization="fp8")
    assert_as_it_was(model, before)


# -- item 2: parameters created under torch.inference_mode -------------------------------------------
def test_torch_compile_of_a_model_built_under_inference_mode_runs_as_one_built_outside_it():
    x = torch.randn(4, 64)
    with torch.inference_mode():
        inside = three_linears()
        assert inside[0].weight.is_inference()
        out_inside = torch.compile(inside, backend="fp8", options=REF)(x)
    torch._dynamo.reset()
    with torch.no_grad():
        out_outside = torch.compile(three_linears(), backend="fp8", options=REF)(x)
    assert torch.equal(out_inside, out_outside)


def test_a_model_built_under_inference_mode_is_followed_when_a_weight_is_replaced():
    """No version counter, but a replaced weight is still seen per call; the quantized copy made
    during a call under inference_mode is rewritten in place by a later call outside it."""
    x = torch.randn(4, 64)
    with torch.inference_mode():
        model = three_linears()
        compiled = torch.compile(model, backend="fp8", options=REF)
        compiled(x)
    other = three_linears(seed=1)
    for mine, theirs in zip(model, other):
        mine.weight = nn.Parameter(theirs.weight.detach().clone())
        mine.bias = nn.Parameter(theirs.bias.detach().clone())
    with torch.no_grad():
        out = compiled(x)
        torch._dynamo.reset()
        assert torch.equal(out, torch.compile(other, backend="fp8", options=REF)(x))


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux") / "transformer"
    quiet(build_tiny_transformer, "flux", dtype=torch.bfloat16).save_pretrained(folder)
    return folder


def test_from_pretrained_with_diffusers_config_under_inference_mode(flux_folder):
    from diffusers import FluxTransformer2DModel

    def load():
        return quiet(
            FluxTransformer2DModel.from_pretrained,
            flux_folder,
            torch_dtype=torch.bfloat16,
            quantization_config=fx_fp8.DiffusersConfig(),
        )

    with torch.inference_mode():
        inside = load()
    outside = load()
    assert any(isinstance(m, QuantizedLinear) for m in inside.modules())
    kw = example_inputs("flux", outside, dtype=torch.bfloat16)
    with torch.inference_mode():
        out_inside = output_tensor(torch.compile(inside, backend="fp8", options=REF)(**kw))
    torch._dynamo.reset()
    with torch.no_grad():
        out_outside = output_tensor(torch.compile(outside, backend="fp8", options=REF)(**kw))
    assert torch.equal(out_inside, out_outside)


@pytest.mark.parametrize("prepare", [True, False])
def test_compile_pipeline_of_a_pipeline_built_under_inference_mode(prepare):
    with torch.inference_mode():
        pipe = fx_fp8.compile_pipeline(ToyPipe(), prepare=prepare, quantization="fp8", **REF)
        out_inside = pipe()
    torch._dynamo.reset()
    with torch.no_grad():
        out_outside = fx_fp8.compile_pipeline(ToyPipe(), prepare=prepare, quantization="fp8", **REF)()
    assert torch.equal(out_inside, out_outside)


# -- item 3: instances told apart by what really differs per instance -------------------------------
class SharedNormBlock(nn.Module):
    """A block whose forward reads a LayerNorm object every block shares, then its own attention."""

    def __init__(self, norm: nn.LayerNorm, dim: int = 64, heads: int = 2):
        super().__init__()
        self.norm, self.heads = norm, heads
        self.qkv, self.o = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, h):
        b, s, d = h.shape
        q, k, v = self.qkv(self.norm(h)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        return h + self.o(a)


class SharedNormModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        norm = nn.LayerNorm(64)
        self.blocks = nn.ModuleList([SharedNormBlock(norm) for _ in range(3)])

    def forward(self, h):
        for block in self.blocks:
            h = block(h)
        return h


SDPA = "<built-in function scaled_dot_product_attention>"


def test_blocks_sharing_a_layernorm_each_run_their_own_plan(downstream_graphs):
    options = {**REF, "diffusion_kv_cache_skip_layers": "1"}
    x = torch.randn(1, 16, 64)
    model = SharedNormModel().eval()
    for block in model.blocks:
        block.compile(backend="fp8", options=options)
    with torch.no_grad():
        out = model(x)
    # block 1's attention is kept native: its own artifact, with aten's SDPA where the others have FP8's
    targets = [[str(n.target) for n in gm.graph.nodes if "attention" in str(n.target)] for gm in downstream_graphs]
    assert sorted(targets) == sorted([["fx_fp8.fp8_attention.default"], [SDPA]])
    rows = [(e.module, e.action) for r in fx_fp8.get_reports(model) for e in r.entries if e.op == "attention"]
    assert rows == [("blocks.0", "fp8"), ("blocks.1", "native"), ("blocks.2", "fp8")]
    torch._dynamo.reset()
    with torch.no_grad():  # the whole model compiled as one graph decides per node: the same output
        assert torch.equal(out, torch.compile(SharedNormModel().eval(), backend="fp8", options=options)(x))


class WithEmbedder(nn.Module):
    def __init__(self, embed: nn.Linear):
        super().__init__()
        self.embed = embed
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        return self.b(torch.relu(self.a(self.embed(x))))


def test_two_models_of_one_class_sharing_their_embedder_each_run_their_own_weights():
    torch.manual_seed(0)
    embed = nn.Linear(64, 64)
    base, tuned = WithEmbedder(embed).eval(), WithEmbedder(embed).eval()
    x = torch.randn(4, 64)
    compiled_base = torch.compile(base, backend="fp8", options=REF)
    compiled_tuned = torch.compile(tuned, backend="fp8", options=REF)
    with torch.no_grad():
        out_base, out_tuned, again = compiled_base(x), compiled_tuned(x), compiled_base(x)
    assert len(fx_fp8.get_reports(compiled_base)) == len(fx_fp8.get_reports(compiled_tuned)) == 1
    assert torch.equal(again, out_base)
    torch._dynamo.reset()
    with torch.no_grad():  # each as if compiled alone
        assert torch.equal(out_tuned, torch.compile(tuned, backend="fp8", options=REF)(x))
        torch._dynamo.reset()
        assert torch.equal(out_base, torch.compile(base, backend="fp8", options=REF)(x))


# -- item 17: FX_FP8_CHECK_REUSE read as a boolean ------------------------------------------------------
@pytest.mark.parametrize(
    "value, on",
    [
        ("false", False),
        ("False", False),
        ("0", False),
        ("no", False),
        ("off", False),
        ("", False),
        ("true", True),
        ("TRUE", True),
        ("1", True),
        ("yes", True),
    ],
)
def test_check_reuse_variable_is_read_as_a_boolean(monkeypatch, value, on):
    from fx_fp8.compile.backend import CHECK_REUSE_ENV, check_reuse_env

    monkeypatch.setenv(CHECK_REUSE_ENV, value)
    assert check_reuse_env() is on


def test_check_reuse_variable_false_turns_the_check_off(monkeypatch):
    from fx_fp8.compile import graph_plan
    from fx_fp8.compile.backend import CHECK_REUSE_ENV

    checked = []
    monkeypatch.setattr(graph_plan, "check_reuse", lambda *args: checked.append(args[-1]))
    for value, expected in (("false", []), ("true", ["blocks.1", "blocks.2"])):
        monkeypatch.setenv(CHECK_REUSE_ENV, value)
        torch._dynamo.reset()
        model = SharedNormModel().eval()
        for block in model.blocks:
            block.compile(backend="fp8", options=REF)
        with torch.no_grad():
            model(torch.randn(1, 16, 64))
        assert checked == expected, value
        checked.clear()


def test_check_reuse_variable_that_is_no_boolean_is_refused_naming_it(monkeypatch):
    from fx_fp8.compile.backend import CHECK_REUSE_ENV

    monkeypatch.setenv(CHECK_REUSE_ENV, "sometimes")
    with pytest.raises(Exception, match="invalid FX_FP8_CHECK_REUSE='sometimes': expected true or false"):
        with torch.no_grad():
            torch.compile(three_linears(), backend="fp8", options=REF)(torch.randn(4, 64))


# -- item 5: the common writers through `.data` are followed --------------------------------------------
class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def fresh_compile_output(model: nn.Module, x: torch.Tensor, build=lambda: Mlp().eval()) -> torch.Tensor:
    """What a compile of the model as it holds its weights now gives (a twin from `build` given
    its state dict, a clean Dynamo cache)."""
    twin = build()
    twin.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(twin, backend="fp8", options=REF)(x)


def test_ema_copy_to_and_restore_are_followed_by_the_compiled_model():
    from diffusers.training_utils import EMAModel

    torch.manual_seed(0)
    model, x = Mlp().eval(), torch.randn(4, 64)
    ema = EMAModel(model.parameters())
    with torch.no_grad():
        for shadow in ema.shadow_params:  # the averaged weights: 5 % away from the trained ones
            shadow.add_(0.05 * shadow.abs().mean() * torch.randn_like(shadow))
    compiled = torch.compile(model, backend="fp8", options=REF)
    with torch.no_grad():
        trained = compiled(x)
        ema.store(model.parameters())
        ema.copy_to(model.parameters())  # writes every weight through param.data
        averaged = compiled(x)
        ema.restore(model.parameters())  # and back
        back = compiled(x)
    assert torch.equal(back, trained)
    assert not torch.equal(averaged, trained)
    ema.copy_to(model.parameters())
    assert torch.equal(averaged, fresh_compile_output(model, x))


def test_peft_merge_and_unmerge_are_followed_by_the_compiled_model():
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    def build():
        torch.manual_seed(0)
        config = LoraConfig(r=4, target_modules=["a", "b"], init_lora_weights=False)  # B != 0: the merge moves W
        return inject_adapter_in_model(config, Mlp().eval())

    model, x = build(), torch.randn(4, 64)
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    compiled = torch.compile(model, backend="fp8", options=REF)
    with torch.no_grad():
        unmerged = compiled(x)
        for layer in layers:
            layer.merge()  # base weight += B @ A, through .data
        merged = compiled(x)
        for layer in layers:
            layer.unmerge()  # and back: the first graph again, no recompile
        again = compiled(x)
    assert torch.equal(again, fresh_compile_output(model, x, build))  # W + BA - BA: not W bit for bit
    assert (again - unmerged).abs().max() < 0.01 * unmerged.abs().max()
    assert (merged - unmerged).abs().max() < 0.1 * unmerged.abs().max()  # the same function, merged


def test_a_noted_write_into_a_prepared_model_raises_naming_the_layer_on_its_next_call():
    from fx_fp8.quant.weight_writers import note_weights_written

    model, x = three_linears(), torch.randn(4, 64)
    fx_fp8.prepare_model(model, quantization="fp8")
    compiled = torch.compile(model, backend="fp8", options=REF)
    with torch.no_grad():
        compiled(x)
        model[1].weight.data.copy_(torch.zeros_like(model[1].weight))  # through .data: no version counter moves
        compiled(x)  # unseen per call: the trade-off
        note_weights_written()  # what the followed writers say
        with pytest.raises(Exception, match="prepared layer 1 was written after prepare_model"):
            compiled(x)


def test_writers_imported_after_fx_fp8_compiled_are_followed_too():
    """A training script may import diffusers' EMA or PEFT after compiling: the import hook wraps them."""
    import subprocess
    import sys

    code = (
        "import sys, torch, fx_fp8\n"
        "from fx_fp8.quant.weight_writers import follow_writers\n"
        "assert 'diffusers.training_utils' not in sys.modules and 'peft.tuners.lora.layer' not in sys.modules\n"
        "follow_writers()  # what the backend does when it compiles a graph\n"
        "from diffusers.training_utils import EMAModel\n"
        "from peft.tuners.lora.layer import Linear\n"
        "print(all(getattr(f, '_fx_fp8_counts_writes', False) for f in (EMAModel.copy_to, EMAModel.restore,"
        " Linear.merge, Linear.unmerge)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "True"
