"""The tune table's say over one linear's plan: the step after plan_linear that the linear pass and
prepare_model both take, so a prepared model holds exactly the layers the compiled graph quantizes.

Under quantization_config.kernel "auto" the table measured on this device (fx_fp8.ops.tune_table)
may keep a linear the rules quantize native, or make it weight-only, at the linear's token count M.
The linear pass knows M from the graph; prepare_model from its trace on example_inputs, and not at
all without them (nor does the load-time quantizer): `table_unapplied` is then what they say instead.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from fx_fp8.ops import tune_table
from fx_fp8.ops.formats import WEIGHT_ONLY
from fx_fp8.quant.linear_plan import LinearPlan, native
from fx_fp8.quant.recipe import WeightRecipe

log = logging.getLogger("fx_fp8")
_said: set = set()  # (who, table) already logged


def plan_kind(plan: LinearPlan) -> str:
    """The tune table's name for what a plan runs: "native", "weight_only" or "quantized" (W8A8)."""
    return "native" if plan.native else "weight_only" if plan.weight_only else "quantized"


def tuned_plan(
    plan: LinearPlan,
    qcfg,
    lowering,
    *,
    m: Optional[int],
    k: int,
    n: int,
    dtype: str,
    device,
    has_bias: bool,
    sensitive: bool,
) -> LinearPlan:
    """`plan` as the tune table of `device` has it at M `m` (None: unknown), K `k`, N `n`, activations
    of `dtype` ("bfloat16"): kept, or made native or weight-only (the storage `lowering`'s W8A16
    takes), its reason and `measurement` saying what was measured (fx_fp8.ops.tune_table.shape_decision;
    kernel rules, an explicit sensitive: fp8 for a `sensitive` layer and native plans are left as they are)."""
    ran = plan_kind(plan)
    kind, why, timing = tune_table.shape_decision(
        ran, plan.reason, m, k, n, dtype, device, has_bias, qcfg, lowering.name, sensitive
    )
    if kind == ran:
        return (
            plan
            if why == plan.reason
            else dataclasses.replace(plan, reason=why, measurement=why, timing=timing or None)
        )
    if kind == "native":
        return dataclasses.replace(native(why), measurement=why, timing=timing)
    # the table picked weight-only where the rules planned W8A8: the storage the device's W8A16 takes
    return LinearPlan(
        "weight_only", why, WeightRecipe.weight_only(qcfg, lowering), WEIGHT_ONLY, measurement=why, timing=timing
    )


def table_unapplied(qcfg, lowering, device) -> Optional[str]:
    """Where a tune table applies to `device` under this config and `lowering` (kernel auto; on CUDA,
    or anywhere with an explicit tune_table): the table's source, for saying it was not applied
    when M is unknown. None when the compiled graph would follow no table either."""
    if not tune_table.follows_table(qcfg, lowering.name):
        return None
    found = tune_table.table_for(device, qcfg.tune_table)
    if found is None or not found[1].get("linears"):
        return None  # nothing measured for linears: the compile path keeps the rules' plan too
    return tune_table.describe_source(*found)


def rules_plan(plan: LinearPlan, qcfg, lowering, device, sensitive: bool, who: str, why: str) -> LinearPlan:
    """`plan` kept as the rules made it where a tune table applies but M is unknown to `who` (the
    load-time quantizer): its reason says the table was not applied and `why`, and an INFO line on
    logging.getLogger("fx_fp8") says so once per `who` and table."""
    if plan.native or (sensitive and qcfg.sensitive == "fp8"):  # the table has no say over these
        return plan
    source = table_unapplied(qcfg, lowering, device)
    if source is None:
        return plan
    if (who, source) not in _said:
        _said.add((who, source))
        log.info("fx_fp8: %s did not apply the tune table %s: %s", who, source, why)
    note = f"tune table not applied ({why}): {source}"
    return dataclasses.replace(plan, reason=f"{plan.reason}; {note}" if plan.reason else note)
