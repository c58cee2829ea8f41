"""The CUDA lowering's compile-time decisions for an sm90 GPU, taken on CPU tensors: the capability
reads (9, 0), every linear is one the lowering takes, and the graph it hands downstream is kept
(graph, example inputs) instead of compiled. Test files turn it into a fixture."""

from __future__ import annotations

from fx_fp8.compile import downstream
from fx_fp8.ops import cuda as cuda_mod


def cuda_on_cpu(monkeypatch) -> list:
    """Patch the CUDA lowering as above; returns the list the kept (graph, example inputs) go into."""
    monkeypatch.setattr(cuda_mod, "capability", lambda device=None: (9, 0))
    monkeypatch.setattr(cuda_mod.CudaLowering, "linear_reason", lambda self, x, w, q: None)
    monkeypatch.setattr(cuda_mod.CudaLowering, "weight_only", lambda self, w, q: None)
    kept = []

    def keep(name, gm, example_inputs, mode, inductor_options=None):
        kept.append((gm, list(example_inputs)))
        return gm.forward

    monkeypatch.setattr(downstream, "compile_downstream", keep)
    return kept
