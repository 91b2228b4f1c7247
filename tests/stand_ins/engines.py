"""One tiny random engine per test process (building it costs seconds on a shared CPU)."""

from __future__ import annotations

import functools
import os


@functools.cache
def tiny_engine():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from openalice_runner.engine import Engine

    return Engine.tiny_random(seed=0)
