"""The sensitivity chart (`fx-fp8 sensitivity` writes it as sensitivity.png): PSNR with one item
in FP8, per block and per step. Needs matplotlib (the `cli` extra)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from fx_fp8.tools.sensitivity_items import ITEM_KINDS

if TYPE_CHECKING:
    from fx_fp8.tools.sensitivity_items import SensitivityResult


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
    fig, axes = plt.subplots(
        1,
        2 if steps_ else 1,
        figsize=(11 if steps_ else 7, 4),
        gridspec_kw={"width_ratios": [max(len(layers), 1), max(len(steps_), 1) * 0.7]} if steps_ else None,
    )
    axes = list(axes) if steps_ else [axes]
    finite = [i.psnr for i in result.items if math.isfinite(i.psnr)]
    top = (max(finite) if finite else 60.0) + 5

    def bar(ax, x, it, color, width):
        v = it.psnr if math.isfinite(it.psnr) else top
        ax.bar(x, v, width, color=color, hatch="//" if it.label in native else None, edgecolor="black", linewidth=0.5)

    w = 0.4
    for kind, dx, color, name in (
        ("attention_layer", -w / 2, "tab:blue", "attention"),
        ("linears_block", w / 2, "tab:orange", "linears"),
    ):
        for it in by_kind[kind]:
            bar(axes[0], layers.index(it.index) + dx, it, color, w)
    from matplotlib.patches import Patch

    handles = [
        Patch(color="tab:blue", label="attention"),
        Patch(color="tab:orange", label="linears"),
        Patch(facecolor="white", edgecolor="black", hatch="//", label="kept native"),
    ]
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
    fig.suptitle(
        title
        or f"FP8 sensitivity: all-FP8 {result.all_fp8.psnr:.1f} dB -> recommended "
        f"{result.measured_psnr:.1f} dB (target {result.target_psnr:g} dB, red), "
        f"{100 * result.fp8_work_fraction:.0f}% of FP8 FLOPs kept",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
