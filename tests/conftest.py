"""Shared fixtures. Models are offline only; torch threads are capped so tests share the CPU well."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # The suite runs in two worker processes (pyproject's addopts), one core each: torch's threads
    # and the kernels' pool (whose workers spin between calls) would otherwise put four busy
    # threads on two cores, each pass waiting for a thread the other process holds. Set before
    # torch is imported, which reads it once.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
from tiers import missing  # noqa: E402

WORKLOAD = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "workloads", "agentic.jsonl")


def pytest_runtest_setup(item):
    for mark in item.iter_markers("needs_install"):
        if mark.args and mark.args[0]:
            missing(str(mark.args[0]))


@pytest.fixture
def one_thread():
    """Torch on one thread for the test: on tiny tensors (the exactness tests' chains) the intra-op
    threads only wait on each other, 14x slower per reply on a loaded 2-core machine; the old
    setting comes back after it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def restore_logging():
    """For a test that configures logging (configure_logging, or `serve`'s main in this process): the
    root logger's handlers put back after it. Left in place, a handler on the test's captured stderr,
    closed after it, takes every later log line of the worker (a traceback each)."""
    import logging

    import structlog

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()


@pytest.fixture(scope="session")
def tiny_engine():
    """The process's one tiny random engine (the same object `stand_ins.engines.tiny_engine()` gives)."""
    from stand_ins.engines import tiny_engine as the_tiny_engine

    return the_tiny_engine()


@pytest.fixture(scope="session")
def real_engine_fp32():
    from openalice_runner.engine import Engine

    return Engine.load(dtype="fp32")


@pytest.fixture(scope="session")
def workload_path():
    if not os.path.exists(WORKLOAD):
        missing(f"workload file not found at {WORKLOAD} (shared/ must sit beside the checkout)")
    return WORKLOAD
