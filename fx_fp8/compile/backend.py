"""The Dynamo backends `fp8` and `fp8_npu`: torch.compile's options -> FP8Config, the lowering and
the downstream compiler; the graph's plan (fx_fp8/compile/graph_plan.py) does the rest.

Registered through the `torch_dynamo_backends` entry point, so
`torch.compile(model, backend="fp8")` works without importing fx_fp8 first.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import torch.fx

from fx_fp8.compile.downstream import check_inductor_options, choose_downstream
from fx_fp8.compile.graph_plan import Settings, compile_graph_plan
from fx_fp8.compile.stored_config import settle, stored_config, with_checkpoint_step_policy
from fx_fp8.config.fp8_config import FP8Config
from fx_fp8.config.values import check_bool, short_repr
from fx_fp8.graph.names import resolve_graph
from fx_fp8.ops.lowering import npu_available, resolve_lowering_name
from fx_fp8.report import ModelRecord

#: torch.compile options that configure the backend rather than the FP8 config: `config` (a base
#: config), `dump_graphs` (the graphs before and after each pass, in the report), `mode` (Inductor's),
#: `inductor_options` (Inductor config patches for every graph fx_fp8 hands to Inductor), `check_reuse` (debugging: an instance that reuses another's decisions also runs the passes, and
#: any difference raises; default from the environment variable CHECK_REUSE_ENV, for compiles made
#: where options cannot be passed, e.g. inside compile_pipeline)
BACKEND_OPTION_KEYS = ("config", "dump_graphs", "mode", "inductor_options", "check_reuse")
CHECK_REUSE_ENV = "FX_FP8_CHECK_REUSE"
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def config_from_options(options: Optional[dict], stored: Optional[FP8Config] = None) -> tuple[FP8Config, dict]:
    """Split torch.compile options into an FP8Config and backend-only settings. `stored`: the config
    the model was quantized with at load (stored_config.py): the options then start from it, and one
    that contradicts it is an error naming both values."""
    options = dict(options or {})
    backend_opts = {k: options.pop(k) for k in BACKEND_OPTION_KEYS if k in options}
    base = backend_opts.pop("config", None)
    if backend_opts.get("mode") not in MODES:
        raise ValueError(
            f"invalid mode {short_repr(backend_opts['mode'])}: expected one of {', '.join(map(str, MODES[1:]))}"
        )
    if "inductor_options" in backend_opts:
        backend_opts["inductor_options"] = check_inductor_options(backend_opts["inductor_options"])
    if "check_reuse" in backend_opts:
        backend_opts["check_reuse"] = check_bool("check_reuse", backend_opts["check_reuse"])
    if stored is not None:
        return settle(stored, base, **options), backend_opts
    if base is None:
        return FP8Config.from_kwargs(**options), backend_opts
    return FP8Config.load(base, **options), backend_opts


#: what CHECK_REUSE_ENV may say: the option's booleans as a config file spells them, 1 / 0; unset or empty is off
ENV_BOOLEANS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def check_reuse_env() -> bool:
    """The check_reuse option's default, from CHECK_REUSE_ENV; any other value is refused, naming it."""
    value = os.environ.get(CHECK_REUSE_ENV, "")
    if not value.strip():
        return False
    if value.strip().lower() not in ENV_BOOLEANS:
        raise ValueError(f"invalid {CHECK_REUSE_ENV}={value!r}: expected true or false (or 1 / 0)")
    return ENV_BOOLEANS[value.strip().lower()]


def _graph_device(example_inputs) -> Optional[torch.device]:
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            return t.device
    return None


def choose_lowering(backend: str, config: FP8Config, device, warn: Callable[[str], None]) -> str:
    if config.lowering == "cuda" and (device is None or device.type != "cuda"):
        # its kernels take CUDA tensors only: every node would stay native, each row saying why
        warn(
            f"fx_fp8: lowering 'cuda' was asked for but the graph's tensors are on "
            f"{device.type if device is not None else 'no device'!r} (CUDA available: {torch.cuda.is_available()}): "
            "every attention and linear stays native; use lowering 'auto' or 'reference' here"
        )
    if config.lowering != "auto":
        return config.lowering
    if backend == "fp8_npu":
        if npu_available() or (device is not None and device.type in ("npu", "privateuseone")):
            return "npu"
        warn(
            "fx_fp8: backend 'fp8_npu' found no Ascend NPU (torch_npu not importable or no device); "
            "falling back to the CPU reference lowering ('reference')"
        )
        return "reference"
    return resolve_lowering_name("auto", device)


def compile_graph(
    gm: torch.fx.GraphModule,
    example_inputs,
    *,
    backend: str,
    options: Optional[dict] = None,
    mode: Optional[str] = None,
    model=None,
    owner=None,
) -> Callable:
    """The whole backend for one Dynamo graph; `model`/`owner` default to what the Python stack
    shows (see fx_fp8.graph.dynamo_internals.find_compiled_model). Returns the callable Dynamo runs."""
    model, owner = resolve_graph(gm, example_inputs, model=model, owner=owner)
    stored = stored_config(owner) or stored_config(model)
    config, backend_opts = config_from_options(options, stored=stored)
    if stored is None:  # a checkpoint of another method may carry a step policy (fx_fp8's own is in `stored`)
        config = with_checkpoint_step_policy(config, owner if owner is not None else model)
    mode = mode or backend_opts.get("mode")
    lowering = choose_lowering(backend, config, _graph_device(example_inputs), ModelRecord.of(owner).warn)
    inductor_options = backend_opts.get("inductor_options", {})
    settings = Settings(
        backend=backend,
        config=config,
        lowering=lowering,
        downstream=choose_downstream(config, lowering, mode, inductor_options),
        mode=mode,
        inductor_options=inductor_options,
        dump_graphs=bool(backend_opts.get("dump_graphs")),
        check_reuse=backend_opts["check_reuse"] if "check_reuse" in backend_opts else check_reuse_env(),
    )
    return compile_graph_plan(gm, example_inputs, settings, model=model, owner=owner)


def fp8_backend(gm: torch.fx.GraphModule, example_inputs, options: Optional[dict] = None, mode: Optional[str] = None):
    """`torch.compile(model, backend="fp8", options={...})`: lowering from the tensors' device."""
    return compile_graph(gm, example_inputs, backend="fp8", options=options, mode=mode)


def fp8_npu_backend(
    gm: torch.fx.GraphModule, example_inputs, options: Optional[dict] = None, mode: Optional[str] = None
):
    """`torch.compile(model, backend="fp8_npu", options={...})`: the Ascend lowering
    (CPU reference, with a warning, where no NPU is present)."""
    return compile_graph(gm, example_inputs, backend="fp8_npu", options=options, mode=mode)
