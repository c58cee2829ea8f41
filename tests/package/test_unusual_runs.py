"""Unusual runs that once failed quietly: a hang, sensitive layers lost from the 9th model of a
class, CLI commands that could not place relative steps, damaged checkpoints, a parameterless
module that never warned, and an undocumented difference from vLLM-Omni."""

from __future__ import annotations

import json
import re
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

import fx_fp8
from fx_fp8.quant.checkpoint import QUANT_NAME, WEIGHTS_NAME
from fx_fp8.graph.sensitive import sensitive_linear_names

from checks import FIN, MOD, TC, big_enough, decisions
from cli_runs import cli, no_work, one_error_line, strict_json  # noqa: F401 (no_work: a fixture)
from graph_capture import run_pass
from toy_models import ToyDiT, ToyPipe, TwoLinears

ROOT = Path(__file__).resolve().parents[2]


def _messages(record) -> list[str]:
    return [str(w.message) for w in record]


def _within(seconds: float, fn):
    """fn() in a thread that must end within `seconds`: a deadlock fails the test instead of hanging
    the suite (the thread is a daemon, left blocked)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised in the test's thread
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"no return within {seconds} s: deadlocked"
    if "error" in out:
        raise out["error"]
    return out.get("value")


# -- compile_pipeline(regional=True) with prepare=True -------------------------------------------
class RegionalToy(ToyDiT):
    """A toy DiT declaring its blocks as diffusers models do, for compile_repeated_blocks."""

    _repeated_blocks = ("ToyBlock",)

    def compile_repeated_blocks(self, *args, **kwargs):  # as diffusers' ModelMixin does
        for module in self.modules():
            if type(module).__name__ in self._repeated_blocks:
                module.compile(*args, **kwargs)


def test_regional_compile_pipeline_with_prepare_returns_and_records_only_the_runs_calls():
    def compile_and_run():
        pipe = fx_fp8.compile_pipeline(ToyPipe(RegionalToy), regional=True, quantization="fp8")
        with torch.no_grad():
            pipe()
        return pipe

    pipe = _within(120, compile_and_run)
    state = fx_fp8.pipeline_state(pipe)
    # prepared on the first call, by structure, and the blocks compiled on their own
    assert {"blocks.0.ada", "final_ada", "t_fc1"} <= set(state.prepared["transformer"]["weight_only"])
    assert pipe.transformer.blocks  # not vacuous: all() of nothing is True
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in pipe.transformer.blocks)
    # prepare's trace of the model ran its hooks: not a call of the run
    assert [c.step for c in state.calls] == [0, 1]


# -- the sensitive-layer analysis, model after model ----------------------------------------------
class TinyDiT(nn.Module):
    """The smallest model with each kind of sensitive layer: a timestep embedder, an adaLN
    modulation and a final projection around one token-stream linear."""

    def __init__(self, dim=32):
        super().__init__()
        self.t_emb = nn.Linear(32, dim)
        self.mod = nn.Linear(dim, 2 * dim)
        self.body = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, t):
        c = self.t_emb(torch.cat([t[:, None].cos(), t[:, None].sin()], -1).repeat(1, 16))
        shift, scale = self.mod(torch.nn.functional.silu(c))[:, None].chunk(2, -1)
        h = torch.nn.functional.scaled_dot_product_attention(x, x, x)
        h = self.body(h) * (1 + scale) + shift
        return self.out(h)


TINY_SENSITIVE = {"t_emb": TC, "mod": MOD, "out": FIN}


def _tiny_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 8, 32, generator=g), torch.rand(1, generator=g))


def test_the_twentieth_model_of_a_class_gets_the_first_ones_sensitive_layers():
    args = _tiny_inputs()
    found = [sensitive_linear_names(TinyDiT().eval(), args) for _ in range(20)]
    assert found[0] == TINY_SENSITIVE
    assert all(f == found[0] for f in found), [sorted(f) for f in found]
    # the analysis consumed none of the class's own Dynamo cache entries (Dynamo stops compiling a
    # code object at 8): a later fp8 compile of the class still compiles
    assert _debug_get_cache_entry_list(TinyDiT.forward.__code__) == []
    compiled = torch.compile(TinyDiT().eval(), backend="fp8", options={"quantization": "fp8"})
    with torch.no_grad():
        compiled(*args)
    assert len(fx_fp8.get_reports(compiled)) == 1


def test_prepare_model_finds_the_same_layers_past_the_recompile_limit():
    args = _tiny_inputs()
    with torch._dynamo.config.patch(recompile_limit=2):
        results = [fx_fp8.prepare_model(TinyDiT().eval(), quantization="fp8", example_inputs=args) for _ in range(4)]
    assert results  # not vacuous: all() of nothing is True
    assert all(sorted(r["weight_only"]) == sorted(TINY_SENSITIVE) for r in results), [r["weight_only"] for r in results]


class _Untraceable(TinyDiT):
    @torch.compiler.disable
    def forward(self, x, t):
        return super().forward(x, t)


def test_an_analysis_that_traces_nothing_is_an_error_not_nothing_sensitive():
    with pytest.raises(RuntimeError, match="_Untraceable.*traced no graph.*sensitive="):
        fx_fp8.prepare_model(_Untraceable().eval(), quantization="fp8", example_inputs=_tiny_inputs())


# -- fx-fp8 inspect / dump with step selectors counting from the end -------------------------------
TINY_YAML = ROOT / "fx_fp8" / "tools" / "tiny_model" / "weights" / "fx_fp8.yaml"  # first:2,last:2


def test_inspect_and_dump_place_relative_step_selectors_in_a_run_of_steps(tmp_path, capsys):
    flags = ("--config", TINY_YAML, "--quantization-skip-steps", "last:2")
    code, out, err = cli(capsys, "inspect", "--format", "json", *flags)
    assert code == 0, err
    summary = strict_json(out)["summary"]
    assert summary["steps"] == 8 and summary["skipped_steps"] == {"attention": "0-1,6-7", "linear": "6-7"}
    assert len(summary["step_variants"]) == 3  # fp8; attention native; attention native + linears weight-only
    code, out, err = cli(capsys, "dump", "--out", tmp_path / "dump", "--steps", "10", *flags)
    assert code == 0, err
    report = (tmp_path / "dump" / "report.txt").read_text()
    assert "skipped steps in a run of 10 (--steps): attention 0-1,8-9; linear 8-9" in report


def test_inspect_refuses_a_run_of_no_steps(capsys, no_work):
    for command in (("inspect",), ("dump", "--out", "unused")):
        code, out, err = cli(capsys, *command, "--steps", "0")
        assert code == 2 and "invalid --steps 0: expected a positive integer" in one_error_line(err)


# -- damaged checkpoints --------------------------------------------------------------------------
def _saved(tmp_path) -> Path:
    torch.manual_seed(0)
    model = TwoLinears().eval()
    fx_fp8.prepare_model(model, quantization="fp8")
    fx_fp8.save_quantized(model, tmp_path)
    return tmp_path


def _data_offset(path: Path, key: str) -> int:
    """Where `key`'s bytes start in a safetensors file (an 8-byte header length, the JSON header, the data)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    return 8 + n + header[key]["data_offsets"][0]


def test_a_checkpoint_with_flipped_bytes_is_refused_naming_the_tensor_and_the_file(tmp_path):
    folder = _saved(tmp_path)
    path = folder / WEIGHTS_NAME
    raw = bytearray(path.read_bytes())
    raw[_data_offset(path, "a.weight")] = 0x7F  # an e4m3fn NaN code: the same size, no format error
    path.write_bytes(bytes(raw))
    fresh = TwoLinears().eval()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}.* is damaged: the bytes of a\.weight differ"):
        fx_fp8.load_quantized(folder, model=fresh)
    assert fresh.state_dict()  # not vacuous: all() of nothing is True
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())  # the model is untouched
    # the switch for huge models skips the check (and the NaN it let through is the caller's)
    loaded = fx_fp8.load_quantized(folder, model=TwoLinears().eval(), verify=False)
    with torch.no_grad():
        assert loaded(torch.randn(2, 64)).isnan().any()


def test_every_damaged_checkpoint_file_is_named_in_the_error(tmp_path):
    folder = _saved(tmp_path)
    weights, description = folder / WEIGHTS_NAME, folder / QUANT_NAME
    good_weights, good_description = weights.read_bytes(), description.read_bytes()
    weights.write_bytes(good_weights[: len(good_weights) // 2])  # truncated
    with pytest.raises(ValueError, match=rf"cannot read {re.escape(repr(str(weights)))}: .*damaged or truncated"):
        fx_fp8.load_quantized(folder, model=TwoLinears())
    weights.write_bytes(good_weights)
    description.write_bytes(good_description[:40])  # unreadable JSON
    with pytest.raises(ValueError, match=rf"cannot read {re.escape(repr(str(description)))}"):
        fx_fp8.load_quantized(folder, model=TwoLinears())
    description.write_bytes(b"\xff\xfe not text")
    with pytest.raises(ValueError, match=rf"cannot read {re.escape(repr(str(description)))}"):
        fx_fp8.load_quantized(folder, model=TwoLinears())
    record = json.loads(good_description)
    del record["layers"]
    description.write_text(json.dumps(record))
    with pytest.raises(ValueError, match=rf"{re.escape(repr(str(description)))} is damaged: 'layers'"):
        fx_fp8.load_quantized(folder, model=TwoLinears())


def test_the_weights_file_of_another_save_is_refused(tmp_path):
    one, other = _saved(tmp_path / "one"), tmp_path / "other"
    model = TwoLinears().eval()  # the same structure, other weights
    fx_fp8.prepare_model(model, quantization="fp8")
    fx_fp8.save_quantized(model, other)
    (one / WEIGHTS_NAME).write_bytes((other / WEIGHTS_NAME).read_bytes())
    with pytest.raises(
        ValueError, match=r"the bytes of a\.bias, a\.weight, .* not the one saved with this description"
    ):
        fx_fp8.load_quantized(one, model=TwoLinears())


def test_a_checkpoint_without_digests_loads_with_a_warning(tmp_path):
    folder = _saved(tmp_path)
    record = json.loads((folder / QUANT_NAME).read_text())
    assert record["tensor_digests"]["algorithm"] == "blake2b-128"
    assert sorted(record["tensor_digests"]["tensors"]) == sorted(load_file(folder / WEIGHTS_NAME))
    del record["tensor_digests"]  # as an fx_fp8 before digests wrote it
    (folder / QUANT_NAME).write_text(json.dumps(record))
    with pytest.warns(UserWarning, match="records no tensor digests.*not verified"):
        fx_fp8.load_quantized(folder, model=TwoLinears())


# -- a module without parameters, compiled once per instance --------------------------------------
class _Attention(nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def test_each_compiled_parameterless_module_warns_about_an_unpublished_step():
    q = torch.randn(1, 2, 16, 64)
    compiled = [
        torch.compile(_Attention(), backend="fp8", options={"diffusion_kv_cache_skip_steps": "0"}) for _ in range(2)
    ]
    for c in compiled:  # Dynamo runs the first one's graph for the second: the same class, no parameters
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            with torch.no_grad():
                c(q, q, q)
        assert [m for m in _messages(record) if "no denoising step was published" in m], _messages(record)
        # and its decisions are reported on it, not on the first one
        assert [r.step_variant for r in fx_fp8.get_reports(c)] == ["fp8", "native"]


# -- vLLM-Omni's BF16 layers: quantization_config.sensitive: native -------------------------------
#: the linears vLLM-Omni builds as plain BF16 layers in its model code (embedders, adaLN modulation,
#: the final projection), spelled as diffusers names them; written from the model code, not from
#: fx_fp8's patterns
VLLM_OMNI_BF16 = {
    "flux": r"time_text_embed\..*|context_embedder|x_embedder|transformer_blocks\.\d+\.norm1(_context)?\.linear|"
    r"single_transformer_blocks\.\d+\.norm\.linear|norm_out\.linear|proj_out",
    "qwen-image": r"time_text_embed\..*|img_in|txt_in|transformer_blocks\.\d+\.(img|txt)_mod\.1|norm_out\.linear|proj_out",
    "z-image": r"t_embedder\..*|cap_embedder\..*|all_x_embedder\..*|(layers|noise_refiner|context_refiner)\.\d+\."
    r"adaLN_modulation\..*|all_final_layer\..*",
    "wan": r"condition_embedder\..*|proj_out",
}
#: (family, extra config): its hard-wired layers for four families, and its recommended Qwen-Image
#: setting `ignored_layers: ["img_mlp"]` with FP8 and with INT8
VLLM_OMNI_CASES = {
    "flux": ("flux", {}),
    "qwen-image": ("qwen-image", {}),
    "z-image": ("z-image", {}),
    "wan": ("wan", {}),
    "qwen-image+img_mlp-fp8": ("qwen-image", {"ignored_layers": ["img_mlp"]}),
    "qwen-image+img_mlp-int8": ("qwen-image", {"ignored_layers": ["img_mlp"], "quantization": "int8"}),
}


@pytest.mark.parametrize("case", list(VLLM_OMNI_CASES))
def test_sensitive_native_keeps_vllm_omnis_bf16_layers_and_the_default_runs_them_weight_only(case):
    family, extra = VLLM_OMNI_CASES[case]
    bf16 = re.compile(VLLM_OMNI_BF16[family])
    img_mlp = re.compile(r".*\.img_mlp\..*") if extra.get("ignored_layers") else None
    report, _, _, linears = run_pass(family, **extra, quantization_config={"sensitive": "native"})
    got = decisions(report)
    eligible = {n for n, lin in linears.items() if big_enough(lin)}  # the rest is native for its size anyway
    expected = {n for n in eligible if bf16.fullmatch(n) or (img_mlp is not None and img_mlp.fullmatch(n))}
    assert expected and {n for n in eligible if got[n].action == "native"} == expected
    method = extra.get("quantization", "fp8")
    assert {got[n].action for n in eligible - expected} == {method}
    # the default stores the same sensitive layers weight-only (W8A16): the documented difference
    report, _, _, _ = run_pass(family, **extra)
    got = decisions(report)
    sensitive = {n for n in expected if img_mlp is None or not img_mlp.fullmatch(n)}
    assert {n for n in eligible if got[n].action == "weight-only"} == sensitive


def test_the_sensitive_layer_difference_from_vllm_omni_is_documented_with_its_setting_and_numbers():
    section = (ROOT / "docs" / "configuration.md").read_text().split("## Deliberate differences from vLLM-Omni")[1]
    section = section.split("\n## ")[0]
    assert "`quantization_config: {sensitive: native}` is vLLM-Omni's behaviour" in section
    # its numbers are the README's
    readme = (ROOT / "README.md").read_text().split("## Sensitive layers")[1].split("\n## ")[0]
    rows = {
        r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:5]]
        for r in readme.splitlines()
        if r.startswith("| `native`") or r.startswith("| `weight_only` (default")
    }
    assert len(rows) == 2
    for row in rows.values():
        assert all(value in section for value in row), row
