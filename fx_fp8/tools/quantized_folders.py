"""Folders whose transformer is already quantized, as `fx-fp8` and the examples open them.

Two kinds of transformer folder hold quantized weights:
* written by `save_pretrained` of a model loaded with fx_fp8.DiffusersConfig (or by another
  diffusers quantization backend): config.json carries `quantization_config`, and diffusers'
  from_pretrained loads it (fx_fp8 registers its backend on import);
* written by fx_fp8.save_quantized: `fx_fp8_quantization.json` and `fx_fp8_quantized.safetensors`
  beside config.json, deliberately not under diffusers' weight name: load_quantized loads it.
A pipeline folder (model_index.json) may hold either as its transformer/ (and transformer_2/):
load_pipeline_folder builds such transformers first and hands them to the pipeline's
from_pretrained. A transformer that is already quantized is compiled as it is
(compile_pipeline(prepare=False)); it has no full-precision weights to compare against.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

from fx_fp8.quant.checkpoint import FORMAT, QUANT_NAME, TRANSFORMER_ATTRS

SAVE_QUANTIZED = "save_quantized"


def _json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def folder_quantization(folder) -> str:
    """How the transformer folder stores quantized weights: "save_quantized" (fx_fp8.save_quantized),
    the quant_method of its config.json's quantization_config (e.g. "fx_fp8"), or "" (full precision)."""
    folder = os.fspath(folder)
    record = _json(os.path.join(folder, QUANT_NAME))
    if record is not None and record.get("format") == FORMAT and "layers" in record:
        return SAVE_QUANTIZED
    qc = (_json(os.path.join(folder, "config.json")) or {}).get("quantization_config")
    if isinstance(qc, dict):
        return str(qc.get("quant_method") or "unknown")
    return ""


def is_save_quantized_pipeline(folder) -> bool:
    """A folder fx_fp8.save_quantized wrote from a pipeline: its transformers only (an index naming them)."""
    record = _json(os.path.join(os.fspath(folder), QUANT_NAME))
    return record is not None and record.get("format") == FORMAT and "components" in record


def load_transformer_folder(folder, model_class, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The transformer in `folder`, in eval mode: load_quantized for a save_quantized folder,
    else model_class.from_pretrained (offline)."""
    folder = os.fspath(folder)
    if folder_quantization(folder) == SAVE_QUANTIZED:
        from fx_fp8.quant.checkpoint import load_quantized

        return load_quantized(folder, model_class, dtype=dtype)
    return model_class.from_pretrained(folder, torch_dtype=dtype, local_files_only=True).eval()


def saved_quantized_transformers(pipeline_folder, dtype: torch.dtype = torch.float32) -> dict:
    """{attr: transformer} of the pipeline's transformer folders that fx_fp8.save_quantized wrote,
    loaded (diffusers' from_pretrained cannot read them), to pass to the pipeline's from_pretrained."""
    from fx_fp8.quant.checkpoint import load_quantized

    out = {}
    for attr in TRANSFORMER_ATTRS:
        sub = os.path.join(os.fspath(pipeline_folder), attr)
        if os.path.isdir(sub) and folder_quantization(sub) == SAVE_QUANTIZED:
            out[attr] = load_quantized(sub, dtype=dtype)
    return out


def load_pipeline_folder(folder, dtype: torch.dtype = torch.float32, pipeline_class=None):
    """The pipeline in `folder` (offline), its save_quantized transformers loaded by load_quantized."""
    if pipeline_class is None:
        from diffusers import DiffusionPipeline as pipeline_class
    return pipeline_class.from_pretrained(
        os.fspath(folder), torch_dtype=dtype, local_files_only=True, **saved_quantized_transformers(folder, dtype)
    )


def prepared_transformers(pipe) -> list[str]:
    """The pipeline's transformer attributes that already hold quantized linears (loaded quantized,
    or prepared): compile them with compile_pipeline(prepare=False)."""
    from fx_fp8.quant.state_guard import quantized_layers

    return [
        a
        for a in TRANSFORMER_ATTRS
        if isinstance(getattr(pipe, a, None), torch.nn.Module) and quantized_layers(getattr(pipe, a))
    ]
