"""A step policy read from a checkpoint: quantization_config.runtime.
diffusion_step_policy, the schema vLLM-Omni and diffusers read from Cosmos3 ModelOpt checkpoints,
becomes fx_fp8's linear step policy (W8A16 on the first / last steps); malformed or inexpressible
policies fail closed naming the field; a tiny checkpoint written here carries one."""

from __future__ import annotations

import copy
import json
import types
import warnings

import pytest
import torch
import torch.nn as nn

import fx_fp8
from fx_fp8.compile.stored_config import StoredConfigConflict, stored_config
from fx_fp8.config.checkpoint_step_policy import CheckpointStepPolicyError, read_step_policy

POLICY = {
    "schema_version": 1,
    "type": "first_last_n",
    "index_space": "denoising_loop_iteration",
    "scope": ["transformer"],
    "default_mode": "native",
    "first_steps": {"count": 1, "mode": "a16"},
    "last_steps": {"count": 2, "mode": "a16"},
    "overlap": "a16",
    "reasoner": "a16",
}


def _with(**changes) -> dict:
    policy = copy.deepcopy(POLICY)
    for k, v in changes.items():
        if v is None:
            del policy[k]
        else:
            policy[k] = v
    return {"quant_algo": "FP8", "runtime": {"diffusion_step_policy": policy}}


def test_the_policy_becomes_fx_fp8s_linear_step_policy():
    assert read_step_policy(_with()) == {
        "quantization_skip_steps": "first:1,last:2",
        "quantization_skip_steps_mode": "weight_only",
    }
    assert read_step_policy(_with(first_steps={"count": 0, "mode": "a16"}))["quantization_skip_steps"] == "last:2"
    assert read_step_policy(_with(scope=["text_encoder"])) is None  # another component's
    assert read_step_policy({"quant_algo": "FP8"}) is None and read_step_policy(None) is None


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"type": "every_n"}, "type = 'every_n': expected 'first_last_n'"),
        ({"default_mode": "a16"}, "default_mode = 'a16'"),
        ({"overlap": "native"}, "overlap = 'native'"),
        ({"index_space": "timestep"}, "index_space = 'timestep'"),
        ({"first_steps": {"count": 2, "mode": "native"}}, "first_steps.mode = 'native'"),
        ({"last_steps": {"count": -1, "mode": "a16"}}, "last_steps.count = -1"),
        ({"schema_version": 2}, "schema_version = 2"),
        ({"scope": []}, "scope = []"),
        ({"reasoner": "fp4"}, "reasoner = 'fp4'"),
        ({"overlap": None}, "missing fields ['overlap']"),
        ({"stride": 2}, "unknown fields ['stride']"),
    ],
)
def test_a_policy_fx_fp8_cannot_express_fails_closed_naming_the_field(changes, needle):
    with pytest.raises(CheckpointStepPolicyError) as e:
        read_step_policy(_with(**changes))
    assert needle in str(e.value)


class _Linears(nn.Module):
    def __init__(self, quantization_config):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)
        self.config = types.SimpleNamespace(quantization_config=quantization_config)

    def forward(self, x):
        return self.b(self.a(x))


def _variants(compiled, steps=4) -> dict:
    seen = {}
    with torch.no_grad():
        for step in range(steps):
            with fx_fp8.denoising_step(step, total=steps):
                compiled(torch.randn(2, 64))
    for r in fx_fp8.get_reports(compiled):
        seen[r.step_variant] = sorted({e.action for e in r.entries if e.op == "linear"})
    return seen


def test_a_checkpoint_of_another_method_runs_its_policy_and_an_option_cannot_silently_replace_it():
    model = _Linears(_with())  # a ModelOpt-style config.json section
    assert _variants(torch.compile(model, backend="fp8")) == {"fp8": ["fp8"], "linear_weight_only": ["weight-only"]}
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"diffusion_step_policy asks for 'first:1,last:2'.*options ask for '0'"):
        _variants(torch.compile(model, backend="fp8", options={"quantization_skip_steps": "0"}))


@pytest.mark.slow
def test_a_tiny_fx_fp8_checkpoint_with_a_policy(tmp_path):
    from diffusers import FluxTransformer2DModel

    from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_tiny_transformer("flux").save_pretrained(tmp_path / "bf16")
        loaded = FluxTransformer2DModel.from_pretrained(tmp_path / "bf16", quantization_config=fx_fp8.DiffusersConfig())
        loaded.save_pretrained(tmp_path / "fp8")
        config = json.loads((tmp_path / "fp8" / "config.json").read_text())
        config["quantization_config"]["runtime"] = _with()["runtime"]  # as ModelOpt's exporter adds it
        (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
        model = FluxTransformer2DModel.from_pretrained(tmp_path / "fp8").eval()
    qc = stored_config(model).quantization_config
    assert (str(qc.skip_steps), qc.skip_steps_mode) == ("first:1,last:2", "weight_only")
    compiled = torch.compile(model, backend="fp8")
    with torch.no_grad():
        for step in (0, 1):
            with fx_fp8.denoising_step(step, total=4):
                compiled(**example_inputs("flux", model))
    variants = {r.step_variant: {e.action for e in r.entries if e.op == "linear"} for r in fx_fp8.get_reports(compiled)}
    assert (
        set(variants) == {"fp8", "linear_weight_only"}
        and "fp8" not in variants["linear_weight_only"]
        and "fp8" in variants["fp8"]
    )
    model.save_pretrained(tmp_path / "again")  # the runtime section survives a save
    again = json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]
    assert again["runtime"] == _with()["runtime"]
