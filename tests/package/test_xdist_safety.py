"""The suite runs on two pytest-xdist workers (the README's `-n 2`): each worker computes on one
thread, and the multi-process launches of two workers never share a rendezvous port."""

from __future__ import annotations

import os
import socket

import pytest
import torch

import cp_helpers


def test_each_xdist_worker_computes_on_one_thread():
    # conftest sets it when the module loads: two workers on a 2-core machine, one thread each
    assert torch.get_num_threads() == (1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@pytest.mark.parametrize("worker", ["gw0", "gw1", "gw7"])
def test_free_port_comes_from_the_workers_own_slice(monkeypatch, worker):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    start = cp_helpers.XDIST_PORT_BASE + int(worker[2:]) * cp_helpers.XDIST_PORT_SLICE
    ports = {cp_helpers.free_port() for _ in range(5)}
    assert ports  # not vacuous: all() of nothing is True
    assert all(start <= p < start + cp_helpers.XDIST_PORT_SLICE for p in ports), (worker, ports)


def test_free_port_skips_a_taken_port(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    start = cp_helpers.XDIST_PORT_BASE + 3 * cp_helpers.XDIST_PORT_SLICE
    monkeypatch.setattr(cp_helpers.random, "randrange", lambda n: 0)  # first candidate: the slice's start
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        try:
            held.bind(("127.0.0.1", start))
        except OSError:
            pytest.fail(f"port {start} is already taken on this machine: the check needs it free")
        held.listen()
        assert cp_helpers.free_port() == start + 1


def test_free_port_past_the_slices_is_any_free_port(monkeypatch):
    """More workers than slices below the ephemeral range: bind(0), a clash retried by launch()."""
    last = (cp_helpers.XDIST_PORT_END - cp_helpers.XDIST_PORT_BASE) // cp_helpers.XDIST_PORT_SLICE
    monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{last}")
    monkeypatch.setattr(cp_helpers, "_bindable", lambda port: pytest.fail(f"tried slice port {port}"))
    assert 0 < cp_helpers.free_port() < 65536
