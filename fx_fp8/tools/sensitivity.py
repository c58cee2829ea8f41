"""Which blocks and steps must stay native: measure, rank, search (`fx-fp8 sensitivity`).

Method: one item quantized at a time. Items are the attention of each layer
(all steps), the attention of each denoising step (all layers), the FP8
linears of each block, and FP8 linears outside the blocks (if any). For each
item the pipeline runs with only that item in FP8 and everything else native,
and the error of the final latents against the native run is measured (MSE;
PSNR with the native latents' value range as peak).

Why one-at-a-time rather than one-left-out: each measurement is a clean,
positive error owned by one item (leave-one-out would subtract two large,
noisy errors and can even come out negative), and independent quantization
errors add in error power, so the isolated errors predict the error of any
candidate config as a sum. The all-FP8 run calibrates that sum (a factor for
interactions); attention per (layer, step) is modelled as layer share x step
share.

Search: start from everything in FP8; repeatedly keep native the item with
the largest predicted error reduction per unit of FP8 work given up (the
report entries' FLOPs) until the predicted PSNR reaches the target; then
run that config, and if the measured PSNR misses the target, recalibrate the
prediction at that point and continue. The result is a ready-to-use FP8Config
(diffusion_kv_cache_skip_layers / _skip_steps, ignored_layers patterns like
`re:transformer_blocks\\.3\\..*`).

Step policy (`step_policy=True`, `fx-fp8 sensitivity --step-policy`): before the layer search,
candidate policies keep the first and last k steps in higher precision (attention native,
linears weight-only or native, or both; k from `step_edges`). Each is measured (same PSNR as
above) and its FP8 FLOPs kept are computed from the report; the policy that keeps the most
FP8 FLOPs while meeting the target is taken and written into the config
(diffusion_kv_cache_skip_steps, quantization_config.skip_steps and skip_steps_mode); the
layer search then starts from it. When no policy meets the target alone, none is taken: a
policy that gives up a whole step's FP8 on every layer and still misses would make the layer
search start from fewer FLOPs than it needs to give up (its per-step attention items are the
finer choice there).

This module runs the measurements (SwappableBackend, run_sensitivity); the parts are
sensitivity_items (items, measurements, the result, the config of a native set),
sensitivity_search (the error model and the greedy choice), sensitivity_steps (step
policies) and sensitivity_chart (the chart).
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional

import torch

from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.tools.image_metrics import psnr_db  # the one PSNR
from fx_fp8.tools.sensitivity_items import (
    Item,
    Measurement,
    SensitivityResult,
    config_for,
    items_from_reports,
    layer_lists,
    num_layers,
    only_config,
)
from fx_fp8.tools.sensitivity_search import ErrorModel, greedy
from fx_fp8.tools.sensitivity_steps import check_step_edges, measure_step_policies


# -- running configs without re-tracing ------------------------------------------------------
class SwappableBackend:
    """A Dynamo backend that traces each graph once and re-runs fx_fp8's passes per config.

    Each sensitivity measurement is a different FP8Config; recompiling through Dynamo for
    each would re-trace the model every time. Here Dynamo keeps its graphs and only the
    fx_fp8 backend (passes + downstream) runs again on the stored graph when the config
    changes. `config=None` runs the traced graph as is (native).
    """

    def __init__(self):
        self.slots: list[list] = []  # [gm, example_inputs, compiled callable]
        self.config: Optional[FP8Config] = None

    def __call__(self, gm, example_inputs, **_):
        slot = [gm, list(example_inputs), None]
        slot[2] = self._build(slot)
        self.slots.append(slot)
        return lambda *args: slot[2](*args)

    def _build(self, slot):
        from fx_fp8.compile.backend import fp8_backend

        gm, example_inputs, _ = slot
        return gm.forward if self.config is None else fp8_backend(gm, example_inputs, options={"config": self.config})

    def set_config(self, config: Optional[FP8Config]) -> None:
        self.config = config
        for slot in self.slots:
            slot[2] = self._build(slot)


# -- the search -----------------------------------------------------------------------------
def resolve_step_selectors(config: FP8Config, steps: int) -> FP8Config:
    """`config` with its step selectors made absolute for a run of `steps` steps: a base config
    written with "last:k" is searched (and its step items counted) on the steps it means."""
    attention, linears = config.diffusion_kv_cache_skip_steps, config.quantization_config.skip_steps
    if not attention.last and not linears.last:
        return config
    return config.replace(
        diffusion_kv_cache_skip_steps=str(attention.resolve(steps)),
        quantization_config={"skip_steps": str(linears.resolve(steps))},
    )


def run_sensitivity(
    run,
    base_config=None,
    *,
    steps: int = 8,
    target_psnr: float = 30.0,
    log: Optional[Callable[[str], None]] = None,
    verify: bool = True,
    yaml_path=None,
    step_policy: bool = False,
    step_edges=(1, 2),
) -> SensitivityResult:
    """Measure per-item sensitivity on `run` (a model_source.PipelineRun) and search the config.

    base_config: the starting config (what "all FP8" means); items already native there stay so.
    verify: re-measure the recommended config through fx_fp8.compile_pipeline from its YAML
      (`yaml_path`, written here) instead of the in-process swap, as a user would run it.
    step_policy: first choose a step policy (first/last k steps, k in `step_edges`, in higher
      precision), then search layers from it (see the module docstring).
    """
    t_start = time.perf_counter()
    base = resolve_step_selectors(FP8Config.load(base_config), steps)
    if not base.attention_enabled and not base.linear_enabled:
        raise ValueError("nothing to search: the config has both FP8 attention and FP8 linears off")
    if step_policy:
        edges = check_step_edges(step_edges, steps)
        given = {
            k: v
            for k, v in (
                ("diffusion_kv_cache_skip_steps", base.diffusion_kv_cache_skip_steps),
                ("quantization_config.skip_steps", base.quantization_config.skip_steps),
            )
            if v
        }
        if given:
            raise ValueError(
                f"the step-policy search starts from no step policy, but the base config has "
                f"{', '.join(f'{k}: {str(v)!r}' for k, v in given.items())}: remove it or search "
                f"without the step policy"
            )
    else:
        edges = ()
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    count = [0]

    def note(label: str, seconds: float, psnr: float, extra: str = "") -> None:
        count[0] += 1
        log(
            f"[{time.perf_counter() - t_start:7.1f}s] #{count[0]:<3d} {label:<44s} PSNR {psnr:6.2f} dB "
            f"({seconds:.1f}s){extra}"
        )

    def say(message: str) -> None:  # a decision, not a measurement: no run number
        log(f"[{time.perf_counter() - t_start:7.1f}s] {message}")

    note.say = say  # type: ignore[attr-defined]

    backend = SwappableBackend()
    originals = run.transformers()
    if not originals:
        raise ValueError(f"{type(run.pipe).__name__} has no transformer to quantize")
    torch._dynamo.reset()
    for name, module in originals:
        setattr(run.pipe, name, torch.compile(module, backend=backend))
    try:
        return _search(run, backend, base, steps, target_psnr, note, t_start, verify, yaml_path, originals, edges)
    finally:
        for name, module in originals:
            setattr(run.pipe, name, module)
        torch._dynamo.reset()


def _search(
    run, backend, base, steps, target, note, t_start, verify, yaml_path, originals, step_edges=()
) -> SensitivityResult:
    from fx_fp8.report import clear_reports, get_reports

    def measure(config, label, predicted=None, extra="") -> Measurement:
        t0 = time.perf_counter()
        clear_reports()
        backend.set_config(config)
        latents, _ = run.run(steps)
        mse = float(((latents - reference) ** 2).mean())
        m = Measurement(label, mse, psnr_db(mse, peak), time.perf_counter() - t0, predicted)
        note(label, m.seconds, m.psnr, extra + ("" if predicted is None else f"  (predicted {predicted:.2f} dB)"))
        return m

    # native reference (the first call also traces the graphs)
    t0 = time.perf_counter()
    backend.set_config(None)
    reference, _ = run.run(steps)
    peak = float(reference.max() - reference.min()) or 1.0
    note("native reference (traces the model)", time.perf_counter() - t0, float("inf"))

    all_fp8 = measure(base, "all FP8 (the base config)")
    reports = [r for r in get_reports() if r.step_variant in (None, "fp8")]
    if not reports:
        raise RuntimeError("the fp8 backend compiled no graph: is the transformer called by the pipeline?")
    unknown = sum(1 for r in reports for e in r.entries if e.action == "fp8" and e.flops is None)
    if unknown:
        note.say(f"{unknown} FP8 node(s) with symbolic sizes: each counts as 1 FLOP in the work model")
    lists = layer_lists(reports)
    policy, candidates, start = None, [], all_fp8
    if step_edges:
        policy, candidates = measure_step_policies(reports, base, steps, target, step_edges, all_fp8, measure, note)
        if policy is not None:
            base = base.replace(**policy.overrides())
            start = Measurement(f"step policy: {policy.label}", policy.mse, policy.psnr, policy.seconds)
    items = items_from_reports(reports, base, steps)
    if not items:
        raise ValueError("the base config quantizes nothing in this model: nothing to search")
    layers = max(r.layer_map and num_layers(r.layer_map) or 0 for r in reports)

    for it in items:
        m = measure(only_config(base, it, items, lists, steps), f"only {it.label} in FP8")
        it.mse, it.psnr, it.seconds = m.mse, m.psnr, m.seconds

    linear_off = list(base.quantization_config.skip_steps) if base.linear_step_skips else []
    model = ErrorModel(
        items, steps, attention_steps_off=list(base.diffusion_kv_cache_skip_steps), linear_steps_off=linear_off
    )
    raw_all = model.raw(set())
    model.gamma = start.mse / raw_all if raw_all > 0 else 1.0
    predict = lambda native: psnr_db(model.gamma * model.raw(native), peak)  # noqa: E731
    native: list[Item] = []
    history = [all_fp8]
    measured = start
    chosen = set()
    while measured.psnr < target:
        native += greedy(model, items, chosen, lambda c: psnr_db(model.gamma * model.raw(c), peak) >= target)
        config = config_for(base, chosen, items, lists)
        predicted = predict(chosen)
        measured = measure(config, f"candidate: {len(native)} item(s) native", predicted)
        history.append(measured)
        if measured.psnr >= target or not model.raw(chosen) > 0:
            break
        # the additive model was optimistic here: recalibrate at this point and keep going
        model.gamma = measured.mse / model.raw(chosen)

    config = config_for(base, chosen, items, lists)
    predicted_psnr = history[-1].predicted_psnr if history[-1].predicted_psnr is not None else start.psnr
    measured_psnr = measured.psnr
    if yaml_path is not None:
        config.to_yaml(yaml_path)
    if verify and yaml_path is not None:
        check = _verify(run, yaml_path, steps, reference, peak, originals, note)
        check.predicted_psnr = history[-1].predicted_psnr
        history.append(check)
        measured_psnr = check.psnr
    all_work = model.full_work()
    return SensitivityResult(
        target_psnr=target,
        peak=peak,
        steps=steps,
        num_layers=layers,
        items=items,
        all_fp8=all_fp8,
        recommended=config,
        native_items=[i.label for i in native],
        predicted_psnr=predicted_psnr,
        measured_psnr=measured_psnr,
        fp8_work_fraction=model.work(chosen) / all_work if all_work else 0.0,
        history=history,
        seconds=time.perf_counter() - t_start,
        step_policy=policy,
        step_candidates=candidates,
    )


def _verify(run, yaml_path, steps, reference, peak, originals, note) -> Measurement:
    """Run the written YAML the way a user would: compile_pipeline on the uncompiled pipeline."""
    from fx_fp8 import compile_pipeline, restore_pipeline

    for name, module in originals:
        setattr(run.pipe, name, module)
    torch._dynamo.reset()
    t0 = time.perf_counter()
    compile_pipeline(run.pipe, str(yaml_path), prepare=False)
    try:
        latents, _ = run.run(steps, publish=False)
    finally:
        restore_pipeline(run.pipe)
    mse = float(((latents - reference) ** 2).mean())
    m = Measurement("recommended config via compile_pipeline", mse, psnr_db(mse, peak), time.perf_counter() - t0)
    note(f"re-measure {yaml_path} (compile_pipeline)", m.seconds, m.psnr)
    return m
