"""The sensitivity search's model and choice: an additive error model over the measured items
and the greedy choice of items to keep native (method in fx_fp8.tools.sensitivity)."""

from __future__ import annotations

from typing import Callable

from fx_fp8.tools.sensitivity_items import Item, item_key


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
        live_steps = sum(
            1 for s in range(self.steps) if ("attention_step", s) not in native and s not in self.attention_steps_off
        )
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
            if item_key(it) in chosen:
                continue
            trial = chosen | {item_key(it)}
            gain = now_raw - model.raw(trial)
            lost = now_work - model.work(trial)
            score = gain / (lost + 1e-12 * max(now_work, 1.0))
            if gain > 0 and score > best_score:
                best, best_score = it, score
        if best is None:
            break
        chosen.add(item_key(best))
        added.append(best)
    return added
