"""What several test files read off outputs and reports: relative errors, the structural reasons of
the sensitive-layer analysis, a report's linear rows, and which linears are big enough to quantize."""

from __future__ import annotations

import torch.nn as nn

TC, MOD, FIN = "timestep conditioning", "adaLN modulation", "final projection"
STRUCTURAL = (TC, MOD, FIN)


def rel_err(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def structural(entry) -> str | None:
    """The structural reason an entry was kept native for, or None."""
    for why in STRUCTURAL:
        if entry.action == "native" and entry.reason.startswith(f"{why}; kept native"):
            return why
    return None


def big_enough(lin: nn.Linear) -> bool:
    return lin.in_features % 16 == 0 and lin.out_features % 16 == 0 and min(lin.in_features, lin.out_features) >= 32


def decisions(report):
    """{module: entry} of one report's linear rows."""
    return {e.module: e for e in report.entries if e.op == "linear"}


def linear_rows(reports):
    """{module: entry} of the linear rows of several reports (one per compiled block)."""
    return {e.module: e for r in reports for e in r.entries if e.op == "linear"}


def check_layer_one_native(transformer, self_attention) -> list:
    """The report's rows of a compiled transformer: each of the self-attention modules named has a
    row whose name resolved, layer 1 kept native by diffusion_kv_cache_skip_layers, the others FP8."""
    import fx_fp8

    rows = [e for r in fx_fp8.get_reports(transformer) for e in r.entries]
    attn = {e.module: e for e in rows if e.op == "attention" and e.module in self_attention}
    assert set(attn) == set(self_attention)
    for module, e in attn.items():
        assert e.name_resolved
        if e.layer == 1:
            assert e.action == "native" and "diffusion_kv_cache_skip_layers" in e.reason
        else:
            assert e.action == "fp8", (module, e.reason)
    return rows
