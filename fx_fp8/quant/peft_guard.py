"""LoRA (and PEFT's other adapters: LoHa, LoKr, IA3, ...) on a prepared model: an fx_fp8 error that
names the way that works, before PEFT changes anything.

PEFT adds an adapter by replacing each targeted linear with a wrapper around it
(BaseTuner.inject_adapter). A prepared model's linears are fx_fp8 QuantizedLinear, holding FP8/INT8
codes and no full-precision weight, so PEFT failed half way with its own "Target module
QuantizedLinear(...) is not supported". fx_fp8 wraps BaseTuner.inject_adapter once PEFT is imported
(a finder on sys.meta_path waits for that module; importing fx_fp8 never imports PEFT): a model
without QuantizedLinear goes through untouched; one whose QuantizedLinear layers the adapter targets
raises PreparedModelAdapterError and is left as it was.
"""

from __future__ import annotations

import functools

from fx_fp8.after_import import call_after_import

#: the PEFT module defining BaseTuner.inject_adapter
TUNER_MODULE = "peft.tuners.tuners_utils"

WHAT_WORKS = (
    "load the adapter before fx_fp8.prepare_model / compile_pipeline (it then quantizes the fused or "
    "wrapped linears), or compile without preparing (compile_pipeline(pipe, prepare=False), or plain "
    "torch.compile(backend=\"fp8\")), which keeps the full-precision weights LoRA needs; "
    "fx_fp8.restore_pipeline(pipe) undoes a prepare"
)


class PreparedModelAdapterError(ValueError):
    """A PEFT adapter targets linears that fx_fp8.prepare_model replaced by quantized ones."""


def targeted_quantized_layers(tuner, model, adapter_name: str) -> list[str]:
    """Names of the model's QuantizedLinear layers that `adapter_name`'s config targets."""
    from fx_fp8.quant.quantized_linear import QuantizedLinear

    quantized = [name for name, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    if not quantized:
        return []
    from peft.tuners.tuners_utils import check_target_module_exists

    config = tuner.peft_config[adapter_name]
    return [name for name in quantized if check_target_module_exists(config, name)]


def _guard(inject_adapter):
    @functools.wraps(inject_adapter)
    def guarded(self, model, adapter_name, *args, **kwargs):
        hits = targeted_quantized_layers(self, model, adapter_name)
        if hits:
            more = f" and {len(hits) - 3} more" if len(hits) > 3 else ""
            raise PreparedModelAdapterError(
                f"PEFT adapter {adapter_name!r} targets {len(hits)} linear(s) that fx_fp8.prepare_model replaced by "
                f"QuantizedLinear ({', '.join(hits[:3])}{more}): they hold FP8/INT8 codes, not the full-precision weights an adapter "
                f"wraps. {WHAT_WORKS[0].upper()}{WHAT_WORKS[1:]}"
            )
        return inject_adapter(self, model, adapter_name, *args, **kwargs)

    guarded._fx_fp8_guard = True
    return guarded


def guard(tuners_utils) -> None:
    """Wrap BaseTuner.inject_adapter of the imported `tuners_utils` (once)."""
    base = getattr(tuners_utils, "BaseTuner", None)
    inject = getattr(base, "inject_adapter", None)
    if inject is None or getattr(inject, "_fx_fp8_guard", False):
        return
    base.inject_adapter = _guard(inject)


def install() -> None:
    """Called by `import fx_fp8`: guard PEFT now if it is imported, else as soon as it is."""
    call_after_import([TUNER_MODULE], guard)
