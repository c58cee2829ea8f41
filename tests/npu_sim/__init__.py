"""Test-only simulator of torch_npu's op contracts (see torch_npu_sim.py) and its pytest fixture."""
from __future__ import annotations

import pytest

from npu_sim.torch_npu_sim import SimulatedContractError, installed, make_torch_npu  # noqa: F401


@pytest.fixture
def torch_npu_sim():
    """The simulated torch_npu, installed in sys.modules for one test (an Ascend 950 by default;
    set `.chip` to e.g. "Ascend910B3" for an Atlas A2)."""
    # diffusers probes for torch_npu once, at import, and would then take its NPU code paths:
    # import it before the stand-in exists so it keeps seeing a machine without NPU
    import diffusers.utils.import_utils  # noqa: F401

    with installed() as mod:
        yield mod
