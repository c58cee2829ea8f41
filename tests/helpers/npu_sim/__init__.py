"""Test-only simulators of torch_npu's and MindIE-SD's op contracts, and their pytest fixtures."""

from __future__ import annotations

import pytest

from npu_sim import mindiesd_sim as _sd
from npu_sim.torch_npu_sim import SimulatedContractError, installed, make_torch_npu  # noqa: F401


@pytest.fixture
def torch_npu_sim():
    """The simulated torch_npu, installed in sys.modules for one test: an Ascend 950 with the current
    CANN (set `.chip` to e.g. "Ascend910B3" for an Atlas A2, `.cann_version` to e.g. "9.0.0-beta.2").
    `import mindiesd` fails meanwhile (see the mindiesd_sim fixture)."""
    # diffusers probes for torch_npu once, at import, and would then take its NPU code paths:
    # import it before the stand-in exists so it keeps seeing a machine without NPU
    import diffusers.utils.import_utils  # noqa: F401

    with installed() as mod, _sd.blocked():
        yield mod


@pytest.fixture
def mindiesd_sim(torch_npu_sim):
    """The simulated mindiesd package (MindIE-SD 3.1.0 entry points) on top of torch_npu_sim."""
    with _sd.installed_mindiesd() as mod:
        yield mod
