"""Reading a config's data: YAML files and vLLM-Omni stage configs. The keys' spellings are
fx_fp8.config.keys, what they mean fx_fp8.config.fp8_config."""

from __future__ import annotations

import os
import warnings
from typing import Mapping

from fx_fp8.config.keys import LEGACY_KEYS, PIPELINE_KEYS, TOP_KEYS


def config_keys(data, where: str, *, warn: bool = True) -> dict:
    """The keys of a config's data (None, a flat mapping, or a vLLM-Omni stage config, whose
    diffusion stage's engine_args hold them), FP8 and pipeline keys alike; a ValueError naming
    `where` for a malformed one. warn: say which stage of several is used and which engine_args
    keys fx_fp8 does not read (the FP8 reading warns; the pipeline reading of the same data not)."""
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping at the top level, got {type(data).__name__}")
    if "stage_args" in data:
        return _diffusion_engine_args(data, where, warn)
    return dict(data)


def read_config(config):
    """What a user hands as a config, read once: a YAML path (flat or a vLLM-Omni stage config) or a
    mapping becomes its keys (a stage config's diffusion engine_args, warned about here as
    FP8Config.load warns); None, an FP8Config or anything else comes back as it is (FP8Config.load
    judges it). Reading what this returned again is a no-op: compile_pipeline reads its config
    here once and hands the keys to every reader (components, FP8 config, pipeline options)."""
    if isinstance(config, (str, os.PathLike)):
        return config_keys(read_config_file(config), os.fspath(config))
    if isinstance(config, Mapping):
        return config_keys(config, "config")
    return config


def read_config_file(path):
    """A YAML config file's data; a ValueError naming the file when it is missing, a folder, not
    UTF-8 or not YAML."""
    import yaml

    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"config file {path!r} is a directory: expected a YAML file")
    if not os.path.isfile(path):
        raise ValueError(f"config file not found: {path!r}")
    try:
        with open(path, encoding="utf-8") as f:
            return _load_bounded(f, path)
    except UnicodeDecodeError as e:
        raise ValueError(f"config file {path!r} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path!r} is not valid YAML: {e}") from None


#: the most YAML nodes a config file may expand to, an alias counted each time it is used (a config
#: has tens): a 539-byte file of nested aliases expands to billions of strings
MAX_CONFIG_NODES = 100_000


def _load_bounded(stream, path: str):
    """yaml.safe_load, refusing a document that expands past MAX_CONFIG_NODES (counted on the
    composed nodes, where an alias is a reference: nothing is expanded to count it)."""
    import yaml

    loader = yaml.SafeLoader(stream)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise ValueError(f"config file {path!r} nests too deeply to be a config") from None
        if node is None:
            return None
        size = _expanded_size(node, path)
        if size > MAX_CONFIG_NODES:
            raise ValueError(
                f"config file {path!r} expands to more than {MAX_CONFIG_NODES:,} YAML nodes (each use of "
                "an alias counted): refused, a config has tens; write the values out, or use fewer "
                "nested aliases"
            )
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded_size(root, path: str) -> int:
    """Nodes of the document with every alias expanded (a node reached twice counts twice),
    computed once per node; stops early past MAX_CONFIG_NODES. A node inside itself is refused."""
    import yaml

    def children(node):
        if isinstance(node, yaml.SequenceNode):
            return node.value
        if isinstance(node, yaml.MappingNode):
            return [n for pair in node.value for n in pair]
        return ()

    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            open_nodes.discard(key)
            sizes[key] = min(1 + sum(sizes[id(c)] for c in children(node)), MAX_CONFIG_NODES + 1)
            continue
        if key in sizes:
            continue
        if key in open_nodes:
            raise ValueError(f"config file {path!r}: an alias refers to a node that contains it (an endless value)")
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children(node) if id(c) not in sizes)
    return sizes[id(root)]


def _diffusion_engine_args(data: Mapping, where: str, warn: bool) -> dict:
    stages = data["stage_args"]
    if not isinstance(stages, list):
        raise ValueError(f"{where}: stage_args must be a list of stages")
    diffusion = [s for s in stages if isinstance(s, Mapping) and s.get("stage_type") == "diffusion"]
    if not diffusion:
        raise ValueError(f"{where}: no stage with stage_type: diffusion in stage_args")
    if len(diffusion) > 1 and warn:
        ids = [s.get("stage_id") for s in diffusion]
        warnings.warn(f"{where}: several diffusion stages {ids}; using stage_id {ids[0]}", stacklevel=3)
    engine_args = diffusion[0].get("engine_args") or {}
    if not isinstance(engine_args, Mapping):
        raise ValueError(f"{where}: engine_args of stage {diffusion[0].get('stage_id')} must be a mapping")

    known = set(TOP_KEYS) | set(LEGACY_KEYS) | set(PIPELINE_KEYS)  # pipeline keys: see from_mapping
    ours = {k: v for k, v in engine_args.items() if k in known}
    others = sorted(k for k in engine_args if k not in known)
    if others and warn:
        # Stage configs carry serving keys (model, dtype, ...) that are not ours: say so once.
        warnings.warn(f"{where}: engine_args keys not used by fx_fp8: {others}", stacklevel=3)
    return ours
