"""Inductor's FX graph cache and AOTAutograd's cache take fx_fp8's graphs: a warm restart with
FP8 on hits both, and torch.compiler.save_cache_artifacts() / load_cache_artifacts() carry them
to another process. AOTAutograd refuses (bypasses) a graph with a method call on a node that
has no `example_value`; the passes give every node they insert one."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._functorch._aot_autograd.autograd_cache import check_node_safe

from fx_fp8.config.fp8_config import FP8Config

import toy_models
from graph_capture import compile_stored, graph_module_of, traced


def test_every_inserted_node_has_an_example_value_and_is_cache_safe():
    _, gm, inputs, _, _ = traced("flux")
    fn, report = compile_stored(gm, inputs, FP8Config.from_kwargs())  # FP8 attention + FP8 linears
    graph = graph_module_of(fn).graph
    assert report.count("linear", "fp8") > 0 and report.count("attention", "fp8") > 0
    calls = [n for n in graph.nodes if n.op in ("call_function", "call_method")]
    assert calls  # not vacuous: all() of nothing is True
    assert all("example_value" in n.meta for n in calls), [n.name for n in calls if "example_value" not in n.meta]
    for node in calls:
        check_node_safe(node)  # raises BypassAOTAutogradCache on what the cache cannot key


WORKER = textwrap.dedent("""
    import json, sys, warnings
    import torch
    from torch._dynamo.utils import counters
    import fx_fp8
    from toy_models import toy, toy_inputs
    warnings.simplefilter("ignore")
    artifacts = sys.argv[1]
    if sys.argv[2] == "load":
        with open(artifacts, "rb") as f:
            torch.compiler.load_cache_artifacts(f.read())
    model, kw = toy(), toy_inputs()  # a small DiT: FP8 attention and linears, quick to compile
    compiled = torch.compile(model, backend="fp8", options={"downstream": "inductor",
                                                            "diffusion_kv_cache_skip_steps": "0"})
    with torch.no_grad():
        for step in (0, 1):
            with fx_fp8.denoising_step(step):
                compiled(**kw)
    if sys.argv[2] == "save":
        with open(artifacts, "wb") as f:
            f.write(torch.compiler.save_cache_artifacts()[0])
    print(json.dumps({**{k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph")},
                      **{k: v for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache")}}))
""")


def _run(tmp_path, cache: str, action: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / cache), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", WORKER, str(tmp_path / "artifacts.bin"), action],
        env=env,
        capture_output=True,
        text=True,
        cwd=os.path.dirname(toy_models.__file__),
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_warm_restart_and_cache_artifacts_hit_with_fp8_on(tmp_path):
    cold = _run(tmp_path, "cache", "save")
    assert cold.get("fxgraph_cache_miss") == 2 and not cold.get("fxgraph_cache_bypass")
    assert cold.get("autograd_cache_miss") == 2 and not cold.get("autograd_cache_bypass")
    warm = _run(tmp_path, "cache", "none")  # same cache directory, new process
    assert warm.get("fxgraph_cache_hit") == 2 and warm.get("autograd_cache_hit") == 2, warm
    moved = _run(tmp_path, "empty", "load")  # another machine: only the saved artifacts
    assert moved.get("autograd_cache_hit") == 2, moved
