"""What the sensitivity search measures and decides about: items, measurements, the result,
the items read from the compile reports, and the FP8Config of a set of items kept native.

An item is what goes into FP8 or stays native as one unit: the attention of one layer (all
steps), the attention of one denoising step (all layers), the FP8 linears of one block, or the
FP8 linears outside the blocks (see fx_fp8.tools.sensitivity for the method).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Optional

from fx_fp8.config.fp8_config import FP8Config

if TYPE_CHECKING:
    from fx_fp8.tools.sensitivity_steps import StepPolicy

ITEM_KINDS = ("attention_layer", "attention_step", "linears_block", "linears_other")


@dataclass
class Item:
    kind: str  # one of ITEM_KINDS
    index: Optional[int]  # layer or step index (None for linears_other)
    label: str
    mse: float = float("nan")  # error of the final latents with only this item in FP8
    psnr: float = float("nan")
    work: float = 0.0  # FP8 FLOPs per step this item covers (attention_step: all layers)
    seconds: float = 0.0


@dataclass
class Measurement:
    label: str
    mse: float
    psnr: float
    seconds: float
    predicted_psnr: Optional[float] = None


@dataclass
class SensitivityResult:
    target_psnr: float
    peak: float  # value range of the native latents (PSNR peak)
    steps: int
    num_layers: int
    items: list[Item]
    all_fp8: Measurement
    recommended: FP8Config
    native_items: list[str]  # labels of the items kept native, in the order chosen
    predicted_psnr: float
    measured_psnr: float
    fp8_work_fraction: float  # FP8 FLOPs kept by the recommendation / all-FP8
    history: list[Measurement] = field(default_factory=list)
    seconds: float = 0.0
    step_policy: Optional[StepPolicy] = None  # the policy the layer search started from
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


def item_key(item: Item) -> tuple:
    """(kind, index): how an item is named in a set of items kept native."""
    return (item.kind, item.index)


# -- items from the compile reports ----------------------------------------------------------
def num_layers(layer_map: dict) -> int:
    return max(int(r.split("-")[-1]) for r in layer_map.values()) + 1 if layer_map else 0


def layer_lists(reports) -> dict[int, tuple[str, int]]:
    """layer index -> (block list name, index within the list), from the reports' layer maps."""
    out = {}
    for r in reports:
        for name, rng in r.layer_map.items():
            lo, hi = (int(x) for x in rng.split("-"))
            for layer in range(lo, hi + 1):
                out[layer] = (name, layer - lo)
    return out


def items_from_reports(reports, base: FP8Config, steps: int) -> list[Item]:
    """The items of the nodes the reports put in FP8, each with the FP8 FLOPs it covers."""
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
        items += [
            Item("attention_step", s, f"attention step {s}", work=total)
            for s in range(steps)
            if s not in base.diffusion_kv_cache_skip_steps
        ]
    items += [Item("linears_block", l, f"linears block {l}", work=w) for l, w in sorted(lin_work.items())]
    if other["names"]:
        it = Item("linears_other", None, "linears outside blocks", work=other["work"])
        it.modules = sorted(other["names"])  # type: ignore[attr-defined]
        items.append(it)
    return items


# -- the config of a set of items kept native --------------------------------------------------
def block_pattern(list_name: str, local: int) -> str:
    """ignored_layers pattern for every linear of one block: `re:transformer_blocks\\.3\\..*`."""
    return f"re:{re.escape(list_name)}\\.{local}\\..*"


def config_for(base: FP8Config, native: set, items: list[Item], lists) -> FP8Config:
    """`base` with the items keyed in `native` kept native (lists: layer_lists of the reports)."""
    skip_layers = set(base.diffusion_kv_cache_skip_layers) | {i for k, i in native if k == "attention_layer"}
    skip_steps = set(base.diffusion_kv_cache_skip_steps) | {i for k, i in native if k == "attention_step"}
    patterns: list[str] = []
    for kind, index in sorted(native, key=lambda k: (k[0], -1 if k[1] is None else k[1])):
        if kind == "linears_block":
            patterns.append(block_pattern(*lists[index]))
        elif kind == "linears_other":
            other = next(i for i in items if i.kind == "linears_other")
            patterns += [f"re:{re.escape(n)}" for n in other.modules]  # type: ignore[attr-defined]
    overrides = dict(
        diffusion_kv_cache_skip_layers=sorted(skip_layers), diffusion_kv_cache_skip_steps=sorted(skip_steps)
    )
    if patterns:
        overrides["ignored_layers"] = list(base.quantization_config.ignored_layers) + patterns
    return base.replace(**overrides)


def only_config(base: FP8Config, item: Item, items: list[Item], lists, steps: int) -> FP8Config:
    """`base` with every item but `item` native (the other feature switched off)."""
    # the other items of the same axis go native: a layer keeps all its steps, a step all its layers
    same_axis = ("linears_block", "linears_other") if item.kind.startswith("linears") else (item.kind,)
    others = {item_key(i) for i in items if item_key(i) != item_key(item) and i.kind in same_axis}
    cfg = config_for(base, others, items, lists)
    if item.kind.startswith("attention"):  # a linear step policy goes with the linears
        return cfg.replace(quantization=None, quantization_config={"skip_steps": ""})
    return cfg.replace(diffusion_kv_cache_dtype=None, diffusion_kv_cache_skip_steps=[])
