"""The local provider warms up at start-up: one short grammar-constrained call before traffic, so the
first constrained request does not pay llguidance's and the kernels' first-use costs (the speed
itself is measured in docs/benchmarks, not timed here)."""

from __future__ import annotations

import asyncio

from openalice_runner.providers.embedded.config import EmbeddedConfig
from openalice_runner.providers.local import EmbeddedProvider


def test_warm_up_runs_a_constrained_call_once_at_load():
    provider = EmbeddedProvider("local", EmbeddedConfig(type="local", tiny_random=True, warm_up=True))
    assert provider.warm_up_s is None
    asyncio.run(provider.ensure_loaded())
    assert provider.warm_up_s is not None
    assert provider.engine._grammars is not None  # the grammar backend was set up by it
    assert provider.warm_up() == provider.warm_up_s  # once


def test_warm_up_default_is_off_for_tiny_random_and_on_otherwise():
    provider = EmbeddedProvider("local", EmbeddedConfig(type="local", tiny_random=True))
    asyncio.run(provider.ensure_loaded())
    assert provider.warm_up_s is None
    assert EmbeddedConfig(type="local").warm_up is None  # null: on for a real model
