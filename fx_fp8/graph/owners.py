"""Which module of a model holds a tensor (a parameter or buffer), found by identity.

One table per model answers both questions the package asks of a tensor: the name of the
module holding it (naming graph nodes, telling model instances apart) and the module object
and attribute holding it (where the weight's quantized copies are kept). The table is built by
one walk of the model, kept while the model lives (the model is held weakly), and built again
when a lookup misses or finds a stale entry (a parameter replaced or moved since): every
answer is checked against the module's attribute, so a tensor whose id was reused is never
attributed to the module that held the old one.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn as nn


def held(module: nn.Module, attr: str) -> Optional[torch.Tensor]:
    """`module`'s own parameter or buffer `attr` (None when it holds neither)."""
    t = module._parameters.get(attr)
    return t if t is not None else module._buffers.get(attr)


def index(model: nn.Module) -> dict[int, tuple]:
    """{id(tensor): (weakref(module), attribute, module name)} of every parameter and buffer of
    `model`. A tensor held twice (tied weights) belongs to its first holder in named_modules()
    order, parameters before buffers; a module reachable at two names keeps the first, as
    named_modules(remove_duplicate=False) spells it first."""
    table: dict[int, tuple] = {}
    for name, module in model.named_modules():
        ref = weakref.ref(module)
        for members in (module._parameters, module._buffers):
            for attr, t in members.items():
                if t is not None and id(t) not in table:
                    table[id(t)] = (ref, attr, name)
    return table


def owner_in(table: dict[int, tuple], tensor) -> Optional[tuple[nn.Module, str, str]]:
    """(module, attribute, module name) of `tensor`'s entry in an index() table, when the module
    still holds it there; else None. (A plain tuple: a hit is on the per-call path.)"""
    entry = table.get(id(tensor))
    if entry is None:
        return None
    module = entry[0]()
    if module is None or held(module, entry[1]) is not tensor:
        return None
    return module, entry[1], entry[2]


class TensorOwners:
    """The owner table of each model, weakly keyed by the model."""

    def __init__(self):
        self._tables: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()

    def fresh(self, model: nn.Module) -> dict[int, tuple]:
        """`model`'s table, built now (and kept for later lookups)."""
        table = self._tables[model] = index(model)
        return table

    def find(self, model: Optional[nn.Module], tensor) -> Optional[tuple[nn.Module, str, str]]:
        """(module, attribute, module name) where `model` holds `tensor` as a parameter or
        buffer, or None (no model, or not held)."""
        if not isinstance(model, nn.Module):
            return None
        table = self._tables.get(model)
        owner = owner_in(table, tensor) if table is not None else None
        if owner is None:  # a miss or a stale entry: the model changed since its table was built
            owner = owner_in(self.fresh(model), tensor)
        return owner

    def name(self, model: Optional[nn.Module], tensor) -> Optional[str]:
        """The name in `model` of the module holding `tensor`, or None."""
        owner = self.find(model, tensor)
        return owner[2] if owner is not None else None

    def holding(self, model: Optional[nn.Module], tensor) -> Optional[tuple[nn.Module, str]]:
        """(module, attribute) holding `tensor` in `model`, or None."""
        owner = self.find(model, tensor)
        return owner[:2] if owner is not None else None


#: one table per model for the whole process: every graph of a model (each block class under
#: regional compilation), its feeds and its dispatch look tensors up in the same one
OWNERS = TensorOwners()
