"""compile_pipeline: FP8 for a whole diffusers pipeline.

    pipe = fx_fp8.compile_pipeline(pipe, "stage.yaml", diffusion_kv_cache_skip_steps="0,1")
    image = pipe(prompt_embeds=..., num_inference_steps=28).images[0]
    fx_fp8.restore_pipeline(pipe)          # the original weights need keep_weights=True (or prepare=False)

Every denoising transformer (`transformer`, and `transformer_2` of two-expert Wan2.2 pipelines) is
optionally prepared (`prepare_model`: FP8 weights, the originals freed) and replaced by
`torch.compile(t, backend="fp8", options={"config": cfg})`; the pipeline publishes its denoising
step (step_publishing.py) so `diffusion_kv_cache_skip_steps` works. A pipeline with no scheduler
`step` to hook is refused at compile time. Inside `callback_on_step_end(pipe, i, t, kwargs)`,
`fx_fp8.current_step()` is already i + 1 (the step about to run). A `quantization` map of
components (fx_fp8/config/components.py) also prepares and compiles the text encoders it names.

compile_pipeline is plan_pipeline (plan.py: the config read once, every check that can fail, nothing
changed) then install (here: only changes), so a refused call leaves the pipeline as it was.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Optional

import torch

from fx_fp8.passes.attention_remedies import LINEARS_ONLY_ATTR
from fx_fp8.pipeline.apply_options import apply_pipeline_options, compile_regions, has_diffusers_hooks
from fx_fp8.pipeline.offload import check_weights_readable, reapply_group_offload
from fx_fp8.pipeline.plan import PipelinePlan, plan_pipeline
from fx_fp8.pipeline.state import STATE_ATTR, PipelineFP8State
from fx_fp8.pipeline.step_publishing import call_recorder, install_scheduler_hook, outside_run, wrapped_class
from fx_fp8.quant.prepare import prepare_model


def compile_pipeline(
    pipe,
    config=None,
    *,
    backend: str = "fp8",
    prepare: bool = True,
    keep_weights: bool = False,
    regional: bool = False,
    mode: Optional[str] = None,
    compile_kwargs: Optional[Mapping[str, Any]] = None,
    inductor_options: Optional[Mapping[str, Any]] = None,
    parallel_config=None,
    cache_backend=None,
    cache_config=None,
    **overrides,
):
    """Compile the denoising transformer(s) of a diffusers pipeline with an FP8 backend, in place.

    config: an FP8Config, a mapping, a YAML path (flat or vLLM-Omni stage config) or None
      (both FP8 attention and FP8 linears); `overrides` are config keys applied on top. It
      applies to the denoising transformers; a `quantization` mapping of components
      ({"transformer": "fp8", "text_encoder": {"method": "int8"}, "text_encoder_2": None},
      vLLM-Omni's component map, fx_fp8/config/components.py) scopes the linears by component:
      the other components named (text encoders, ...) get their linears quantized (prepared and
      compiled with the same backend, attention native).
    backend: "fp8" (lowering from the tensors' device) or "fp8_npu".
    prepare: fx_fp8.prepare_model each transformer on its first call, with that call's inputs
      (so the sensitive layers are found by the graph's structure, as the backend finds them;
      by name, up front, where the model carries diffusers hooks or gets a cache or context
      parallelism from compile_pipeline: tracing it would move the hooks' state), so the quantized weights
      replace the original ones in memory. This is destructive: the original weights are
      freed, so restore_pipeline(pipe) refuses (ValueError) and restore_pipeline(pipe,
      linears="quantized") keeps the QuantizedLinear modules, unless keep_weights=True, which
      keeps the original nn.Linear modules on the CPU to put back (the original weights stay
      in host memory). A transformer already prepared by prepare_model is refused: pass
      prepare=False to compile it as it is.
    regional: compile each transformer block by block, as diffusers' compile_repeated_blocks does
      (one compile per block class instead of the whole model: the cold start drops several-fold,
      see README "Compile time"); the transformers stay the pipeline's own modules.
    mode: torch.compile's mode ("default", "reduce-overhead", "max-autotune", ...: Inductor downstream);
      the same as compile_kwargs={"mode": ...}. It travels in the backend options (torch.compile refuses
      mode= together with options=).
    compile_kwargs: extra torch.compile arguments (mode, dynamic, fullgraph, ...).
    inductor_options: Inductor config patches for every compiled graph (e.g. {"cpp_wrapper": True}),
      on top of the mode's; the backend option of the same name (Inductor downstream).
    parallel_config / cache_backend / cache_config: vLLM-Omni's context-parallel degrees
      ({ulysses_degree, ring_degree}) and cache backend (first_block_cache, taylorseer, mag_cache)
      with its JSON-like config, mapped onto diffusers by fx_fp8.pipeline.options; they override the same
      keys of a config YAML / mapping. Under torchrun with ulysses_degree x ring_degree processes.
    Returns `pipe`; fx_fp8.pipeline_state(pipe).calls records each transformer
    call of the last run (step, transformer, step variant).
    """
    plan = plan_pipeline(
        pipe,
        config,
        backend=backend,
        prepare=prepare,
        keep_weights=keep_weights,
        regional=regional,
        mode=mode,
        compile_kwargs=compile_kwargs,
        inductor_options=inductor_options,
        parallel_config=parallel_config,
        cache_backend=cache_backend,
        cache_config=cache_config,
        **overrides,
    )
    install(pipe, plan)
    return pipe


def install(pipe, plan: PipelinePlan) -> None:
    """Carry out a plan (plan.py has checked it): compile the components a component map names,
    then each transformer (prepared on its first call, or now), hook the scheduler and swap the
    compiled modules in."""
    popts, compile_kwargs, backend = plan.pipeline_options, dict(plan.compile_kwargs), plan.backend
    prepare, keep_weights, loaded = plan.prepare, plan.keep_weights, plan.loaded
    state = PipelineFP8State(
        config=plan.config,
        backend=backend,
        originals=dict(plan.transformers),
        compiled={},
        prepared={},
        kept_linears={},
        base_class=type(pipe),
    )
    shared_options = dict(plan.backend_options)
    _compile_others(state, plan.others, backend, shared_options, compile_kwargs, prepare, keep_weights)
    for attr, module in plan.transformers.items():
        cfg = plan.configs[attr]
        options = {**shared_options, "config": loaded[attr] if attr in loaded else cfg}
        if plan.regional:
            module.compile_repeated_blocks(backend=backend, options=options, **compile_kwargs)
            compiled = module
        else:
            compiled = torch.compile(module, backend=backend, options=options, **compile_kwargs)

        def setup(example_inputs, attr=attr, module=module, options=options, cfg=cfg):
            """prepare, then cache hooks, then context parallelism, then regions (apply_options.py):
            preparing after the parallel hooks would drop diffusers' gather hook on proj_out."""
            if attr in state.extras:
                return  # already set up
            state.pending_setup.pop(attr, None)
            if prepare and attr not in loaded:
                check_weights_readable(module, attr)
                linears = dict(module.named_modules()) if keep_weights else {}
                with outside_run():  # its trace runs the model's hooks: not a call of the run
                    state.prepared[attr] = prepare_model(module, cfg, example_inputs=example_inputs)
                if keep_weights:
                    state.kept_linears[attr] = {n: linears[n].to("cpu") for n in state.prepared[attr]["quantized"]}
                if state.prepared[attr]["quantized"]:
                    reapply_group_offload(module)
            state.extras[attr] = apply_pipeline_options(module, popts)
            compile_regions(state.extras[attr], module, backend, options, compile_kwargs)

        if (
            prepare
            and attr not in loaded
            and cfg.linear_enabled
            and not has_diffusers_hooks(module)
            and not popts.enabled
        ):
            # on the first call: prepare_model traces the model on that call's inputs, so it finds the
            # sensitive layers by structure as the backend does (by name otherwise)
            state.pending_setup[attr] = setup
            state.hook_handles.append(compiled.register_forward_pre_hook(_once(setup), with_kwargs=True))
        else:
            setup(None)
        state.hook_handles.append(compiled.register_forward_pre_hook(call_recorder(state, attr)))
        state.compiled[attr] = compiled
    install_scheduler_hook(state, plan.scheduler)
    object.__setattr__(pipe, STATE_ATTR, state)
    for attr, compiled in state.compiled.items():
        setattr(pipe, attr, compiled)
    pipe.__class__ = wrapped_class(state.base_class)


def _compile_others(
    state: PipelineFP8State,
    others: Mapping,
    backend: str,
    options: dict,
    compile_kwargs: dict,
    prepare: bool,
    keep_weights: bool,
) -> None:
    """Text encoders and the other components a component map names: prepared by name (they run
    once per prompt, outside the denoising loop), then compiled with the pipeline's backend."""
    for name, (module, cfg) in others.items():
        state.originals[name] = module
        if prepare and cfg.linear_enabled:
            linears = dict(module.named_modules()) if keep_weights else {}
            state.prepared[name] = prepare_model(module, cfg)
            if keep_weights:
                state.kept_linears[name] = {n: linears[n].to("cpu") for n in state.prepared[name]["quantized"]}
        # its attention stays native by design: the report says so, not which key would change it
        setattr(module, LINEARS_ONLY_ATTR, True)
        state.compiled[name] = torch.compile(
            module, backend=backend, options={**options, "config": cfg}, **compile_kwargs
        )


def _once(setup):
    """A forward pre-hook that runs setup((args, kwargs)) before the first call (setup itself
    returns at once when it has run).

    No lock is held while setup runs user code: prepare_model traces the model, which runs its
    forward pre-hooks again (with regional=True this hook sits on the model itself). That nested
    call, in the thread running setup, passes through; a call from another thread waits until
    setup has ended (and runs it itself if setup raised)."""
    ready = threading.Condition()
    running: list = []  # the thread running setup, while it runs
    done = [False]

    @torch.compiler.disable  # bookkeeping, never traced (prepare_model's trace runs the model's hooks)
    def hook(compiled, args, kwargs):
        if done[0]:
            return None
        me = threading.get_ident()
        with ready:  # held only to read and set `running`
            if running and running[0] == me:
                return None  # setup's own trace of the model
            while running:
                ready.wait()
            if done[0]:
                return None
            running.append(me)
        try:
            setup((args, kwargs))
            done[0] = True
        finally:
            with ready:
                running.clear()
                ready.notify_all()
        return None

    return hook
