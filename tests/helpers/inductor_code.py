"""The fused CPU kernels Inductor writes for toy_models.ModulatedBlock compiled by fx_fp8."""

from __future__ import annotations

import re

import torch
from torch._inductor.utils import run_and_get_code

import fx_fp8
from toy_models import ModulatedBlock


def kernels(options):
    """(names of the cpp_fused_* kernels, the report, the compiled outputs, the eager outputs)."""
    m, x, t = ModulatedBlock().eval(), torch.randn(1, 256, 128), torch.randn(1, 128)
    torch._dynamo.reset()
    compiled = torch.compile(
        m, backend="fp8", options={"diffusion_kv_cache_dtype": None, "downstream": "inductor", **options}
    )
    with torch.no_grad():
        out, codes = run_and_get_code(compiled, x, t)
    names = sorted(set(re.findall(r"cpp_fused_\w+", "\n".join(codes))))
    return names, fx_fp8.get_reports(compiled)[0], out, m(x, t)
