"""One tiny random engine per test process (building it costs seconds on a shared CPU), and a helper
that runs requests on an engine all at once."""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor


@functools.cache
def tiny_engine():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from openalice_runner.engine import Engine

    return Engine.tiny_random(seed=0)


def run_concurrently(engine, jobs):
    """jobs: (prompt ids, sampling, spec, drafter or None) -> results in order, all at once."""
    start = threading.Barrier(len(jobs))

    def one(job):
        start.wait()
        return engine.generate(job[0], job[1], job[2], drafter=job[3])

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(one, jobs))
