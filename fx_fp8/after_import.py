"""Run a function on a third-party module as soon as it has been imported, without importing it.

fx_fp8 changes three libraries it must not import itself (diffusers and PEFT cost seconds, and a user
may never load them): it registers its diffusers quantizer, guards PEFT's adapter injection on
prepared models, and follows diffusers' and PEFT's weight writers. `call_after_import` runs the
function now for a module already imported, else from a finder at the front of `sys.meta_path`
that finds nothing itself: when a watched module is about to be imported it wraps the loader the
other finders return, so the function runs right after the module's code.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Callable, Iterable


class AfterImport(importlib.abc.MetaPathFinder):
    """Watches `names`; `once`: a name is forgotten after its first import (the finder leaves
    sys.meta_path when it watches nothing more)."""

    def __init__(self, names: Iterable[str], function: Callable, once: bool):
        self.names, self.function, self.once = set(names), function, once

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.names:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        if self.once:
            self.names.discard(fullname)
            if not self.names:
                sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        spec.loader = _CallingLoader(spec.loader, self.function)
        return spec


class _CallingLoader(importlib.abc.Loader):
    def __init__(self, loader, function: Callable):
        self._loader, self._function = loader, function

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._function(module)

    def __getattr__(self, name):  # resources, source, ... as the real loader has them
        return getattr(self._loader, name)


def call_after_import(names: Iterable[str], function: Callable, *, once: bool = True) -> None:
    """function(module) for each module of `names`: now for those imported, else right after each is
    imported (idempotent: a second call with the same function adds no second finder)."""
    names = list(names)
    waiting = []
    for name in names:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__spec__", None) is not None:
            function(module)
            if once:
                continue
        waiting.append(name)
    if waiting and not any(isinstance(f, AfterImport) and f.function is function for f in sys.meta_path):
        sys.meta_path.insert(0, AfterImport(waiting, function, once))


def watching(function: Callable) -> bool:
    """Whether a finder still waits to call `function` (a module it watches was not imported yet)."""
    return any(isinstance(f, AfterImport) and f.function is function for f in sys.meta_path)
