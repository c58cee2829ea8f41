"""Round four of hostile use: a hang, sensitive layers lost from the 9th model of a class, CLI
commands that could not place relative steps, damaged checkpoints, a parameterless module that
never warned, and an undocumented difference from vLLM-Omni."""
from __future__ import annotations

import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

import fx_fp8
from fx_fp8.graph.sensitive import sensitive_linear_names
from test_cli import cli, no_work, one_error_line, strict_json  # noqa: F401 (no_work: a fixture)
from test_sensitive_layers import FIN, MOD, TC, ToyDiT, toy_inputs

ROOT = Path(__file__).resolve().parents[1]


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


class _Scheduler:
    def step(self, out, t, x):
        return x - 0.1 * out


class _ToyPipe:
    def __init__(self):
        torch.manual_seed(0)
        self.transformer, self.scheduler = RegionalToy().eval(), _Scheduler()

    def __call__(self, steps=2):
        kw = toy_inputs()
        for i in range(steps):
            kw["x"] = self.scheduler.step(self.transformer(**kw), i, kw["x"])
        return kw["x"]


def test_regional_compile_pipeline_with_prepare_returns_and_records_only_the_runs_calls():
    def compile_and_run():
        pipe = fx_fp8.compile_pipeline(_ToyPipe(), regional=True, quantization="fp8")
        with torch.no_grad():
            pipe()
        return pipe

    pipe = _within(120, compile_and_run)
    state = fx_fp8.pipeline_state(pipe)
    # prepared on the first call, by structure, and the blocks compiled on their own
    assert {"blocks.0.ada", "final_ada", "t_fc1"} <= set(state.prepared["transformer"]["weight_only"])
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
        results = [fx_fp8.prepare_model(TinyDiT().eval(), quantization="fp8", example_inputs=args)
                   for _ in range(4)]
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
