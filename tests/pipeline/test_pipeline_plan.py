"""compile_pipeline is plan_pipeline (every check, nothing changed) then install (only changes):
the config is read once, and a refused call leaves the pipeline exactly as it was."""

from __future__ import annotations

import warnings

import pytest
import torch

import fx_fp8
import fx_fp8.config.files as config_files
from fx_fp8.pipeline.plan import PipelinePlan, plan_pipeline
from fx_fp8.pipeline.state import STATE_ATTR
from fx_fp8.tools.model_zoo.pipelines import tiny_flux
from fx_fp8.tools.model_zoo.text_encoders import tiny_clip, tiny_t5


def _flux_with_encoders():
    pipe, _ = tiny_flux()
    pipe.register_modules(text_encoder=tiny_clip(), text_encoder_2=tiny_t5())
    return pipe


@pytest.fixture
def yaml_reads(monkeypatch):
    """How many times a YAML config was parsed (every reader goes through _load_bounded)."""
    count = [0]
    real = config_files._load_bounded

    def counting(stream, path):
        count[0] += 1
        return real(stream, path)

    monkeypatch.setattr(config_files, "_load_bounded", counting)
    return count


@pytest.mark.parametrize(
    "text",
    [
        "diffusion_kv_cache_dtype: fp8\nquantization: fp8\nparallel_config: {ulysses_degree: 1}\n",
        "quantization:\n  transformer: fp8\n  text_encoder_2: int8\n",
        "stage_args:\n- stage_type: diffusion\n  engine_args: {model: x, quantization: fp8}\n",
    ],
)
def test_a_yaml_config_is_read_once_per_call(tmp_path, yaml_reads, text):
    """The old compile_pipeline read a YAML path two or three times (the component map, each
    FP8Config, the pipeline options)."""
    path = tmp_path / "stage.yaml"
    path.write_text(text)
    pipe = _flux_with_encoders()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fx_fp8.compile_pipeline(pipe, str(path), prepare=False)
    assert yaml_reads[0] == 1
    assert fx_fp8.pipeline_state(pipe).compiled


def test_the_plan_holds_what_install_needs_and_changes_nothing(tmp_path):
    path = tmp_path / "stage.yaml"
    path.write_text("quantization:\n  transformer: fp8\n  text_encoder_2: int8\n")
    pipe = _flux_with_encoders()
    before = _snapshot(pipe)
    plan = plan_pipeline(pipe, str(path), mode="max-autotune", compile_kwargs={"dynamic": False})
    assert isinstance(plan, PipelinePlan) and _same(_snapshot(pipe), before)
    assert list(plan.transformers) == ["transformer"] and plan.configs["transformer"].quantization == "fp8"
    assert list(plan.others) == ["text_encoder_2"] and plan.others["text_encoder_2"][1].quantization == "int8"
    assert plan.backend_options["mode"] == "max-autotune" and dict(plan.compile_kwargs) == {"dynamic": False}
    with pytest.raises(Exception):
        plan.backend = "fp8_npu"  # frozen


def _snapshot(pipe) -> dict:
    """What compile_pipeline may change: the pipeline's class, state and components, each module's
    hooks and layers, the weights, the scheduler's step."""
    modules = {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    return {
        "class": type(pipe),
        "state": getattr(pipe, STATE_ATTR, None),
        "components": dict(pipe.components),
        "step": pipe.scheduler.step,
        "layers": {n: [(k, type(s)) for k, s in m.named_modules()] for n, m in modules.items()},
        "hooks": {
            n: sum(len(s._forward_pre_hooks) + len(s._forward_hooks) for s in m.modules()) for n, m in modules.items()
        },
        "weights": {n: {k: v.clone() for k, v in m.state_dict().items()} for n, m in modules.items()},
    }


def _same(a: dict, b: dict) -> bool:
    weights_a, weights_b = a.pop("weights"), b.pop("weights")
    assert weights_a, "no weights to compare"
    same_weights = weights_a.keys() == weights_b.keys() and all(
        wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
        for wa, wb in zip(weights_a.values(), weights_b.values())
    )
    return same_weights and a == b


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"quantization": {"text_encoder": "fp8", "text_encoder_3": "fp8"}}, "'text_encoder_3', which FluxPipeline"),
        ({"quantization": {"clip*": "fp8"}}, "'clip\\*'.* shell pattern"),
        (
            {"quantization": {"text_encoder": "fp8"}, "compile_kwargs": {"fullgrap": True}},
            "unknown torch.compile keyword",
        ),
        (
            {"quantization": {"text_encoder": "fp8"}, "regional": True, "cache_backend": "first_block_cache"},
            "regional=True is not combined",
        ),
        ({"quantization": {"text_encoder": "fp8"}, "mode": "fast"}, "invalid mode"),
        ({"quantization": {"text_encoder": "fp8"}, "inductor_options": {"no_such_option": 1}}, "no_such_option"),
        ({"quantization": {"text_encoder": "fp8"}, "cache_backend": "tea_cache"}, "tea_cache"),
    ],
)
def test_a_refused_plan_leaves_the_pipeline_untouched(kwargs, message):
    """Refusals from the first check to the last: the components a map covers (the text encoders
    here) would be prepared first by install, so each refusal must come before it."""
    pipe = _flux_with_encoders()
    before = _snapshot(pipe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=message):
            fx_fp8.compile_pipeline(pipe, **kwargs)
    assert _same(_snapshot(pipe), before)
