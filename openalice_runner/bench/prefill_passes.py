"""One prefill pass of N prompt rows on a cached prefix, as a later call of an agent loop makes it.

Times a pass (forward and the last row's logits) of each of --rows prompt rows at --cached positions
already in the cache, medians of --repeats (odd), rows in turn; prints JSON {rows: ms}. A pass whose time
hardly moves with its rows has a fixed cost per pass (issue 49: the kernel pool waiting for a worker the
OS had not scheduled). To compare two builds side by side, run it round-robin with each build's
PYTHONPATH (docs/benchmarks/2026-12-05-prefill-breakdown.md):

    HF_HUB_OFFLINE=1 .venv/bin/python -m openalice_runner.bench.prefill_passes --rows 1,40,300 --cached 800
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from openalice_runner.cli.common import positive_int
from openalice_runner.engine import Engine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,40,300", help="comma-separated prompt rows per pass")
    p.add_argument("--cached", type=positive_int, default=800, help="positions already in the cache")
    p.add_argument("--repeats", type=positive_int, default=3, help="passes of each size (odd: the median is one)")
    p.add_argument("--threads", type=positive_int, default=None)
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    engine = Engine.load(max_batch=1, threads=args.threads)
    model = engine.model
    cache = model.new_cache(1, args.cached + max(rows) + 1)
    with torch.inference_mode():
        model.forward(torch.arange(100, 100 + args.cached).reshape(1, -1), cache, [0], prompt=True)

    def one(n: int) -> float:
        t0 = time.perf_counter()
        hidden = model.forward_rows(torch.arange(5, 5 + n), cache, [0] * n, list(range(args.cached, args.cached + n)),
                                    prompt_spans=[(0, n)])
        model.logits(hidden[-1:])
        return 1000 * (time.perf_counter() - t0)

    times: dict[int, list[float]] = {n: [] for n in rows}
    for _ in range(args.repeats):
        for n in rows:
            times[n].append(one(n))
    print(json.dumps({n: round(statistics.median(t), 1) for n, t in times.items()}))


if __name__ == "__main__":
    main()
