"""A step policy read from a checkpoint: `quantization_config.runtime.diffusion_step_policy` in a
transformer's config.json, the schema vLLM-Omni, diffusers, SGLang and TensorRT-LLM read from
Cosmos3 ModelOpt FP8 checkpoints (vllm-omni#6560, diffusers#14664):

    {"schema_version": 1, "type": "first_last_n", "index_space": "denoising_loop_iteration",
     "scope": ["transformer"], "default_mode": "native",
     "first_steps": {"count": 3, "mode": "a16"}, "last_steps": {"count": 3, "mode": "a16"},
     "overlap": "a16", "reasoner": "a16"}

Meaning, as their loaders read it: the transformer's quantized linears run W8A16 (the resident
quantized weights, activations not quantized) on the first `first_steps.count` and the last
`last_steps.count` denoising steps, W8A8 ("native": the checkpoint's own path) on the others.
In fx_fp8 that is quantization_config.skip_steps "first:F,last:L" with skip_steps_mode
"weight_only"; attention is not part of the policy. A policy whose scope does not name the
component is not that component's (no policy). Fail closed, as the loaders do: a missing or
unknown field, or a value fx_fp8 cannot express (another type, index space, default or overlap
mode, a step mode other than a16), is an error naming the field and its value. `reasoner` selects
the precision of Cosmos3's understanding tower, a path fx_fp8 does not compile: it is checked,
and has no effect here. One difference: those loaders run a one-step schedule (a warm-up probe)
all W8A8; fx_fp8's selectors place first:F in any run, so a one-step run is W8A16.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

FIELDS = (
    "schema_version",
    "type",
    "index_space",
    "scope",
    "default_mode",
    "first_steps",
    "last_steps",
    "overlap",
    "reasoner",
)
RANGE_FIELDS = ("count", "mode")
#: field -> the one value fx_fp8 can express
FIXED = {"type": "first_last_n", "index_space": "denoising_loop_iteration", "default_mode": "native", "overlap": "a16"}


class CheckpointStepPolicyError(ValueError):
    """A diffusion_step_policy that is malformed, or one fx_fp8 cannot express."""


def _fail(field: str, value, expected: str) -> CheckpointStepPolicyError:
    return CheckpointStepPolicyError(
        f"quantization_config.runtime.diffusion_step_policy.{field} = {value!r}: "
        f"expected {expected} (the policy is refused rather than run differently)"
    )


def _count(policy: Mapping, name: str) -> int:
    value = policy[name]
    if not isinstance(value, Mapping) or set(value) != set(RANGE_FIELDS):
        raise _fail(name, value, f"a mapping with exactly the fields {list(RANGE_FIELDS)}")
    if value["mode"] != "a16":
        raise _fail(f"{name}.mode", value["mode"], "'a16' (W8A16: fx_fp8's skip_steps_mode weight_only)")
    count = value["count"]
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise _fail(f"{name}.count", count, "a non-negative integer")
    return count


def read_step_policy(quantization_config, component: str = "transformer") -> Optional[dict]:
    """The policy in `quantization_config` (a checkpoint's config.json mapping, or an object with
    `runtime` / `to_dict()`) as FP8Config keys, {"quantization_skip_steps": "first:3,last:3",
    "quantization_skip_steps_mode": "weight_only"}; None when it carries none (or none for `component`)."""
    if quantization_config is None:
        return None
    if not isinstance(quantization_config, Mapping):
        runtime = getattr(quantization_config, "runtime", None)
        if runtime is None and callable(getattr(quantization_config, "to_dict", None)):
            runtime = quantization_config.to_dict().get("runtime")
    else:
        runtime = quantization_config.get("runtime")
    if runtime is None:
        return None
    if not isinstance(runtime, Mapping):
        raise CheckpointStepPolicyError(f"quantization_config.runtime = {runtime!r}: expected a mapping")
    if "diffusion_step_policy" not in runtime:
        return None
    policy = runtime["diffusion_step_policy"]
    if not isinstance(policy, Mapping):
        raise _fail("", policy, "a mapping")
    unknown, missing = sorted(set(policy) - set(FIELDS)), sorted(set(FIELDS) - set(policy))
    if unknown or missing:
        raise CheckpointStepPolicyError(
            f"quantization_config.runtime.diffusion_step_policy: "
            f"{'unknown fields ' + str(unknown) if unknown else ''}"
            f"{'; ' if unknown and missing else ''}"
            f"{'missing fields ' + str(missing) if missing else ''} (expected {list(FIELDS)})"
        )
    version = policy["schema_version"]
    if not isinstance(version, int) or isinstance(version, bool) or version != 1:
        raise _fail("schema_version", version, "the integer 1")
    for field, value in FIXED.items():
        if policy[field] != value:
            raise _fail(field, policy[field], repr(value))
    scope = policy["scope"]
    if not isinstance(scope, list) or not scope or not all(isinstance(s, str) for s in scope):
        raise _fail("scope", scope, "a non-empty list of component names")
    if policy["reasoner"] not in ("native", "a16"):
        raise _fail("reasoner", policy["reasoner"], "'native' or 'a16'")
    first, last = _count(policy, "first_steps"), _count(policy, "last_steps")
    if component not in scope:
        return None
    steps = ",".join(p for p in (f"first:{first}" if first else "", f"last:{last}" if last else "") if p)
    return {"quantization_skip_steps": steps, "quantization_skip_steps_mode": "weight_only"}
