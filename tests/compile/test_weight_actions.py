"""Decide, apply, rewrite: the linear pass emits what it does to an instance's weights as actions
(fx_fp8/quant/weight_actions.py) and the graph plan applies every one of them, for the instance
whose passes ran and for each instance that reuses its decisions alike; a group's smoothing is
an action too (never a placeholder the reuse has to refuse)."""

import torch

import fx_fp8
from fx_fp8.compile.graph_plan import GraphPlan
from fx_fp8.quant.weight_actions import SmoothingAction, WeightAction

from toy_models import BLOCKS, TwoLinears, compile_regionally, regional_toy, toy_inputs


def recorded_actions(monkeypatch) -> list:
    """[(instance name, action)] as the graph plan applies them."""
    seen = []
    real = GraphPlan.apply_weight_action

    def apply(self, action, inputs, name, resolver):
        seen.append((name, action))
        return real(self, action, inputs, name, resolver)

    monkeypatch.setattr(GraphPlan, "apply_weight_action", apply)
    return seen


def test_the_graph_plan_applies_every_instances_actions_first_and_reused_alike(monkeypatch):
    seen = recorded_actions(monkeypatch)
    model, kw = regional_toy(), toy_inputs()
    with torch.no_grad():
        compile_regionally(model)(**kw)
    by_instance: dict = {}
    for name, action in seen:
        assert isinstance(action, WeightAction), action
        by_instance.setdefault(name, []).append(action)
    assert len(by_instance) == BLOCKS  # the first block (its passes ran) and the reused ones
    assert len({len(actions) for actions in by_instance.values()}) == 1  # the same actions for each
    first = next(iter(by_instance.values()))
    assert len({action.slot for action in first}) == len(first)  # one action per quantized weight


def test_a_groups_smoothing_is_an_action_the_graph_plan_applies(monkeypatch):
    seen = recorded_actions(monkeypatch)
    m, x = TwoLinears(relu=False).eval(), torch.randn(8, 64)
    calibration = fx_fp8.calibrate(m, [(x,)])
    compiled = torch.compile(
        m,
        backend="fp8",
        options={
            "lowering": "reference",
            "downstream": "eager",
            "quantization": "int8",
            "quantization_config": {"activation_scales": calibration, "smoothing_alpha": 0.5, "sensitive": "native"},
        },
    )
    with torch.no_grad():
        compiled(x)
    actions = [a for _, a in seen]
    assert actions and None not in actions
    assert [type(a) for a in actions] == [SmoothingAction, SmoothingAction]  # a and b read different tensors
    assert all(a.alpha == 0.5 and len(a.members) == 1 for a in actions)
