"""What `fx-fp8 --model X` names: the shipped tiny model, a family, or a local diffusers folder.

    resolve_model("tiny")                 # fx_fp8.tools.tiny_model (trained, the default)
    resolve_model("flux")                 # a family of fx_fp8.tools.model_zoo: random weights, no download
    resolve_model("/models/FLUX.1-dev")   # pipeline folder (model_index.json + transformer/)
    resolve_model("/models/x/transformer")  # transformer folder (config.json with _class_name)

A transformer folder may hold quantized weights (fx_fp8/tools/quantized_folders.py): written by
save_pretrained of a model loaded with fx_fp8.DiffusersConfig, or by fx_fp8.save_quantized;
`ModelSource.quantized` says which ("" for full precision) and loading follows it.

A ModelSource loads the transformer, builds example inputs for one forward call
from the transformer's config, and builds a runnable pipeline (`PipelineRun`)
for `compare` and `sensitivity`. Bad input raises ModelSourceError (a
ValueError) whose message is one line naming the bad value.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from fx_fp8.pipeline.step_publishing import publish_steps
from fx_fp8.tools.model_zoo import registry as model_zoo
from fx_fp8.tools.quantized_folders import folder_quantization, is_save_quantized_pipeline

#: a model folder's own fx_fp8 config, which the examples and `fx-fp8 compare` start from
MODEL_CONFIG_NAME = "fx_fp8.yaml"


class ModelSourceError(ValueError):
    """`--model` names nothing we can load."""


def _family(spec: str) -> Optional[str]:
    try:
        return model_zoo.canonical_family(spec)
    except ValueError:
        return None


def _read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelSourceError(f"cannot read {str(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise ModelSourceError(f"{str(path)!r} is not a JSON object")
    return data


@dataclass
class ModelSource:
    spec: str  # what the user typed
    kind: str  # "tiny" | "family" | "pipeline_dir" | "transformer_dir"
    class_name: str  # the transformer's diffusers class
    path: Optional[Path] = None  # folder holding the transformer's config.json
    pipeline_path: Optional[Path] = None
    family: Optional[str] = None
    quantized: str = ""  # quantized_folders.folder_quantization of the transformer folder

    def describe(self) -> str:
        where = f" ({self.path})" if self.path else ""
        held = f", quantized weights ({self.quantized})" if self.quantized else ""
        return f"{self.spec}: {self.class_name}{where}{held}"

    # -- transformer -------------------------------------------------------
    def load_transformer(self, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        """The transformer; a folder that cannot be loaded raises ModelSourceError (one line)."""
        with warnings.catch_warnings():  # diffusers warns about unused config keys and low_cpu_mem_usage
            warnings.simplefilter("ignore")
            if self.kind == "family":
                return model_zoo.build_tiny_transformer(self.family, dtype=dtype)
            self.check_transformer(example_inputs=False)
            cls = _diffusers_class(self.class_name, self.path)
            from fx_fp8.tools.quantized_folders import load_transformer_folder

            try:
                with _quiet_loading():
                    model = load_transformer_folder(self.path, cls, dtype)
            except Exception as e:  # noqa: BLE001 - say which folder failed, in one line
                raise ModelSourceError(
                    f"cannot load the {self.class_name} in {str(self.path)!r}: {_first_line(e)}"
                ) from None
            return model.eval()

    def example_inputs(self, model: torch.nn.Module, *, batch: int = 1, seed: int = 0) -> dict:
        """Keyword arguments for one forward call of `model`, shaped from its config, on its device
        (drawn on CPU: the same values on every device)."""
        param = next(model.parameters())
        dtype = param.dtype
        if self.kind == "family":
            kwargs = model_zoo.example_inputs(self.family, model, batch=batch, seed=seed, dtype=dtype)
        else:
            build = _INPUT_BUILDERS.get(self.class_name)
            if build is None:
                raise ModelSourceError(_no_builder_message(self.class_name, self.path))
            gen = torch.Generator().manual_seed(seed)
            size = _TINY_SIZE if self.kind == "tiny" else _FOLDER_SIZES.get(self.class_name, {})
            kwargs = build(model.config, batch, gen, dtype, **size)
        if param.device.type == "cpu":
            return kwargs
        return {k: _on_device(v, param.device) for k, v in kwargs.items()}

    def own_config(self) -> Optional[Path]:
        """The pipeline folder's own fx_fp8 config (MODEL_CONFIG_NAME; the shipped tiny model has one:
        its step policy), or None."""
        if self.pipeline_path is None:
            return None
        path = self.pipeline_path / MODEL_CONFIG_NAME
        return path if path.is_file() else None

    # -- checks before any work --------------------------------------------
    def check_transformer(self, *, example_inputs: bool = True) -> None:
        """Raise ModelSourceError unless load_transformer (and, with example_inputs, example_inputs)
        can work: a diffusers model class, weight files, an example-input builder."""
        if self.kind == "family":
            return
        _diffusers_class(self.class_name, self.path)
        _check_weights(self.path)
        if example_inputs and self.class_name not in _INPUT_BUILDERS:
            raise ModelSourceError(_no_builder_message(self.class_name, self.path))

    def check_full_precision(self, command: str) -> None:
        """Raise ModelSourceError if the transformer's weights are already quantized (`command`
        needs the full-precision model)."""
        if self.quantized:
            raise ModelSourceError(
                f"{command} needs full-precision weights: the transformer in {str(self.path)!r} "
                f"is already quantized ({self.quantized}); give the original model"
            )

    def check_pipeline(self) -> None:
        """Raise ModelSourceError unless load_pipeline can work (a pipeline, not a lone transformer)."""
        if self.kind == "transformer_dir":
            raise ModelSourceError(
                f"{str(self.path)!r} is a transformer folder: compare/sensitivity need a pipeline folder "
                "(with model_index.json), 'tiny' or a family name"
            )
        if self.kind == "pipeline_dir":
            self.check_transformer(example_inputs=False)

    def check_component_weights(self) -> None:
        """Raise ModelSourceError naming the first model component folder of the pipeline (a
        config.json) that holds no weight files: diffusers would fail on it half way through loading."""
        if self.kind in ("pipeline_dir", "tiny"):
            _check_component_weights(self.pipeline_path)

    def size_rule(self) -> "SizeRule":
        """The heights and widths the pipeline can make (see SizeRule), from the configs alone."""
        if self.kind == "tiny":
            return SizeRule(multiple=4, minimum=16)  # TinyShapesPipeline: Flux-packed 2x2 patches in pixel space
        if self.kind == "family":
            return FAMILY_SIZE_RULES[self.family]
        if self.kind != "pipeline_dir":
            return SizeRule()
        try:
            vae = _read_json(self.pipeline_path / "vae" / "config.json")
            transformer = _read_json(self.path / "config.json")
        except ModelSourceError:
            return SizeRule()  # the pipeline itself will say what is wrong
        return size_rule(self.class_name, transformer, vae)

    def check_size(self, height: int, width: int) -> None:
        """Raise ModelSourceError naming --height/--width if the pipeline cannot make that size."""
        rule = self.size_rule()
        for name, v, top in (("height", height, rule.max_height), ("width", width, rule.max_width)):
            if v % rule.multiple or v < rule.minimum or (top is not None and v > top):
                what = f"a multiple of {rule.multiple}"
                if rule.minimum > rule.multiple:
                    what += f", at least {rule.minimum}"
                if top is not None:
                    what += f", at most {top}"
                raise ModelSourceError(f"invalid --{name} {v} for {self.spec} ({self.class_name}): expected {what}")

    # -- pipeline ----------------------------------------------------------
    def load_pipeline(
        self,
        *,
        prompts: int = 2,
        height: int = 32,
        width: int = 32,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ) -> "PipelineRun":
        """A pipeline in `dtype` on `device`, plus the calls that make `prompts` samples (same seeds every run)."""
        run = self._load_pipeline(prompts=prompts, height=height, width=width, seed=seed, dtype=dtype)
        if str(device) != "cpu" or dtype != torch.float32:
            run.pipe.to(device=device, dtype=dtype)
            run.calls = [{k: _placed(v, device, dtype) for k, v in call.items()} for call in run.calls]
        return run

    def _load_pipeline(self, *, prompts: int, height: int, width: int, seed: int, dtype: torch.dtype) -> "PipelineRun":
        self.check_pipeline()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if self.kind == "tiny":
                from fx_fp8.tools.quantized_folders import load_pipeline_folder
                from fx_fp8.tools.tiny_model import TinyShapesPipeline, random_prompt

                # the shipped folder, or a copy whose transformer/ holds quantized weights
                pipe = load_pipeline_folder(self.pipeline_path, dtype, pipeline_class=TinyShapesPipeline)
                pipe.set_progress_bar_config(disable=True)
                rng = np.random.default_rng(seed)
                texts = [random_prompt(rng) for _ in range(prompts)]
                # one batched call: every prompt in one transformer call per step
                calls = [dict(prompt=texts, height=height, width=width)]
                return PipelineRun(pipe, calls, [seed], labels=texts)
            if self.kind == "family":
                name = self.spec if self.spec.lower().startswith("wan2.2") else self.family
                pipe, kwargs = model_zoo.build_tiny_pipeline(name, height=height, width=width, seed=seed)
                # random embeddings stand for prompts: one call per sample, different noise seeds
                return PipelineRun(
                    pipe,
                    [dict(kwargs)] * prompts,
                    [seed + i for i in range(prompts)],
                    labels=[f"{self.family} sample {i}" for i in range(prompts)],
                )
            from fx_fp8.tools.quantized_folders import load_pipeline_folder

            try:
                with _quiet_loading():
                    pipe = load_pipeline_folder(self.pipeline_path, dtype)
            except Exception as e:  # noqa: BLE001 - say which folder failed, in one line
                raise ModelSourceError(
                    f"cannot load the pipeline in {str(self.pipeline_path)!r}: {_first_line(e)}"
                ) from None
            pipe.set_progress_bar_config(disable=True)
            texts = ["a photo of a cat", "a red car in the rain", "a mountain lake at dawn", "a bowl of fruit"]
            texts = (texts * prompts)[:prompts]
            return PipelineRun(
                pipe,
                [dict(prompt=t, height=height, width=width) for t in texts],
                [seed + i for i in range(prompts)],
                labels=texts,
            )


def _on_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_on_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _on_device(v, device) for k, v in value.items()}
    return value


def _placed(value, device, dtype):
    """A call argument on `device`; floating tensors (prompt embeddings) in `dtype` too."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
    return value


@dataclass
class PipelineRun:
    """A pipeline and the calls that make its samples; `calls[i]` runs with seed `seeds[i]`."""

    pipe: object
    calls: list[dict]
    seeds: list[int]
    labels: list[str] = field(default_factory=list)

    def transformers(self) -> list[tuple[str, torch.nn.Module]]:
        """The denoisers (Wan2.2 has two: transformer and transformer_2)."""
        out = []
        for name in ("transformer", "transformer_2"):
            m = getattr(self.pipe, name, None)
            if isinstance(m, torch.nn.Module):
                out.append((name, m))
        return out

    def run(
        self, steps: int, *, output_type: str = "latent", publish: bool = True
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(final latents, images or None) of every call, concatenated along the batch.

        publish: publish the denoising step to fx_fp8 (see publish_steps) so
        diffusion_kv_cache_skip_steps works; False for a pipeline prepared by
        fx_fp8.compile_pipeline, which publishes it itself.
        """
        latents, images = [], []
        for call, seed in zip(self.calls, self.seeds):
            box: dict = {}

            def grab(pipe, i, t, kw, box=box):
                box["latents"] = kw["latents"]
                return {}

            with publish_steps(self.pipe) if publish else contextlib.nullcontext():  # as compile_pipeline does
                out = self.pipe(
                    **call,
                    num_inference_steps=steps,
                    generator=torch.Generator().manual_seed(seed),
                    output_type=output_type,
                    callback_on_step_end=grab,
                )
            result = out.frames if hasattr(out, "frames") else out.images
            # on CPU in float32, whatever the pipeline ran on: the metrics compare them there
            if output_type == "latent":
                latents.append(torch.as_tensor(result).float().cpu())
            else:
                latents.append(box["latents"].float().cpu())
                images.append(torch.as_tensor(result).float().cpu())
        return torch.cat(latents), (torch.cat(images) if images else None)


def _diffusers_class(name: str, where: Optional[Path]):
    import diffusers

    cls = getattr(diffusers, name, None)
    if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        raise ModelSourceError(f"transformer class {name!r} in {str(where)!r} is not a diffusers model class")
    return cls


@contextlib.contextmanager
def _quiet_loading():
    """diffusers / transformers log their own error before raising; the caller reports a failed
    load itself, in one line."""
    import importlib

    saved = []
    for lib in ("diffusers", "transformers"):
        try:
            log = importlib.import_module(f"{lib}.utils.logging")
        except ImportError:
            continue
        saved.append((log, log.get_verbosity()))
        log.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in saved:
            log.set_verbosity(level)


def _first_line(e: BaseException) -> str:
    """One line for an exception from diffusers / safetensors, with the fix where we know it."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    if "keep_in_fp32_modules" in text and "low_cpu_mem_usage" in text:
        line += " (diffusers needs the 'accelerate' package to load this model: pip install accelerate)"
    return line


#: file names diffusers' from_pretrained loads weights from (single file, shards, variants, index)
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


def _check_weights(folder: Optional[Path]) -> None:
    if folder is None:
        return
    if not any(any(folder.glob(p)) for p in _WEIGHT_PATTERNS):
        raise ModelSourceError(
            f"folder {str(folder)!r} has config.json but no weights (no *.safetensors or *.bin file)"
        )


def _check_component_weights(pipeline: Optional[Path]) -> None:
    """Every component folder of a pipeline that holds a model (a config.json) has weight files:
    diffusers would otherwise fail while loading, after the earlier components have loaded."""
    if pipeline is None:
        return
    try:
        index = _read_json(pipeline / "model_index.json")
    except ModelSourceError:
        return  # loading will say what is wrong with it
    for name, spec in index.items():
        folder = pipeline / name
        if not name.startswith("_") and isinstance(spec, list) and (folder / "config.json").is_file():
            _check_weights(folder)


def _no_builder_message(name: str, where: Optional[Path]) -> str:
    return (
        f"no example-input builder for transformer class {name!r} in {str(where)!r} "
        f"(inspect/dump know: {', '.join(sorted(_INPUT_BUILDERS))})"
    )


def _spatial_patch(class_name: str, transformer: dict) -> int:
    """Latent pixels per token side: Flux / Qwen-Image pack 2x2 latent patches."""
    if class_name in ("FluxTransformer2DModel", "QwenImageTransformer2DModel"):
        return 2
    if class_name == "ZImageTransformer2DModel":
        return int((transformer.get("all_patch_size") or [2])[0])
    p = transformer.get("patch_size", 1)
    return int(p[-1] if isinstance(p, (list, tuple)) else p or 1)


def _vae_factor(vae: dict) -> int:
    """Image pixels per latent pixel, as the pipelines compute their vae_scale_factor."""
    if vae.get("_class_name") == "AutoencoderKLWan" or "scale_factor_spatial" in vae:
        return int(vae.get("scale_factor_spatial") or 8)  # WanPipeline: vae.config.scale_factor_spatial
    if vae.get("_class_name") == "AutoencoderKLQwenImage":  # QwenImagePipeline: 2 ** len(temperal_downsample)
        return 2 ** len(vae.get("temperal_downsample") or [False, True, True])
    return 2 ** (len(vae.get("block_out_channels") or [0, 0, 0, 0]) - 1)


@dataclass(frozen=True)
class SizeRule:
    """Heights and widths a pipeline can make: multiples of `multiple`, at least `minimum`, at most
    max_height / max_width (None: no limit) where the transformer's position tables end."""

    multiple: int = 1
    minimum: int = 1
    max_height: Optional[int] = None
    max_width: Optional[int] = None


def size_rule(class_name: str, transformer: dict, vae: dict) -> SizeRule:
    """The SizeRule of a pipeline, from its transformer's and its VAE's configs."""
    per_token = _vae_factor(vae) * _spatial_patch(class_name, transformer)
    multiple = per_token
    max_tokens = (None, None)
    if class_name == "WanTransformer3DModel":
        multiple = math.lcm(per_token, 16)  # WanPipeline.check_inputs: "have to be divisible by 16"
        rope = transformer.get("rope_max_seq_len", 1024)
        max_tokens = (rope, rope)  # rotary tables of rope_max_seq_len positions per axis
    elif class_name == "SD3Transformer2DModel" and transformer.get("pos_embed_max_size"):
        n = transformer["pos_embed_max_size"]
        max_tokens = (n, n)  # cropped positional embedding
    elif class_name == "ZImageTransformer2DModel" and transformer.get("axes_lens"):
        lens = transformer["axes_lens"]
        max_tokens = (lens[1], lens[2])  # rotary tables per axis (frame, height, width)
    top = [None if n is None else (n * per_token) // multiple * multiple for n in max_tokens]
    return SizeRule(multiple=multiple, minimum=multiple, max_height=top[0], max_width=top[1])


#: size_rule of the families' tiny pipelines, from their configs in the registry without building
#: anything (tests check it against the built pipelines' configs)
FAMILY_SIZE_RULES = {
    name: size_rule(
        model_zoo.MODELS[name].class_name, dict(model_zoo.MODELS[name].config), dict(model_zoo.MODELS[name].family.vae)
    )
    for name in model_zoo.FAMILIES
}


def resolve_model(spec: str) -> ModelSource:
    """'tiny', a family name (flux, qwen-image, wan, z-image, sd3), or a local diffusers folder."""
    if spec is None or not str(spec).strip():
        raise ModelSourceError("empty --model: expected 'tiny', a family name or a local diffusers folder")
    spec = str(spec).strip()
    if spec.lower() == "tiny":
        from fx_fp8.tools.tiny_model import TINY_MODEL_DIR

        return ModelSource(
            spec="tiny",
            kind="tiny",
            class_name="FluxTransformer2DModel",
            path=TINY_MODEL_DIR / "transformer",
            pipeline_path=TINY_MODEL_DIR,
        )
    path = Path(spec).expanduser()
    if path.exists():
        return _from_folder(spec, path)
    family = _family(spec)
    if family is not None:
        return ModelSource(spec=spec, kind="family", class_name=model_zoo.MODELS[family].class_name, family=family)
    if os.sep in spec or spec.startswith((".", "~")) or (os.altsep and os.altsep in spec):
        raise ModelSourceError(f"model folder not found: {spec!r}")
    raise ModelSourceError(
        f"unknown model {spec!r}: expected 'tiny', a family ({', '.join(model_zoo.FAMILIES)}) "
        "or a local diffusers folder (no such folder)"
    )


def _from_folder(spec: str, path: Path) -> ModelSource:
    if not path.is_dir():
        raise ModelSourceError(f"--model {spec!r} is a file: expected a diffusers pipeline or transformer folder")
    if (path / "model_index.json").is_file():
        index = _read_json(path / "model_index.json")
        sub = path / "transformer"
        if "transformer" not in index or not (sub / "config.json").is_file():
            raise ModelSourceError(
                f"folder {spec!r} holds no transformer (model_index.json has no 'transformer' "
                "or transformer/config.json is missing)"
            )
        cls = _read_json(sub / "config.json").get("_class_name")
        if not cls:
            raise ModelSourceError(f"{str(sub / 'config.json')!r} has no _class_name")
        from fx_fp8.tools.tiny_model import TINY_MODEL_DIR

        if path.resolve() == TINY_MODEL_DIR.resolve():
            return resolve_model("tiny")
        if (
            index.get("_class_name") == "TinyShapesPipeline"
        ):  # a copy of the tiny model (e.g. its transformer quantized)
            return ModelSource(
                spec=spec, kind="tiny", class_name=cls, path=sub, pipeline_path=path, quantized=folder_quantization(sub)
            )
        return ModelSource(
            spec=spec,
            kind="pipeline_dir",
            class_name=cls,
            path=sub,
            pipeline_path=path,
            quantized=folder_quantization(sub),
        )
    if is_save_quantized_pipeline(path):
        raise ModelSourceError(
            f"folder {spec!r} holds only a pipeline's transformers (written by "
            f"fx_fp8.save_quantized): give one of them ({str(path / 'transformer')!r}), or a "
            "pipeline folder whose transformer/ is such a folder"
        )
    if (path / "config.json").is_file():
        cls = _read_json(path / "config.json").get("_class_name")
        if not cls:
            raise ModelSourceError(f"folder {spec!r} holds no transformer (config.json has no _class_name)")
        if "Transformer" not in cls and "DiT" not in cls:
            raise ModelSourceError(f"folder {spec!r} holds a {cls}, not a transformer")
        return ModelSource(
            spec=spec, kind="transformer_dir", class_name=cls, path=path, quantized=folder_quantization(path)
        )
    raise ModelSourceError(
        f"folder {spec!r} holds no transformer (no model_index.json with a transformer/ subfolder, no config.json)"
    )


# -- example inputs from a transformer config ------------------------------
# The families' input makers (fx_fp8.tools.model_zoo), driven by the loaded transformer's config;
# small token grids: inspection needs the graph, not realistic resolutions.

_INPUT_BUILDERS: dict[str, Callable] = {
    model_zoo.MODELS[f].class_name: model_zoo.MODELS[f].family.inputs for f in model_zoo.FAMILIES
}
#: sizes other than the makers' defaults: Flux as the shipped tiny model's 32x32 image (16x16 packed tokens)
_FOLDER_SIZES: dict[str, dict] = {"FluxTransformer2DModel": dict(side=16)}
#: the shipped tiny model (a Flux): its 32x32 image, its 8-token prompts
_TINY_SIZE = dict(side=16, txt=8)
