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
"""
from __future__ import annotations

import math
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

from fx_fp8.config import FP8Config
from fx_fp8.tools.image_metrics import psnr_db  # the one PSNR

ITEM_KINDS = ("attention_layer", "attention_step", "linears_block", "linears_other")


@dataclass
class Item:
    kind: str                  # one of ITEM_KINDS
    index: Optional[int]       # layer or step index (None for linears_other)
    label: str
    mse: float = float("nan")  # error of the final latents with only this item in FP8
    psnr: float = float("nan")
    work: float = 0.0          # FP8 FLOPs per step this item covers (attention_step: all layers)
    seconds: float = 0.0


@dataclass
class Measurement:
    label: str
    mse: float
    psnr: float
    seconds: float
    predicted_psnr: Optional[float] = None


@dataclass
class StepPolicy:
    """One candidate step policy: the steps whose attention runs native and whose linears run
    `linear_mode` (weight_only: FP8 weights, high-precision activations; native)."""
    label: str
    attention_steps: list[int]
    linear_steps: list[int]
    linear_mode: str                      # "weight_only" | "native" ("" when no linear step is skipped)
    fp8_work_fraction: float              # FP8 FLOPs it keeps / all-FP8 (from the report's FLOPs)
    mse: float = float("nan")
    psnr: float = float("nan")
    seconds: float = 0.0

    def overrides(self) -> dict:
        """FP8Config.replace keys of this policy."""
        out: dict = {"diffusion_kv_cache_skip_steps": list(self.attention_steps)}
        if self.linear_steps:
            out["quantization_skip_steps"] = ",".join(map(str, self.linear_steps))
            out["quantization_skip_steps_mode"] = self.linear_mode
        return out


@dataclass
class SensitivityResult:
    target_psnr: float
    peak: float                           # value range of the native latents (PSNR peak)
    steps: int
    num_layers: int
    items: list[Item]
    all_fp8: Measurement
    recommended: FP8Config
    native_items: list[str]               # labels of the items kept native, in the order chosen
    predicted_psnr: float
    measured_psnr: float
    fp8_work_fraction: float              # FP8 FLOPs kept by the recommendation / all-FP8
    history: list[Measurement] = field(default_factory=list)
    seconds: float = 0.0
    step_policy: Optional[StepPolicy] = None               # the policy the layer search started from
    step_candidates: list[StepPolicy] = field(default_factory=list)  # every policy measured

    def ranking(self) -> list[Item]:
        return sorted(self.items, key=lambda it: -it.mse)

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("recommended", "items", "history", "all_fp8")}
        d["recommended"] = self.recommended.to_dict()
        d["all_fp8"] = asdict(self.all_fp8)
        d["items"] = [asdict(i) for i in self.ranking()]
        d["history"] = [asdict(h) for h in self.history]
        return _finite(d)


def _finite(obj):
    """JSON has no inf/nan: write them as strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


# -- running configs without re-tracing ------------------------------------------------------
class SwappableBackend:
    """A Dynamo backend that traces each graph once and re-runs fx_fp8's passes per config.

    Each sensitivity measurement is a different FP8Config; recompiling through Dynamo for
    each would re-trace the model every time. Here Dynamo keeps its graphs and only the
    fx_fp8 backend (passes + downstream) runs again on the stored graph when the config
    changes. `config=None` runs the traced graph as is (native).
    """

    def __init__(self):
        self.slots: list[list] = []   # [gm, example_inputs, compiled callable]
        self.config: Optional[FP8Config] = None

    def __call__(self, gm, example_inputs, **_):
        slot = [gm, list(example_inputs), None]
        slot[2] = self._build(slot)
        self.slots.append(slot)
        return lambda *args: slot[2](*args)

    def _build(self, slot):
        from fx_fp8.backend import fp8_backend

        gm, example_inputs, _ = slot
        return gm.forward if self.config is None else fp8_backend(gm, example_inputs, options={"config": self.config})

    def set_config(self, config: Optional[FP8Config]) -> None:
        self.config = config
        for slot in self.slots:
            slot[2] = self._build(slot)


class ErrorModel:
    """Additive error model: predicted MSE of a set of native items."""

    def __init__(self, items: list[Item], steps: int, *, attention_steps_off=(), linear_steps_off=()):
        """attention_steps_off / linear_steps_off: steps a step policy already runs without FP8
        attention / W8A8 linears (they keep no FP8 FLOPs)."""
        self.attention_steps_off = set(attention_steps_off)
        self.linear_steps_off = set(linear_steps_off)
        self.att = {i.index: i for i in items if i.kind == "attention_layer"}
        self.step = {i.index: i for i in items if i.kind == "attention_step"}
        self.lin = {i.index: i for i in items if i.kind == "linears_block"}
        self.other = [i for i in items if i.kind == "linears_other"]
        a, b = sum(i.mse for i in self.att.values()), sum(i.mse for i in self.step.values())
        # attention of (layer, step) ~ layer error x step share, normalised by both totals' mean
        self.norm = (a + b) / 2 if a + b > 0 else 1.0
        self.steps = steps
        self.gamma = 1.0

    def raw(self, native: set) -> float:
        live_steps = [s for s in self.step if ("attention_step", s) not in native]
        total = 0.0
        for layer, it in self.att.items():
            if ("attention_layer", layer) in native:
                continue
            if self.step:
                total += it.mse * sum(self.step[s].mse for s in live_steps) / self.norm
            else:
                total += it.mse
        total += sum(it.mse for i, it in self.lin.items() if ("linears_block", i) not in native)
        total += sum(it.mse for it in self.other if ("linears_other", None) not in native)
        return total

    def work(self, native: set) -> float:
        """FP8 FLOPs over the whole run that stay FP8."""
        live_steps = sum(1 for s in range(self.steps)
                         if ("attention_step", s) not in native and s not in self.attention_steps_off)
        lin_steps = self.steps - len(self.linear_steps_off & set(range(self.steps)))
        total = sum(it.work * live_steps for l, it in self.att.items() if ("attention_layer", l) not in native)
        total += sum(it.work * lin_steps for i, it in self.lin.items() if ("linears_block", i) not in native)
        total += sum(it.work * lin_steps for it in self.other if ("linears_other", None) not in native)
        return total

    def full_work(self) -> float:
        """FP8 FLOPs of the run with every item in FP8 on every step (no step policy)."""
        per_step = sum(it.work for it in self.att.values()) + sum(it.work for it in self.lin.values())
        return (per_step + sum(it.work for it in self.other)) * self.steps


def greedy(model: ErrorModel, items: list[Item], chosen: set, done: Callable[[set], bool]) -> list[Item]:
    """Add items to `chosen` (kept native, in place) until done(chosen): each time the item with
    the largest predicted error reduction per FP8 FLOP given up. Returns the items added."""
    added = []
    while not done(chosen):
        best, best_score = None, 0.0
        now_raw, now_work = model.raw(chosen), model.work(chosen)
        for it in items:
            if _key(it) in chosen:
                continue
            trial = chosen | {_key(it)}
            gain = now_raw - model.raw(trial)
            lost = now_work - model.work(trial)
            score = gain / (lost + 1e-12 * max(now_work, 1.0))
            if gain > 0 and score > best_score:
                best, best_score = it, score
        if best is None:
            break
        chosen.add(_key(best))
        added.append(best)
    return added


def _key(item: Item) -> tuple:
    return (item.kind, item.index)


# -- the search -----------------------------------------------------------------------------
def run_sensitivity(run, base_config=None, *, steps: int = 8, target_psnr: float = 30.0,
                    log: Optional[Callable[[str], None]] = None, verify: bool = True,
                    yaml_path=None, step_policy: bool = False, step_edges=(1, 2)) -> SensitivityResult:
    """Measure per-item sensitivity on `run` (a model_source.PipelineRun) and search the config.

    base_config: the starting config (what "all FP8" means); items already native there stay so.
    verify: re-measure the recommended config through fx_fp8.compile_pipeline from its YAML
      (`yaml_path`, written here) instead of the in-process swap, as a user would run it.
    step_policy: first choose a step policy (first/last k steps, k in `step_edges`, in higher
      precision), then search layers from it (see the module docstring).
    """
    t_start = time.perf_counter()
    base = FP8Config.load(base_config)
    if not base.attention_enabled and not base.linear_enabled:
        raise ValueError("nothing to search: the config has both FP8 attention and FP8 linears off")
    if step_policy:
        edges = _check_step_edges(step_edges, steps)
        given = {k: v for k, v in (("diffusion_kv_cache_skip_steps", base.diffusion_kv_cache_skip_steps),
                                   ("quantization_config.skip_steps", base.quantization_config.skip_steps)) if list(v)}
        if given:
            raise ValueError(f"the step-policy search starts from no step policy, but the base config has "
                             f"{', '.join(f'{k}: {str(v)!r}' for k, v in given.items())}: remove it or search "
                             f"without the step policy")
    else:
        edges = ()
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    count = [0]

    def note(label: str, seconds: float, psnr: float, extra: str = "") -> None:
        count[0] += 1
        log(f"[{time.perf_counter() - t_start:7.1f}s] #{count[0]:<3d} {label:<44s} PSNR {psnr:6.2f} dB "
            f"({seconds:.1f}s){extra}")

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


def _search(run, backend, base, steps, target, note, t_start, verify, yaml_path, originals,
            step_edges=()) -> SensitivityResult:
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
    layer_lists = _layer_lists(reports)
    policy, candidates, start = None, [], all_fp8
    if step_edges:
        policy, candidates = _step_policy(reports, base, steps, target, step_edges, all_fp8, measure, note)
        if policy is not None:
            base = base.replace(**policy.overrides())
            start = Measurement(f"step policy: {policy.label}", policy.mse, policy.psnr, policy.seconds)
    items = _items(reports, base, steps)
    if not items:
        raise ValueError("the base config quantizes nothing in this model: nothing to search")
    num_layers = max(r.layer_map and _num_layers(r.layer_map) or 0 for r in reports)

    for it in items:
        m = measure(_only(base, it, items, layer_lists, steps), f"only {it.label} in FP8")
        it.mse, it.psnr, it.seconds = m.mse, m.psnr, m.seconds

    linear_off = list(base.quantization_config.skip_steps) if base.linear_step_skips else []
    model = ErrorModel(items, steps, attention_steps_off=list(base.diffusion_kv_cache_skip_steps),
                       linear_steps_off=linear_off)
    raw_all = model.raw(set())
    model.gamma = start.mse / raw_all if raw_all > 0 else 1.0
    predict = lambda native: psnr_db(model.gamma * model.raw(native), peak)  # noqa: E731
    native: list[Item] = []
    history = [all_fp8]
    measured = start
    chosen = set()
    while measured.psnr < target:
        native += greedy(model, items, chosen, lambda c: psnr_db(model.gamma * model.raw(c), peak) >= target)
        config = _config(base, chosen, items, layer_lists)
        predicted = predict(chosen)
        measured = measure(config, f"candidate: {len(native)} item(s) native", predicted)
        history.append(measured)
        if measured.psnr >= target or not model.raw(chosen) > 0:
            break
        # the additive model was optimistic here: recalibrate at this point and keep going
        model.gamma = measured.mse / model.raw(chosen)

    config = _config(base, chosen, items, layer_lists)
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
        target_psnr=target, peak=peak, steps=steps, num_layers=num_layers, items=items, all_fp8=all_fp8,
        recommended=config, native_items=[i.label for i in native], predicted_psnr=predicted_psnr,
        measured_psnr=measured_psnr, fp8_work_fraction=model.work(chosen) / all_work if all_work else 0.0,
        history=history, seconds=time.perf_counter() - t_start, step_policy=policy, step_candidates=candidates)


# -- step policy ------------------------------------------------------------------------------
def _check_step_edges(step_edges, steps: int) -> list[int]:
    """The k values (first and last k steps) that leave at least one step in FP8."""
    edges = []
    for k in step_edges:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"step_edges: each k must be an integer >= 1, got {k!r}")
        edges.append(k)
    usable = sorted({k for k in edges if 2 * k < steps})
    if not usable:
        raise ValueError(f"step_edges {list(step_edges)}: with {steps} steps the first and last k steps leave "
                         f"no FP8 step for any k given (k must be < {steps / 2:g})")
    return usable


def edge_steps(k: int, steps: int) -> list[int]:
    """The first and last k of `steps` denoising steps."""
    return sorted(set(range(k)) | set(range(steps - k, steps)))


def step_policy_candidates(base: FP8Config, steps: int, step_edges, attention_per_step: float,
                           linear_per_step: float) -> list[StepPolicy]:
    """Policies over the first/last k steps for the features `base` has on: attention native,
    linears weight-only, linears native, and attention native with either linear mode.
    *_per_step: FP8 FLOPs per step of the FP8 attention / W8A8 linears (from the report)."""
    full = (attention_per_step + linear_per_step) * steps
    out = []
    for k in _check_step_edges(step_edges, steps):
        sel = edge_steps(k, steps)
        text = ",".join(map(str, sel)) if len(sel) <= 2 else f"0-{k - 1},{steps - k}-{steps - 1}"
        shapes = []
        if base.attention_enabled and attention_per_step > 0:
            shapes.append((f"attention native on steps {text}", sel, [], ""))
        if base.linear_enabled and linear_per_step > 0:
            for mode in ("weight_only", "native"):
                shapes.append((f"linears {mode.replace('_', '-')} on steps {text}", [], sel, mode))
                if base.attention_enabled and attention_per_step > 0:
                    shapes.append((f"attention native + linears {mode.replace('_', '-')} on steps {text}", sel, sel,
                                   mode))
        for label, att, lin, mode in shapes:
            kept = attention_per_step * (steps - len(att)) + linear_per_step * (steps - len(lin))
            out.append(StepPolicy(label, att, lin, mode, kept / full if full else 0.0))
    return out


def choose_step_policy(candidates: list[StepPolicy], target: float) -> Optional[StepPolicy]:
    """The measured policy that keeps the most FP8 FLOPs while meeting `target` (ties: the higher
    PSNR); None when none meets it."""
    meeting = [c for c in candidates if c.psnr >= target]
    return max(meeting, key=lambda c: (c.fp8_work_fraction, c.psnr)) if meeting else None


def _step_policy(reports, base, steps, target, step_edges, all_fp8, measure, note):
    attention = sum(e.flops or 0.0 for r in reports for e in r.entries if e.op == "attention" and e.action == "fp8")
    linear = sum(e.flops or 0.0 for r in reports for e in r.entries if e.op == "linear" and e.action in ("fp8", "int8"))
    candidates = step_policy_candidates(base, steps, step_edges, attention, linear)
    if all_fp8.psnr >= target:
        note.say("step policy: all FP8 already meets the target, no step policy needed")
        return None, candidates
    for c in candidates:
        m = measure(base.replace(**c.overrides()), f"step policy: {c.label}",
                    extra=f"  (keeps {100 * c.fp8_work_fraction:.0f}% of FP8 FLOPs)")
        c.mse, c.psnr, c.seconds = m.mse, m.psnr, m.seconds
    chosen = choose_step_policy(candidates, target)
    if chosen is None:
        best = max(candidates, key=lambda c: c.psnr)
        note.say(f"step policy: none meets the {target:g} dB target alone (best: {best.label}, {best.psnr:.2f} dB); "
                 f"the layer search starts from all FP8 without one")
    else:
        note.say(f"step policy chosen: {chosen.label}, PSNR {chosen.psnr:.2f} dB, keeps "
                 f"{100 * chosen.fp8_work_fraction:.0f}% of FP8 FLOPs (meets the target)")
    return chosen, candidates


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


def _num_layers(layer_map: dict) -> int:
    return max(int(r.split("-")[-1]) for r in layer_map.values()) + 1 if layer_map else 0


def _layer_lists(reports) -> dict[int, tuple[str, int]]:
    """layer index -> (block list name, index within the list), from the reports' layer maps."""
    out = {}
    for r in reports:
        for name, rng in r.layer_map.items():
            lo, hi = (int(x) for x in rng.split("-"))
            for layer in range(lo, hi + 1):
                out[layer] = (name, layer - lo)
    return out


def _items(reports, base: FP8Config, steps: int) -> list[Item]:
    att_work: dict[int, float] = {}
    lin_work: dict[int, float] = {}
    other = {"work": 0.0, "names": set()}
    for r in reports:
        for e in r.entries:
            if e.action != "fp8":
                continue
            f = e.flops if e.flops is not None else 1.0  # symbolic sizes: count the node, not its size
            if e.op == "attention" and e.layer is not None:
                att_work[e.layer] = att_work.get(e.layer, 0.0) + f
            elif e.op == "linear" and e.layer is not None:
                lin_work[e.layer] = lin_work.get(e.layer, 0.0) + f
            elif e.op == "linear":
                other["work"] += f
                other["names"].add(e.module)
    items = [Item("attention_layer", l, f"attention layer {l}", work=w) for l, w in sorted(att_work.items())]
    if att_work:
        total = sum(att_work.values())
        items += [Item("attention_step", s, f"attention step {s}", work=total)
                  for s in range(steps) if s not in base.diffusion_kv_cache_skip_steps]
    items += [Item("linears_block", l, f"linears block {l}", work=w) for l, w in sorted(lin_work.items())]
    if other["names"]:
        it = Item("linears_other", None, "linears outside blocks", work=other["work"])
        it.modules = sorted(other["names"])  # type: ignore[attr-defined]
        items.append(it)
    return items


def block_pattern(list_name: str, local: int) -> str:
    """ignored_layers pattern for every linear of one block: `re:transformer_blocks\\.3\\..*`."""
    return f"re:{re.escape(list_name)}\\.{local}\\..*"


def _config(base: FP8Config, native: set, items: list[Item], layer_lists) -> FP8Config:
    skip_layers = set(base.diffusion_kv_cache_skip_layers) | {i for k, i in native if k == "attention_layer"}
    skip_steps = set(base.diffusion_kv_cache_skip_steps) | {i for k, i in native if k == "attention_step"}
    patterns: list[str] = []
    for kind, index in sorted(native, key=lambda k: (k[0], -1 if k[1] is None else k[1])):
        if kind == "linears_block":
            patterns.append(block_pattern(*layer_lists[index]))
        elif kind == "linears_other":
            other = next(i for i in items if i.kind == "linears_other")
            patterns += [f"re:{re.escape(n)}" for n in other.modules]  # type: ignore[attr-defined]
    overrides = dict(diffusion_kv_cache_skip_layers=sorted(skip_layers), diffusion_kv_cache_skip_steps=sorted(skip_steps))
    if patterns:
        overrides["ignored_layers"] = list(base.quantization_config.ignored_layers) + patterns
    return base.replace(**overrides)


def _only(base: FP8Config, item: Item, items: list[Item], layer_lists, steps: int) -> FP8Config:
    """`base` with every item but `item` native (the other feature switched off)."""
    # the other items of the same axis go native: a layer keeps all its steps, a step all its layers
    same_axis = ("linears_block", "linears_other") if item.kind.startswith("linears") else (item.kind,)
    others = {_key(i) for i in items if _key(i) != _key(item) and i.kind in same_axis}
    cfg = _config(base, others, items, layer_lists)
    if item.kind.startswith("attention"):  # a linear step policy goes with the linears
        return cfg.replace(quantization=None, quantization_config={"skip_steps": ""})
    return cfg.replace(diffusion_kv_cache_dtype=None, diffusion_kv_cache_skip_steps=[])


# -- chart ------------------------------------------------------------------------------------
def save_chart(result: SensitivityResult, path, title: str = "") -> None:
    """Per-block (attention, linears) and per-step sensitivity: PSNR with only that item in FP8
    (lower = more sensitive); items the recommendation keeps native are hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    native = set(result.native_items)
    by_kind = {k: [i for i in result.items if i.kind == k] for k in ITEM_KINDS}
    layers = sorted({i.index for k in ("attention_layer", "linears_block") for i in by_kind[k]})
    steps_ = by_kind["attention_step"]
    fig, axes = plt.subplots(1, 2 if steps_ else 1, figsize=(11 if steps_ else 7, 4),
                             gridspec_kw={"width_ratios": [max(len(layers), 1), max(len(steps_), 1) * 0.7]} if steps_ else None)
    axes = list(axes) if steps_ else [axes]
    finite = [i.psnr for i in result.items if math.isfinite(i.psnr)]
    top = (max(finite) if finite else 60.0) + 5

    def bar(ax, x, it, color, width):
        v = it.psnr if math.isfinite(it.psnr) else top
        ax.bar(x, v, width, color=color, hatch="//" if it.label in native else None, edgecolor="black", linewidth=0.5)

    w = 0.4
    for kind, dx, color, name in (("attention_layer", -w / 2, "tab:blue", "attention"),
                                  ("linears_block", w / 2, "tab:orange", "linears")):
        for it in by_kind[kind]:
            bar(axes[0], layers.index(it.index) + dx, it, color, w)
    from matplotlib.patches import Patch

    handles = [Patch(color="tab:blue", label="attention"), Patch(color="tab:orange", label="linears"),
               Patch(facecolor="white", edgecolor="black", hatch="//", label="kept native")]
    axes[0].set_xticks(range(len(layers)), [str(l) for l in layers])
    axes[0].set_xlabel("layer / block")
    axes[0].set_ylabel("PSNR with only this in FP8 (dB)\nlower = more sensitive")
    axes[0].legend(handles=handles, fontsize=8, loc="lower right")
    if steps_:
        for j, it in enumerate(steps_):
            bar(axes[1], j, it, "tab:green", 0.7)
        axes[1].set_xticks(range(len(steps_)), [str(i.index) for i in steps_])
        axes[1].set_xlabel("denoising step (attention, all layers)")
    for ax in axes:
        ax.axhline(result.target_psnr, color="red", linestyle="--", linewidth=1)
        ax.set_ylim(0, top)
    fig.suptitle(title or f"FP8 sensitivity: all-FP8 {result.all_fp8.psnr:.1f} dB -> recommended "
                          f"{result.measured_psnr:.1f} dB (target {result.target_psnr:g} dB, red), "
                          f"{100 * result.fp8_work_fraction:.0f}% of FP8 FLOPs kept", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
