"""Fixtures shared by the engine's tests."""

from __future__ import annotations

import platform

import pytest

from openalice_runner.engine.cpu_kernels import cpu_kernels, unavailable_reason


@pytest.fixture(scope="module")
def kernels():
    """The engine's CPU kernels; skipped only where the hardware lacks them."""
    reason = unavailable_reason()
    if reason is not None and (platform.machine() not in ("x86_64", "AMD64") or "AVX2" in reason):
        pytest.skip(reason)  # hardware, not an install (tests/tiers.py): a skip under CI=true too
    # on an x86-64 machine with AVX2 and a compiler (this project's machines) they must build
    assert reason is None, reason
    return cpu_kernels()
