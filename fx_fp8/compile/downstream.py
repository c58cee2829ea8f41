"""The compiler a rewritten graph goes to: its choice and the call (eager, Inductor, npugraph_ex)."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.fx

from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.graph.dynamo_internals import generate_code_now
from fx_fp8.ops.lowering import npu_available


def choose_downstream(config: FP8Config, lowering: str, mode: Optional[str]) -> str:
    if config.downstream != "auto":
        return config.downstream
    if mode:
        return "inductor"
    if lowering == "npu" and npu_available():
        return "npugraph_ex"
    if lowering == "cuda":
        return "inductor"
    return "eager"


def compile_downstream(name: str, gm: torch.fx.GraphModule, example_inputs, mode: Optional[str]) -> Callable:
    if name == "eager":
        generate_code_now(gm)  # now, not on every call
        return gm.forward
    if name == "inductor":
        from torch._inductor.compile_fx import compile_fx

        patches = torch._inductor.list_mode_options(mode) if mode else {}
        return compile_fx(gm, example_inputs, config_patches=patches)
    if name == "npugraph_ex":
        try:
            backend = torch._dynamo.lookup_backend("npugraph_ex")
        except Exception as e:
            from fx_fp8.install_hint import install_hint

            raise RuntimeError(f"downstream 'npugraph_ex' needs torch_npu ({install_hint('npu')}): {e}") from None
        return backend(gm, example_inputs)
    raise ValueError(f"unknown downstream compiler {name!r}")
