"""Quantized checkpoints: save a prepared model as it is, load it back without re-quantizing.

    fx_fp8.prepare_model(transformer, config)            # or compile_pipeline + one call
    fx_fp8.save_quantized(transformer, "out/")           # a model: the folder itself
    fx_fp8.save_quantized(pipe, "out/")                  # a pipeline: out/transformer[, out/transformer_2]
    transformer = fx_fp8.load_quantized("out/")          # rebuilt from config.json, bit-identical outputs
    fx_fp8.load_quantized("out/", pipe=pipe)             # put the saved transformer(s) into a pipeline
    fx_fp8.load_quantized("out/", model=module)          # into an existing model of the same structure

A folder holds, per model, diffusers' `config.json` (diffusers models), every tensor of the
prepared model in `fx_fp8_quantized.safetensors` (the FP8/INT8 weights under `weight`, their
fp32 `weight_scale`, `input_scale` / `input_smoothing`, and all other parameters and buffers
unchanged) and `fx_fp8_quantization.json` (the recipe of each quantized linear and the
native ones, and a digest of every tensor's bytes and of config.json's content: safetensors
has no checksum, so a file damaged in place would otherwise load and compute NaN, and a
config.json of another save would build a model that computes something else; load_quantized
checks them unless verify=False). The files are written whole beside the folder's, then
replace them, config.json last. Every load error names the file it comes from. The weights file deliberately does not bear diffusers' name
(`diffusion_pytorch_model.safetensors`): `from_pretrained` of such a folder fails loudly
("no file named diffusion_pytorch_model...") instead of reading FP8 codes as weights.

Prepared models are guarded (`guard`, called by prepare_model; fx_fp8/quant/state_guard.py):
`save_pretrained` raises and names save_quantized; `load_state_dict` checks every quantized
layer's incoming entries before anything is copied, and QuantizedLinear re-quantizes
full-precision weights with its own recipe (fx_fp8/quant/quantized_linear.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from typing import Optional

import torch
import torch.nn as nn

from fx_fp8.graph.dynamo_internals import is_compiled_module, unwrap_compiled
from fx_fp8.ops.formats import FLOAT_DTYPES, WEIGHT_ONLY
from fx_fp8.quant.checkpoint_record import check_index, check_record
from fx_fp8.quant.layer_record import dtype_name, flat_record, flat_tensor_shapes, stored_plan
from fx_fp8.quant.module_swap import replace_module
from fx_fp8.quant.prequantized import _is_bfl_fp8r as is_bfl_fp8r
from fx_fp8.quant.quantized_linear import QuantizedLinear
from fx_fp8.quant.rules import is_plain_linear
from fx_fp8.quant.state_guard import guard, native_reasons, quantized_layers

FORMAT = "fx_fp8.quantized_checkpoint"
VERSION = 1
WEIGHTS_NAME = "fx_fp8_quantized.safetensors"
QUANT_NAME = "fx_fp8_quantization.json"
CONFIG_NAME = "config.json"
#: how each tensor's bytes are digested (recorded in the description, checked at load)
DIGEST = "blake2b-128"
#: pipeline attributes holding a denoising transformer (as fx_fp8.pipeline.state)
TRANSFORMER_ATTRS = ("transformer", "transformer_2")


# -- save ------------------------------------------------------------------------------------
def _unwrap(module):
    return unwrap_compiled(module)


def _targets(obj) -> dict:
    """{subfolder ("" for a model): model} of what save_quantized writes."""
    if isinstance(obj, nn.Module):
        return {"": _unwrap(obj)}
    found = {a: getattr(obj, a, None) for a in TRANSFORMER_ATTRS}
    found = {a: _unwrap(m) for a, m in found.items() if m is not None}
    if not found:
        raise ValueError(
            f"save_quantized expects a prepared torch.nn.Module or a diffusers pipeline with a "
            f"{' or '.join(TRANSFORMER_ATTRS)}; got {type(obj).__name__}"
        )
    for a, m in found.items():
        if not isinstance(m, nn.Module):
            raise ValueError(f"pipe.{a} is a {type(m).__name__}, not a torch.nn.Module")
    return found


def _dtype(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"invalid dtype {name!r} in {where}")
    return dtype


def _bfl_record(name: str, layer: nn.Module, reason: Optional[str], where: str) -> dict:
    """The record of a BFL fp8r layer adopt_prequantized kept (its forward dequantizes): what
    load_quantized needs to rebuild it around the saved weight and weight_scale."""
    n, k = layer.out_features, layer.in_features
    scale = getattr(layer, "weight_scale", None)
    if (
        layer.weight.dtype != torch.float8_e4m3fn
        or tuple(layer.weight.shape) != (n, k)
        or not isinstance(scale, torch.Tensor)
        or scale.dtype != torch.float32
        or tuple(scale.shape) != (n,)
    ):
        raise ValueError(
            f"{where}: {name!r} is a BFLFP8RLinear whose tensors are not the fp8r layout (weight "
            f"{layer.weight.dtype} {list(layer.weight.shape)}, expected torch.float8_e4m3fn [{n}, {k}]; "
            f"weight_scale {getattr(scale, 'dtype', None)} {list(getattr(scale, 'shape', []))}, expected "
            f"torch.float32 [{n}]): it cannot be saved"
        )
    compute = getattr(layer, "compute_dtype", None)
    return {
        "class": type(layer).__name__,
        "in_features": k,
        "out_features": n,
        "bias": layer.bias is not None,
        "compute_dtype": dtype_name(compute) if isinstance(compute, torch.dtype) else None,
        "reason": reason,
    }


def _ties(state: dict, where: str) -> dict:
    """{key: the first key holding the very same tensor} of a state dict (tied parameters, one
    module under two names): saved once, tied again on load. Keys that share memory without being
    the same tensor (overlapping views) cannot be saved that way: a ValueError names them."""
    first, tied, storages = {}, {}, {}
    for key, t in state.items():
        if t.numel() == 0:  # empty tensors share no bytes (and may all have data_ptr 0)
            continue
        same = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if same in first:
            tied[key] = first[same]
            continue
        first[same] = key
        storages.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(key)
    overlapping = [keys for keys in storages.values() if len(keys) > 1]
    if overlapping:
        raise ValueError(
            f"{where}: the state dict entries {', '.join(map(repr, overlapping[0]))} share memory without "
            "being the same tensor (views of one storage): save_quantized saves a tied tensor once, not "
            "parts of one; give each its own storage (.clone()) first"
        )
    return tied


def _describe(module: nn.Module, where: str) -> tuple[dict, dict]:
    """(quantization record, tensors) of one prepared model, checked before anything is written."""
    layers = {n: flat_record(m) for n, m in module.named_modules() if isinstance(m, QuantizedLinear)}
    if not layers:
        raise ValueError(
            f"nothing quantized to save in {where} ({type(module).__name__} has no QuantizedLinear): "
            "call fx_fp8.prepare_model(model, config) first (compile_pipeline prepares on the first "
            "call), or save the unquantized model with save_pretrained"
        )
    state = module.state_dict()
    for key, t in state.items():
        if t.is_meta:
            raise ValueError(f"{where}: {key!r} is on the meta device (no data to save)")
    tied = _ties(state, where)
    tensors = {key: t.detach().contiguous() for key, t in state.items() if key not in tied}
    reasons = native_reasons(module)
    native = {n: reasons.get(n) for n, m in module.named_modules() if is_plain_linear(m)}
    # BFL fp8r layers adopt_prequantized kept: their fp8 weight and scale, rebuilt on load
    bfl = {n: _bfl_record(n, m, reasons.get(n), where) for n, m in module.named_modules() if is_bfl_fp8r(m)}
    persistent = set(tensors)
    # buffers a model makes in __init__ and does not save (rotary tables): their dtype is restored on load
    extra = {n: dtype_name(b.dtype) for n, b in module.named_buffers() if n not in persistent and b.is_floating_point()}
    record = {
        "format": FORMAT,
        "version": VERSION,
        "model_class": type(module).__name__,
        "model_module": type(module).__module__,
        "diffusers_config": CONFIG_NAME if _has_config(module) else None,
        "layers": layers,
        "native": native,
        "bfl_fp8r_native": bfl,
        "tied": tied,
        "nonpersistent_buffer_dtypes": extra,
        "tensor_digests": {"algorithm": DIGEST, "tensors": tensor_digests(tensors)},
    }
    return record, tensors


def tensor_digest(t: torch.Tensor) -> str:
    """DIGEST of a tensor's bytes as safetensors stores them (C order), read in place on the CPU."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy()  # any dtype: bf16 / fp8 have no numpy type
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def tensor_digests(tensors: dict) -> dict:
    """{key: tensor_digest} of every tensor, several at once (hashlib lets go of the GIL while it
    hashes a large buffer: the digests of a big checkpoint take the cores there are)."""
    from concurrent.futures import ThreadPoolExecutor

    workers = max(1, min(8, os.cpu_count() or 1, len(tensors)))
    if workers == 1:
        return {k: tensor_digest(t) for k, t in tensors.items()}
    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(tensors, pool.map(tensor_digest, tensors.values())))


def _has_config(module) -> bool:
    return callable(getattr(module, "save_config", None)) and getattr(module, "config", None) is not None


def _write_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def config_digest(path: str) -> str:
    """DIGEST of a config.json's content (canonical JSON: key order and spacing do not count)."""
    data = json.dumps(_read_json(path), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _staged(what: str, folder: str, write) -> None:
    """write(), its failure named by the file it was writing (nothing in `folder` is replaced yet)."""
    try:
        write()
    except Exception as e:
        kind = OSError if isinstance(e, OSError) else ValueError
        raise kind(
            f"save_quantized could not write {os.path.join(folder, what)!r} ({type(e).__name__}: {e}); "
            f"nothing in {folder!r} was replaced: what it held before still loads"
        ) from e


def _stage(module, record: dict, tensors: dict, staging: str, folder: str) -> None:
    """Write one model's files into `staging`: the weights, config.json (digested into the
    record) and the description, each complete before any of them replaces an old one."""
    from safetensors.torch import save_file

    _staged(
        WEIGHTS_NAME,
        folder,
        lambda: save_file(
            tensors, os.path.join(staging, WEIGHTS_NAME), metadata={"format": "pt", "fx_fp8": f"{FORMAT} {VERSION}"}
        ),
    )
    if record["diffusers_config"]:
        _staged(CONFIG_NAME, folder, lambda: module.save_config(staging))
        record["config_digest"] = {"algorithm": DIGEST, "digest": config_digest(os.path.join(staging, CONFIG_NAME))}
    _staged(QUANT_NAME, folder, lambda: _write_json(os.path.join(staging, QUANT_NAME), record))


def save_quantized(model_or_pipe, directory) -> str:
    """Save a prepared model (or a torch.compile'd one, or a pipeline's transformers) as they
    are, quantized: config.json (diffusers models), fx_fp8_quantized.safetensors and
    fx_fp8_quantization.json, in `directory` for a model and in `directory/<attr>` for each
    transformer of a pipeline (plus an index naming them). Nothing is written unless every
    model is prepared; every file is written completely (in a temporary folder beside it)
    before any old one is replaced, config.json last, so a save that fails leaves what the
    folder held loadable. Returns the directory."""
    import shutil
    import tempfile

    directory = os.fspath(directory)
    targets = _targets(model_or_pipe)
    is_pipe = not isinstance(model_or_pipe, nn.Module)
    described = {sub: _describe(m, f"pipe.{sub}" if is_pipe else type(m).__name__) for sub, m in targets.items()}
    staged = []
    try:
        for sub, module in targets.items():
            folder = os.path.join(directory, sub) if sub else directory
            os.makedirs(folder, exist_ok=True)
            staged.append((tempfile.mkdtemp(prefix=".fx_fp8_save_", dir=folder), folder))
            _stage(module, *described[sub], *staged[-1])
        for staging, folder in staged:  # every file written: only now replace the old ones
            for name in (WEIGHTS_NAME, QUANT_NAME, CONFIG_NAME):  # config.json last
                if os.path.exists(os.path.join(staging, name)):
                    os.replace(os.path.join(staging, name), os.path.join(folder, name))
    finally:
        for staging, _ in staged:
            shutil.rmtree(staging, ignore_errors=True)
    if is_pipe:
        _write_json(
            os.path.join(directory, QUANT_NAME),
            {
                "format": FORMAT,
                "version": VERSION,
                "pipeline": type(model_or_pipe).__name__,
                "components": sorted(targets, key=TRANSFORMER_ATTRS.index),
            },
        )
    return directory


# -- load ------------------------------------------------------------------------------------
def _read_json(path: str):
    """A checkpoint's JSON file; a damaged one is a ValueError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(
            f"cannot read {path!r}: {e} (the file is damaged or not what save_quantized wrote: save the model again)"
        ) from e


def _read_record(folder: str) -> dict:
    path = os.path.join(folder, QUANT_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{folder!r} is not an fx_fp8 quantized checkpoint: no {QUANT_NAME} (write one with fx_fp8.save_quantized)"
        )
    record = _read_json(path)
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"{path!r} is not an fx_fp8 quantized-checkpoint description")
    if record.get("version") != VERSION:
        raise ValueError(f"{path!r} has format version {record.get('version')!r}; this fx_fp8 reads version {VERSION}")
    for key, kind in (("model_class", str), ("layers", dict), ("native", dict)):
        if not isinstance(record.get(key), kind):
            raise ValueError(
                f"{path!r} is damaged: {key!r} is {type(record.get(key)).__name__}, expected "
                f"{kind.__name__} (save the model again)"
            )
    check_record(record, path, CONFIG_NAME)
    return record


def _read_tensors(path: str) -> dict:
    """Every tensor of a weights file, on the CPU; a damaged file is a ValueError naming it."""
    from safetensors.torch import load_file

    try:
        return load_file(path, device="cpu")
    except Exception as e:  # safetensors' own error type, OSError, ...: say which file
        raise ValueError(
            f"cannot read {path!r}: {type(e).__name__}: {e} (the file is damaged or truncated: save the model again)"
        ) from e


def _verify(tensors: dict, record: dict, path: str) -> None:
    """Each tensor's bytes against the digest save_quantized recorded: a file damaged in place
    (same size, other bytes), or the weights of another save, is refused, naming the tensors,
    instead of computing NaN. After the structural checks (_plan), so those name the model's keys."""
    digests = record.get("tensor_digests")
    if digests is None:
        warnings.warn(
            f"fx_fp8: {os.path.join(os.path.dirname(path), QUANT_NAME)!r} records no tensor digests "
            "(saved by an fx_fp8 before they were recorded): the bytes of its tensors are not verified; "
            "save the model again to record them",
            stacklevel=4,
        )
        return
    quant_path = os.path.join(os.path.dirname(path), QUANT_NAME)
    if (
        not isinstance(digests, dict)
        or digests.get("algorithm") != DIGEST
        or not isinstance(digests.get("tensors"), dict)
    ):
        raise ValueError(
            f"{quant_path!r} is damaged: its tensor_digests are not {DIGEST} digests (save the model again)"
        )
    recorded = digests["tensors"]
    if set(recorded) != set(tensors):
        extra, missing = sorted(set(tensors) - set(recorded)), sorted(set(recorded) - set(tensors))
        raise ValueError(
            f"{path!r} does not hold the tensors {quant_path!r} describes (in the file only: "
            f"{some_names(extra) or 'none'}; described only: {some_names(missing) or 'none'}): the two files come "
            "from different saves"
        )
    bad = sorted(k for k, d in tensor_digests(tensors).items() if d != recorded[k])
    if bad:
        raise ValueError(
            f"{path!r} is damaged: the bytes of {some_names(bad)} differ from those save_quantized wrote "
            f"(their {DIGEST} digests in {QUANT_NAME} do not match: the file was damaged, or is not "
            "the one saved with this description); save the model again"
        )


def _model_class(record: dict, folder: str, model_class):
    if model_class is not None:
        if model_class.__name__ != record["model_class"]:
            raise ValueError(f"{folder!r} holds a {record['model_class']}, not a {model_class.__name__}")
        return model_class
    if not record.get("diffusers_config"):
        raise ValueError(
            f"{folder!r} holds a {record['model_class']} without a diffusers config.json: load it into "
            f"a model you build with load_quantized({folder!r}, model=module)"
        )
    import diffusers

    cls = getattr(diffusers, record["model_class"], None)
    if cls is None:
        raise ValueError(
            f"diffusers has no class {record['model_class']!r} (model_class in "
            f"{os.path.join(folder, QUANT_NAME)!r}); pass model_class="
        )
    if not (isinstance(cls, type) and issubclass(cls, diffusers.ModelMixin)):  # DiffusionPipeline, a scheduler, ...
        raise ValueError(
            f"{os.path.join(folder, QUANT_NAME)!r} is damaged: model_class is {record['model_class']!r}, "
            "which is not a diffusers model class (no ModelMixin); save the model again, or pass "
            "model_class="
        )
    return cls


@contextlib.contextmanager
def _empty_parameters():
    """Parameters on the meta device while a model is built (its buffers stay real: rotary
    tables and the like are computed in __init__ and not saved)."""
    try:
        from accelerate import init_empty_weights
    except ImportError:
        yield False
        return
    with init_empty_weights(include_buffers=False):
        yield True


def _verify_config(folder: str, record: dict, verify: bool) -> None:
    """config.json against the digest save_quantized recorded: a config.json of another save
    (another model of the same structure) is refused, naming it, instead of building a model
    that computes something else."""
    path, quant_path = os.path.join(folder, CONFIG_NAME), os.path.join(folder, QUANT_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{folder!r}: no {CONFIG_NAME} (recorded in {quant_path!r}): the model cannot be "
            f"built; load it into a model you build with load_quantized({folder!r}, model=module)"
        )
    if not verify:
        return
    recorded = record.get("config_digest")
    if recorded is None:
        warnings.warn(
            f"fx_fp8: {quant_path!r} records no digest of {CONFIG_NAME} (saved by an fx_fp8 before it was "
            f"recorded): {path!r} is not verified; save the model again to record it",
            stacklevel=4,
        )
        return
    if (
        not isinstance(recorded, dict)
        or recorded.get("algorithm") != DIGEST
        or not isinstance(recorded.get("digest"), str)
    ):
        raise ValueError(
            f"{quant_path!r} is damaged: its config_digest is not a {DIGEST} digest (save the model again)"
        )
    if config_digest(path) != recorded["digest"]:
        raise ValueError(
            f"{path!r} is not the {CONFIG_NAME} saved with {quant_path!r} (its {DIGEST} digest differs: "
            "edited, or copied from another save); put the saved one back or save the model again"
        )


def _build(cls, folder: str):
    config = cls.load_config(folder)
    with _empty_parameters() as empty, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers' notes on config keys it fills in
        model = cls.from_config(config)
    return model, empty


def some_names(names, n: int = 10) -> str:
    """The first n names, comma-separated, and how many more there are: for one-line errors."""
    names = list(names)
    return ", ".join(names[:n]) + (f" (+{len(names) - n} more)" if len(names) > n else "")


def _layer_mismatch(name: str, old, rec: dict, fits, purpose: str, kind: str) -> list:
    """[why the model's module `old` cannot take the recorded layer `rec`], or []."""
    if not fits(old):
        return [
            f"{name!r}: the model has {type(old).__name__ if old is not None else 'no module'} there, "
            f"expected an nn.Linear {purpose}"
        ]
    if (old.in_features, old.out_features, old.bias is not None) != (
        rec["in_features"],
        rec["out_features"],
        rec["bias"],
    ):
        return [
            f"{name!r}: the model's linear is {old.in_features}->{old.out_features} (bias "
            f"{old.bias is not None}), the checkpoint's {kind}{rec['in_features']}->{rec['out_features']} "
            f"(bias {rec['bias']})"
        ]
    return []


def _plan(model: nn.Module, record: dict, tensors: dict, folder: str) -> list:
    """Check the model's structure and the saved tensors against the record, then build the
    QuantizedLinear replacements: [(name, old linear, new)]. Touches nothing."""
    layers = record["layers"]
    where = f"in {folder!r}"
    problems, expected = [], {}
    linears = dict(model.named_modules())
    for name, rec in layers.items():
        problems += _layer_mismatch(name, linears.get(name), rec, is_plain_linear, "to quantize", "")
        expected.update(flat_tensor_shapes(name, rec))
    bfl = record.get("bfl_fp8r_native", {})
    for name, rec in bfl.items():
        problems += _layer_mismatch(
            name,
            linears.get(name),
            rec,
            lambda m: isinstance(m, nn.Linear),
            "to hold the checkpoint's BFL fp8r layer",
            "BFL fp8r layer ",
        )
        expected.update(_bfl_keys(name, rec))
    skip = {f"{n}.{p}" for n in (*layers, *bfl) for p in ("weight", "bias")}
    for key, t in model.state_dict(keep_vars=True).items():
        if key not in skip:
            expected[key] = tuple(t.shape)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        problems.append(f"missing keys {where}: {some_names(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {where}: {some_names(unexpected)}")
    for key in sorted(set(expected) & set(tensors)):
        if tuple(tensors[key].shape) != expected[key]:
            problems.append(
                f"{key!r} {where} has shape {list(tensors[key].shape)}, the model expects {list(expected[key])}"
            )
    for name, rec in layers.items():
        w = tensors.get(f"{name}.weight")
        if w is not None and dtype_name(w.dtype) != rec["weight_dtype"]:
            problems.append(f"{name + '.weight'!r} {where} is {dtype_name(w.dtype)}, recorded as {rec['weight_dtype']}")
    for name in bfl:
        for key, want in ((f"{name}.weight", torch.float8_e4m3fn), (f"{name}.weight_scale", torch.float32)):
            if key in tensors and tensors[key].dtype != want:
                problems.append(
                    f"{key!r} {where} is {dtype_name(tensors[key].dtype)}, a BFL fp8r layer holds {dtype_name(want)}"
                )
    if problems:
        raise ValueError(
            f"cannot load the quantized checkpoint {folder!r} into {type(model).__name__}:\n  " + "\n  ".join(problems)
        )
    for name, rec in layers.items():  # older records have no "weight_only": act_granularity says it
        if "weight_only" in rec and bool(rec["weight_only"]) != (rec["act_granularity"] == WEIGHT_ONLY):
            problems.append(
                f"{name}: recorded weight_only={rec['weight_only']!r} with act_granularity {rec['act_granularity']!r}"
            )
    if problems:
        raise ValueError(
            f"cannot load the quantized checkpoint {folder!r} into {type(model).__name__}:\n  " + "\n  ".join(problems)
        )
    plan = []
    for name, rec in layers.items():
        t = lambda k: tensors.get(f"{name}.{k}")  # noqa: E731
        plan.append(
            (
                name,
                linears[name],
                QuantizedLinear.from_plan(
                    stored_plan(rec),
                    t("weight"),
                    t("weight_scale"),
                    t("bias"),
                    orig_dtype=_dtype(rec["orig_dtype"], folder),
                    input_scale=t("input_scale"),
                    input_smoothing=t("input_smoothing"),
                    input_step_scales=t("input_step_scales"),
                ),
            )
        )
    for name, rec in bfl.items():
        plan.append((name, linears[name], _empty_bfl_layer(rec, folder)))
    return plan


def _bfl_keys(name: str, rec: dict) -> dict:
    """{key: expected shape} of a kept BFL fp8r layer's entries."""
    keys = {f"{name}.weight": (rec["out_features"], rec["in_features"]), f"{name}.weight_scale": (rec["out_features"],)}
    if rec["bias"]:
        keys[f"{name}.bias"] = (rec["out_features"],)
    return keys


def _empty_bfl_layer(rec: dict, folder: str) -> nn.Module:
    """diffusers' BFLFP8RLinear on the meta device: load_state_dict(assign=True) gives it the saved tensors."""
    from diffusers.quantizers.bfl.utils import BFLFP8RLinear

    compute = _dtype(rec["compute_dtype"], folder) if rec["compute_dtype"] is not None else None
    layer = BFLFP8RLinear(rec["in_features"], rec["out_features"], rec["bias"], compute_dtype=compute, device="meta")
    return layer.requires_grad_(False)


def _load_folder(
    folder: str, *, model_class=None, model: Optional[nn.Module] = None, device=None, dtype=None, verify: bool = True
):

    record = _read_record(folder)
    path = os.path.join(folder, WEIGHTS_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder!r}: no {WEIGHTS_NAME}")
    built = model is None
    if built:
        cls = _model_class(record, folder, model_class)
        _verify_config(folder, record, verify)
        model, _ = _build(cls, folder)
    else:
        model = _unwrap(model)
        if quantized_layers(model):
            raise ValueError(
                f"load_quantized(model=...) expects an unprepared {type(model).__name__}; it already holds "
                f"quantized linears (first: {quantized_layers(model)[0]!r})"
            )
    raw = _read_tensors(path)  # views of the file's bytes
    # own, aligned storage: views into the file's buffer sit at any byte offset, and CPU matmul
    # kernels chosen by alignment would then round differently from the saved model's
    target = torch.device(device) if device is not None else torch.device("cpu")
    tensors = {k: t.clone() if target.type == "cpu" else t.to(target) for k, t in raw.items()}
    buffer_dtypes = {n: _dtype(d, folder) for n, d in record.get("nonpersistent_buffer_dtypes", {}).items()}
    if dtype is not None:  # as model.to(dtype): quantized weights and their scales keep theirs
        frozen = {f"{n}.{k}" for n in record["layers"] for k in QuantizedLinear._FROZEN_DTYPE}
        frozen |= {f"{n}.{k}" for n in record.get("bfl_fp8r_native", {}) for k in ("weight", "weight_scale")}
        tensors = {k: t.to(dtype) if t.is_floating_point() and k not in frozen else t for k, t in tensors.items()}
        buffer_dtypes = {n: dtype for n in buffer_dtypes}
        record = {
            **record,
            "layers": {n: {**r, "orig_dtype": dtype_name(dtype)} for n, r in record["layers"].items()},
            "bfl_fp8r_native": {
                n: {**r, "compute_dtype": dtype_name(dtype)} for n, r in record.get("bfl_fp8r_native", {}).items()
            },
        }
    tied = record.get("tied", {})
    for alias, source in tied.items():
        if source not in tensors or alias in tensors:
            raise ValueError(
                f"{os.path.join(folder, QUANT_NAME)!r} is damaged: tied[{alias!r}] is {source!r}, but "
                f"{path!r} {'holds no ' + repr(source) if source not in tensors else 'holds ' + repr(alias)}"
                " (the files come from different saves, or the description was edited)"
            )
        tensors[alias] = tensors[source]
    plan = _plan(model, record, tensors, folder)  # structure first: missing / unexpected keys name the model's
    if verify:
        _verify(raw, record, path)
    del raw
    # everything checked: only now change the model
    for name, old, new in plan:
        replace_module(model, name, new, old=old)
    model.load_state_dict(tensors, strict=True, assign=True)  # QuantizedLinear accepts its weight bytes here
    _tie(model, tied)
    target = torch.device(device) if device is not None else None
    for name, buf in list(model.named_buffers()):
        # the buffers a model makes in __init__: the saved dtype, on the device asked for
        want_dtype = buffer_dtypes.get(name, buf.dtype)
        want_device = target if target is not None and buf.device.type != target.type else buf.device
        if buf.dtype != want_dtype or buf.device != want_device:
            owner, _, leaf = name.rpartition(".")
            (model.get_submodule(owner) if owner else model)._buffers[leaf] = buf.to(want_device, want_dtype)
    meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if meta:
        raise RuntimeError(f"{folder!r}: {meta[0]!r} (and {len(meta) - 1} more) still on the meta device after loading")
    if built:
        model.eval()
    native = {**record["native"], **{n: r["reason"] for n, r in record.get("bfl_fp8r_native", {}).items()}}
    guard(model, {n: r for n, r in native.items() if r is not None})
    return model


def _check_dtype(dtype) -> None:
    """load_quantized's dtype, refused before anything is read (as nn.Module.to refuses): a string,
    an integer dtype (it would cast the biases), FP8 (what the quantized layers compute from, not in)."""
    if dtype is None or dtype in FLOAT_DTYPES:
        return
    wanted = "torch.float32, torch.bfloat16 or torch.float16 (what the unquantized parameters are cast to)"
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype.removeprefix("torch."), None), torch.dtype):
        raise TypeError(f"load_quantized: dtype={dtype!r} is a string: pass torch.{dtype.removeprefix('torch.')}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"load_quantized: dtype={dtype!r} is a {type(dtype).__name__}, not a torch.dtype: expected " + wanted
        )
    raise TypeError(
        f"load_quantized: dtype={dtype} is not a dtype the model can compute in: expected {wanted}; as "
        "nn.Module.to, the non-quantized parameters take only floating dtypes (the quantized weights "
        "keep theirs)"
    )


def _tie(model: nn.Module, tied: dict) -> None:
    """Tie again what save_quantized saved once: each alias entry becomes its source's very tensor."""
    for alias, source in tied.items():
        owner, _, leaf = alias.rpartition(".")
        src_owner, _, src_leaf = source.rpartition(".")
        holder, src_holder = model.get_submodule(owner), model.get_submodule(src_owner)
        value = src_holder._parameters.get(src_leaf, src_holder._buffers.get(src_leaf))
        if leaf in holder._parameters:
            holder._parameters[leaf] = value if isinstance(value, nn.Parameter) else nn.Parameter(value, False)
        else:
            holder._buffers[leaf] = value


def load_quantized(
    directory,
    model_class=None,
    *,
    model: Optional[nn.Module] = None,
    pipe=None,
    device=None,
    dtype: Optional[torch.dtype] = None,
    verify: bool = True,
):
    """Load what save_quantized wrote, without re-quantizing.

    load_quantized(directory[, model_class]): build the model from its config.json (the class
      named there, from diffusers, unless model_class is given) with empty parameters, put
      QuantizedLinear modules where the checkpoint has them, and load every tensor (strict:
      missing or unexpected keys raise, naming them). Returns the model, in eval mode.
    load_quantized(directory, model=module): the same into an unprepared model you built
      (any nn.Module); its parameters are replaced by the checkpoint's. Returns `module`.
    load_quantized(directory, pipe=pipe): a folder saved from a pipeline: each saved
      transformer (`transformer`, `transformer_2`) is built and set on `pipe` (replacing what
      is there). The pipeline must not be compiled yet: call compile_pipeline afterwards.
      Returns `pipe`.
    device: where the tensors are loaded (default CPU); dtype (torch.float32 / bfloat16 /
    float16; anything else is a TypeError naming it, before anything is read): cast the
    non-quantized parameters (the quantized weights and scales keep theirs), as `model.to(dtype)`.
    verify: check every tensor's bytes against the digest save_quantized recorded (a damaged
    file is a ValueError naming the tensors and the file, not NaN outputs); verify=False skips
    it, for a huge checkpoint read often (the digests read every byte once more, on up to 8 threads:
    benchmarks/checkpoint_digests.py measures what that costs).
    Every error of a damaged checkpoint names its file.
    """
    directory = os.fspath(directory)
    _check_dtype(dtype)
    if model is not None and pipe is not None:
        raise ValueError("load_quantized takes model= or pipe=, not both")
    if model is not None and not isinstance(model, nn.Module):
        raise ValueError(f"model= expects a torch.nn.Module, got {type(model).__name__}")
    index = None
    index_path = os.path.join(directory, QUANT_NAME)
    if os.path.isfile(index_path):
        data = _read_json(index_path)
        index = data if isinstance(data, dict) and "components" in data else None
        if index is not None:
            check_index(index, index_path, TRANSFORMER_ATTRS)
    if pipe is None:
        if index is not None:
            raise ValueError(
                f"{directory!r} holds a pipeline's transformers ({', '.join(index['components'])}): "
                f"pass pipe=, or load one of them, e.g. {os.path.join(directory, index['components'][0])!r}"
            )
        return _load_folder(directory, model_class=model_class, model=model, device=device, dtype=dtype, verify=verify)
    if index is None:
        raise ValueError(
            f"{directory!r} was not saved from a pipeline (no component index in {QUANT_NAME}); "
            "load it as a model and set it on the pipeline yourself"
        )
    if getattr(pipe, "_fx_fp8", None) is not None:
        raise ValueError(
            f"{type(pipe).__name__} is compiled by fx_fp8.compile_pipeline: call "
            "fx_fp8.restore_pipeline(pipe) first, load, then compile it again"
        )
    for attr in index["components"]:
        if attr not in TRANSFORMER_ATTRS or not hasattr(pipe, attr):
            raise ValueError(f"{type(pipe).__name__} has no {attr!r} to load {os.path.join(directory, attr)!r} into")
        if is_compiled_module(getattr(pipe, attr)):
            raise ValueError(f"pipe.{attr} is torch.compile'd: load into the uncompiled pipeline, then compile it")
    loaded = {
        attr: _load_folder(
            os.path.join(directory, attr), model_class=model_class, device=device, dtype=dtype, verify=verify
        )
        for attr in index["components"]
    }
    for attr, m in loaded.items():
        setattr(pipe, attr, m)
    return pipe
