"""fx_fp8 as a diffusers quantization backend: how `import fx_fp8` registers it, without importing diffusers.

diffusers (0.42) finds the quantizer of `Model.from_pretrained(..., quantization_config=cfg)`, and
of a folder whose config.json carries a `quantization_config`, by the config's `quant_method` in
two dicts of `diffusers.quantizers.auto`:
* AUTO_QUANTIZER_MAPPING: name -> DiffusersQuantizer subclass (read by DiffusersAutoQuantizer.from_config);
* AUTO_QUANTIZATION_CONFIG_MAPPING: name -> config class (read by DiffusersAutoQuantizer.from_dict, and
  by PipelineQuantizationConfig to accept a `quant_mapping` entry).
fx_fp8 adds METHOD ("fx_fp8") to both (fx_fp8.pipeline.diffusers_quantizer's DiffusersQuantizer and
DiffusersConfig). `import fx_fp8` registers at once when diffusers' quantizers are already
imported; otherwise a finder on sys.meta_path waits for that one module and registers right after
it runs, then removes itself. So importing fx_fp8 never imports diffusers, and works without it.

The `quant_method` of fx_fp8's config is a str enum member whose value is METHOD: diffusers
reads `quant_method.value` and compares `quant_method` with strings; its own closed
QuantizationMethod enum is not extended.

A diffusers whose mapping differs from what is described above (another layout, a name already
taken by another backend) is refused: nothing is registered, a warning says what was expected and
what was found, and fx_fp8.DiffusersConfig(...) raises DiffusersLayoutError with the same text.
"""

from __future__ import annotations

import sys
import warnings
from typing import Optional

from fx_fp8.after_import import call_after_import

#: the quant_method name fx_fp8 registers
METHOD = "fx_fp8"
#: the diffusers module holding the mappings
AUTO_MODULE = "diffusers.quantizers.auto"
#: the module defining what is registered
QUANTIZER_MODULE = "fx_fp8.pipeline.diffusers_quantizer"
#: the mappings (name -> what a name maps to)
MAPPINGS = {"AUTO_QUANTIZER_MAPPING": "quantizer class", "AUTO_QUANTIZATION_CONFIG_MAPPING": "config class"}
#: DiffusersQuantizer methods from_pretrained calls, which fx_fp8's quantizer implements
QUANTIZER_HOOKS = (
    "validate_environment",
    "update_torch_dtype",
    "preprocess_model",
    "postprocess_model",
    "check_if_quantized_param",
    "create_quantized_param",
    "maybe_update_loaded_keys",
    "get_state_dict_and_metadata",
    "_process_model_before_weight_loading",
    "_process_model_after_weight_loading",
)

#: how registration went: None (not tried yet), True, or the refusal's message
_STATE: dict = {"result": None}


class DiffusersLayoutError(RuntimeError):
    """The installed diffusers does not register quantizers the way fx_fp8 expects."""


def layout_problems(auto) -> list[str]:
    """What differs between `auto` (diffusers.quantizers.auto) and the layout fx_fp8 registers
    into: each problem says what was expected and what was found. [] when it matches."""
    problems = []
    for name, what in MAPPINGS.items():
        found = getattr(auto, name, None)
        if not isinstance(found, dict):
            problems.append(
                f"{AUTO_MODULE}.{name}: expected a dict (quant_method name -> {what}), found "
                f"{type(found).__name__ if found is not None else 'nothing'}"
            )
    readers = getattr(auto, "DiffusersAutoQuantizer", None)
    for method in ("from_config", "from_dict"):
        fn = getattr(getattr(readers, method, None), "__func__", None)
        if fn is None or getattr(fn, "__globals__", None) is not vars(auto):
            problems.append(
                f"{AUTO_MODULE}.DiffusersAutoQuantizer.{method}: expected a classmethod of that module "
                "(reading its mappings), found "
                + ("nothing" if fn is None else f"one defined in {getattr(fn, '__module__', '?')}")
            )
    base = sys.modules.get("diffusers.quantizers.base")
    quantizer = getattr(base, "DiffusersQuantizer", None)
    if not isinstance(quantizer, type):
        problems.append(
            "diffusers.quantizers.base.DiffusersQuantizer: expected the quantizer base class, found nothing"
        )
    else:
        missing = [h for h in QUANTIZER_HOOKS if not callable(getattr(quantizer, h, None))]
        if missing:
            problems.append(
                f"diffusers.quantizers.base.DiffusersQuantizer: expected the methods {list(QUANTIZER_HOOKS)}, "
                f"found none named {missing}"
            )
    mixin = getattr(sys.modules.get("diffusers.quantizers.quantization_config"), "QuantizationConfigMixin", None)
    if not isinstance(mixin, type):
        problems.append(
            "diffusers.quantizers.quantization_config.QuantizationConfigMixin: expected the config base "
            "class, found nothing"
        )
    for name in MAPPINGS:
        taken = getattr(auto, name, {}).get(METHOD) if isinstance(getattr(auto, name, None), dict) else None
        if taken is not None and getattr(taken, "__module__", "") != QUANTIZER_MODULE:
            problems.append(
                f"{AUTO_MODULE}.{name}[{METHOD!r}]: expected free (or fx_fp8's), found "
                f"{getattr(taken, '__module__', '?')}.{getattr(taken, '__qualname__', taken)!r}"
            )
    return problems


def _diffusers_version() -> str:
    return getattr(sys.modules.get("diffusers"), "__version__", "(unknown version)")


def register(auto=None) -> None:
    """Add fx_fp8 to diffusers' quantizer mappings (`auto`: the imported diffusers.quantizers.auto).
    Raises DiffusersLayoutError, registering nothing, when the layout differs."""
    auto = sys.modules[AUTO_MODULE] if auto is None else auto
    problems = layout_problems(auto)
    if problems:
        raise DiffusersLayoutError(
            f"fx_fp8 cannot register its diffusers quantization backend with diffusers {_diffusers_version()} "
            f"(written for diffusers 0.42's layout):\n  " + "\n  ".join(problems)
        )
    quantizer = sys.modules.get(QUANTIZER_MODULE)
    if quantizer is not None and not hasattr(quantizer, "FxFp8Quantizer"):
        # diffusers' quantizers are being imported by the quantizer module itself, which has not defined
        # its classes yet: it registers when it has (register_pending, at its end)
        raise _QuantizerLoading()
    from fx_fp8.pipeline.diffusers_quantizer import DiffusersConfig, FxFp8Quantizer

    auto.AUTO_QUANTIZER_MAPPING[METHOD] = FxFp8Quantizer
    auto.AUTO_QUANTIZATION_CONFIG_MAPPING[METHOD] = DiffusersConfig


class _QuantizerLoading(Exception):
    """register() ran while the quantizer module was half loaded."""


def register_pending() -> None:
    """The quantizer module's last line: register now if diffusers' quantizers were imported while it
    loaded (the import hook then had no classes to register)."""
    if _STATE["result"] is None and AUTO_MODULE in sys.modules:
        _register_or_warn(sys.modules[AUTO_MODULE])


def _register_or_warn(auto=None) -> None:
    try:
        register(auto)
    except _QuantizerLoading:
        return
    except DiffusersLayoutError as e:
        _STATE["result"] = str(e)
        warnings.warn(
            f"{e}\n(fx_fp8's FP8 backend works; only loading with fx_fp8.DiffusersConfig is unavailable)", stacklevel=3
        )
        return
    _STATE["result"] = True


def ensure_registered() -> None:
    """Register now if not yet done (importing diffusers' quantizers); raise DiffusersLayoutError
    if this diffusers was refused."""
    if _STATE["result"] is None:
        import importlib

        importlib.import_module(AUTO_MODULE)  # runs the finder below, or is already imported
        if _STATE["result"] is None:
            _register_or_warn()
    if _STATE["result"] is not True:
        raise DiffusersLayoutError(_STATE["result"])


def install() -> Optional[bool]:
    """Called by `import fx_fp8`: register now when diffusers' quantizers are imported, else when
    they are (never importing diffusers). Returns True when registered now, None when waiting."""
    if AUTO_MODULE in sys.modules:
        if _STATE["result"] is None:
            _register_or_warn(sys.modules[AUTO_MODULE])
        return _STATE["result"] is True
    call_after_import([AUTO_MODULE], _register_or_warn)
    return None
