"""Which linears the product quantizes, pinned as literal lists: the oracle of the tests that check
layer choices, so that a rule quantizing nothing (or everything) fails them instead of agreeing with
itself.

When a rule changes on purpose, regenerate the lists from the product and review the diff:

    PYTHONPATH=. python tests/helpers/expected_layers.py

* NATIVE_LINEARS[family]: the linears fx_fp8's backend keeps native (`sensitive: native`) in the
  zoo's tiny transformer of each family (tests/graph/test_sensitive_layers.py);
* RULES_PICK_FLUX[kind]: the kind of each linear the diffusers quantizer gives the one-layer bf16
  Flux with `ignored_layers: ["re:.*\\.to_v"]` (tests/pipeline/test_diffusers_quantizer.py).
"""

from __future__ import annotations

import pprint
import re
import sys
import tempfile
import warnings
from pathlib import Path

REGENERATE = "PYTHONPATH=. python tests/helpers/expected_layers.py"

# BEGIN GENERATED
NATIVE_LINEARS = {
    'flux': [
        'context_embedder',
        'norm_out.linear',
        'proj_out',
        'single_transformer_blocks.0.norm.linear',
        'single_transformer_blocks.1.norm.linear',
        'time_text_embed.text_embedder.linear_1',
        'time_text_embed.text_embedder.linear_2',
        'time_text_embed.timestep_embedder.linear_1',
        'time_text_embed.timestep_embedder.linear_2',
        'transformer_blocks.0.norm1.linear',
        'transformer_blocks.0.norm1_context.linear',
        'transformer_blocks.1.norm1.linear',
        'transformer_blocks.1.norm1_context.linear',
        'x_embedder',
    ],
    'qwen-image': [
        'img_in',
        'norm_out.linear',
        'proj_out',
        'time_text_embed.timestep_embedder.linear_1',
        'time_text_embed.timestep_embedder.linear_2',
        'transformer_blocks.0.img_mod.1',
        'transformer_blocks.0.txt_mod.1',
        'transformer_blocks.1.img_mod.1',
        'transformer_blocks.1.txt_mod.1',
        'txt_in',
    ],
    'sd3': [
        'context_embedder',
        'norm_out.linear',
        'proj_out',
        'time_text_embed.text_embedder.linear_1',
        'time_text_embed.text_embedder.linear_2',
        'time_text_embed.timestep_embedder.linear_1',
        'time_text_embed.timestep_embedder.linear_2',
        'transformer_blocks.0.norm1.linear',
        'transformer_blocks.0.norm1_context.linear',
        'transformer_blocks.1.norm1.linear',
        'transformer_blocks.1.norm1_context.linear',
    ],
    'wan': [
        'condition_embedder.text_embedder.linear_1',
        'condition_embedder.text_embedder.linear_2',
        'condition_embedder.time_embedder.linear_1',
        'condition_embedder.time_embedder.linear_2',
        'condition_embedder.time_proj',
        'proj_out',
    ],
    'z-image': [
        'all_final_layer.2-1.adaLN_modulation.1',
        'all_final_layer.2-1.linear',
        'all_x_embedder.2-1',
        'cap_embedder.1',
        'layers.0.adaLN_modulation.0',
        'layers.1.adaLN_modulation.0',
        'noise_refiner.0.adaLN_modulation.0',
        't_embedder.mlp.0',
        't_embedder.mlp.2',
    ],
}
RULES_PICK_FLUX = {
    'fp8': [
        'single_transformer_blocks.0.attn.to_k',
        'single_transformer_blocks.0.attn.to_q',
        'single_transformer_blocks.0.proj_mlp',
        'single_transformer_blocks.0.proj_out',
        'transformer_blocks.0.attn.add_k_proj',
        'transformer_blocks.0.attn.add_q_proj',
        'transformer_blocks.0.attn.add_v_proj',
        'transformer_blocks.0.attn.to_add_out',
        'transformer_blocks.0.attn.to_k',
        'transformer_blocks.0.attn.to_out.0',
        'transformer_blocks.0.attn.to_q',
        'transformer_blocks.0.ff.net.0.proj',
        'transformer_blocks.0.ff.net.2',
        'transformer_blocks.0.ff_context.net.0.proj',
        'transformer_blocks.0.ff_context.net.2',
    ],
    'native': ['single_transformer_blocks.0.attn.to_v', 'transformer_blocks.0.attn.to_v'],
    'weight_only': [
        'context_embedder',
        'norm_out.linear',
        'proj_out',
        'single_transformer_blocks.0.norm.linear',
        'time_text_embed.text_embedder.linear_1',
        'time_text_embed.text_embedder.linear_2',
        'time_text_embed.timestep_embedder.linear_1',
        'time_text_embed.timestep_embedder.linear_2',
        'transformer_blocks.0.norm1.linear',
        'transformer_blocks.0.norm1_context.linear',
        'x_embedder',
    ],
}
# END GENERATED


def differences(name: str, got, pinned) -> str:
    """'' when equal, else what differs and the command that regenerates the pinned lists."""
    got, pinned = set(got), set(pinned)
    if got == pinned:
        return ""
    return (
        f"{name}: not the pinned layers (tests/helpers/expected_layers.py); new: {sorted(got - pinned)}, "
        f"missing: {sorted(pinned - got)}. If a rule changed on purpose, regenerate: {REGENERATE}"
    )


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def native_linears(family: str) -> list[str]:
    """The product's decision: compile the family's tiny transformer, read the report's native linears."""
    import torch

    import fx_fp8
    from fx_fp8.tools.model_zoo.registry import build_tiny_transformer, example_inputs

    torch._dynamo.reset()
    model = _quiet(build_tiny_transformer, family)
    kw = example_inputs(family, model)
    with torch.no_grad():
        model(**kw)
        compiled = torch.compile(
            model, backend="fp8", options={"quantization": "fp8", "quantization_config": {"sensitive": "native"}}
        )
        compiled(**kw)
    return sorted(
        {e.module for r in fx_fp8.get_reports(compiled) for e in r.entries if e.op == "linear" and e.action == "native"}
    )


def rules_pick_flux() -> dict[str, list[str]]:
    """The product's decision: load the one-layer Flux through the diffusers quantizer, read its layers."""
    import torch
    import torch.nn as nn
    from diffusers import FluxTransformer2DModel

    import fx_fp8
    from fx_fp8.quant.quantized_linear import QuantizedLinear
    from fx_fp8.tools.model_zoo.registry import build_tiny_transformer

    model = _quiet(build_tiny_transformer, "flux", layers=1, dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        loaded = _quiet(
            FluxTransformer2DModel.from_pretrained,
            folder,
            torch_dtype=torch.bfloat16,
            quantization_config=fx_fp8.DiffusersConfig(ignored_layers=["re:.*\\.to_v"]),
        )
    kinds: dict[str, list[str]] = {"fp8": [], "weight_only": [], "native": []}
    for n, m in loaded.named_modules():
        if isinstance(m, QuantizedLinear):
            kinds["weight_only" if m.act_granularity == "weight_only" else "fp8"].append(n)
        elif type(m) is nn.Linear:
            kinds["native"].append(n)
    return {k: sorted(v) for k, v in kinds.items()}


def main() -> None:
    from fx_fp8.tools.model_zoo.registry import FAMILIES

    native = {f: native_linears(f) for f in FAMILIES}
    pick = rules_pick_flux()
    body = (
        f"NATIVE_LINEARS = {pprint.pformat(native, width=110, sort_dicts=True)}\n"
        f"RULES_PICK_FLUX = {pprint.pformat(pick, width=110, sort_dicts=True)}\n"
    )
    path = Path(__file__)
    text = path.read_text()
    text = re.sub(
        r"(# BEGIN GENERATED\n).*?(# END GENERATED\n)", lambda m: m.group(1) + body + m.group(2), text, flags=re.S
    )
    path.write_text(text)
    print(
        f"wrote {path}: {sum(map(len, native.values()))} native linears over {len(native)} families, "
        f"{ {k: len(v) for k, v in pick.items()} }",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
