"""The diffusers glue: FP8 for a whole pipeline, next to context parallelism and cache acceleration.

One concern a file:
  compile.py            compile_pipeline: prepare, compile and hook each denoising transformer (install a plan)
  plan.py               PipelinePlan: what compile_pipeline will do, every check run before any change
  restore.py            restore_pipeline: undo compile_pipeline
  state.py              PipelineFP8State (what compile_pipeline changed) and the record of the last run
  step_publishing.py    the denoising step published during a run (pipeline __call__ + scheduler.step)
  offload.py            diffusers' group offload and accelerate's offload next to preparing
  options.py            PipelineOptions: vLLM-Omni's parallel_config / cache_backend / cache_config, validated
  apply_options.py      the options applied to one transformer, in order, and undone
  launch.py             torchrun processes for context parallelism
  attention_backend.py  the diffusers attention backend each rank runs, chosen so FP8 can rewrite it
  context_parallel.py   diffusers' context parallelism (Ulysses, ring) on a prepared transformer
  cache_hooks.py        diffusers' cache hooks (first-block cache, TaylorSeer, MagCache) compiled as regions
  cache_dit.py          the cache-dit library's DBCache as a cache backend

The public entry points are fx_fp8.compile_pipeline, fx_fp8.restore_pipeline, fx_fp8.pipeline_state
and fx_fp8.publish_steps.
"""
