"""One index answers which module of a model holds a tensor: its name in the model and the
(module, attribute) holding it, found by identity, kept per model without keeping the model
alive, and built again when a lookup misses or finds a stale entry."""

import gc
import weakref

import torch
import torch.nn as nn

from fx_fp8.graph.names import ModelNames, instance_holding
from fx_fp8.graph.owners import OWNERS, TensorOwners


class Tied(nn.Module):
    """`head` and `tail` hold one weight; `shared` is reachable at two names (`shared`, `alias`)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 4)
        self.shared = nn.LayerNorm(4)
        self.tail = nn.Linear(4, 4)
        self.tail.weight = self.head.weight
        self.alias = self.shared
        self.register_buffer("scale", torch.ones(1))


def test_a_tensor_held_twice_belongs_to_its_first_holder():
    model = Tied()
    owners = TensorOwners()
    first = [
        n
        for n, m in model.named_modules(remove_duplicate=False)
        if any(p is model.head.weight for p in m._parameters.values())
    ]
    assert first == ["head", "tail"]
    assert owners.name(model, model.head.weight) == "head"
    assert owners.holding(model, model.tail.weight) == (model.head, "weight")
    # a module at two names keeps the one named_modules(remove_duplicate=False) spells first
    assert owners.name(model, model.alias.weight) == "shared"
    assert owners.holding(model, model.scale) == (model, "scale")
    assert owners.name(model, model.scale) == ""
    # the compile-time names read the same table
    names = ModelNames(model, {})
    assert [names.of_tensor(t) for t in (model.tail.weight, model.alias.bias, model.scale)] == ["head", "shared", ""]


def test_a_tensor_the_model_does_not_hold_has_no_owner():
    model, owners = Tied(), TensorOwners()
    assert owners.name(model, torch.ones(4)) is None
    assert owners.holding(model, torch.ones(4)) is None
    assert owners.holding(None, model.head.weight) is None
    assert owners.name("not a model", model.head.weight) is None


def test_a_replaced_parameter_is_found_after_the_table_is_built_again():
    model, owners = Tied(), TensorOwners()
    old = model.head.bias
    assert owners.name(model, old) == "head"
    model.head.bias = nn.Parameter(torch.zeros(4))
    assert owners.name(model, model.head.bias) == "head"
    assert owners.holding(model, old) is None  # its id is in no table built since: not held


def test_a_stale_entry_is_never_answered():
    """A parameter moved to another module: its entry names the module that held it before,
    which no longer does; the lookup builds the table again and answers the new holder."""
    model, owners = Tied(), TensorOwners()
    moved = model.head.bias
    assert owners.holding(model, moved) == (model.head, "bias")
    model.head.bias = nn.Parameter(torch.zeros(4))
    model.tail.bias = moved
    assert owners.holding(model, moved) == (model.tail, "bias")
    assert owners.name(model, moved) == "tail"


def test_lookups_keep_no_model_alive():
    model, owners = Tied(), TensorOwners()
    weight = model.head.weight
    assert owners.name(model, weight) == "head"
    assert owners.holding(model, torch.ones(1)) is None  # a miss builds the table again
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    assert len(owners._tables) == 0


def test_instance_holding_names_the_instance_from_the_shared_index():
    blocks = nn.Module()
    blocks.blocks = nn.ModuleList([nn.Sequential(nn.Linear(2, 2)) for _ in range(3)])
    param = blocks.blocks[2][0].weight
    assert instance_holding(param, "0", [(blocks, None)]) == (blocks, None, "blocks.2")
    assert OWNERS.name(blocks, param) == "blocks.2.0"
