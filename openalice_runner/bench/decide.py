"""Decision micro-benchmark: `python -m openalice_runner.bench.decide [POLICY]` (default: the shipped default policy).

Prints µs per decision for a mix of contexts (fixed-γ rules, auto-γ rules, the default). A benchmark to
read, not a timed test: the budget is well under 50 µs per decision.
"""

from __future__ import annotations

import sys
import time

from openalice_runner import defaults
from openalice_runner.policies import PolicyStore, RequestContext


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    store = PolicyStore.from_file(argv[0] if argv else defaults.path(defaults.POLICY))
    contexts = [
        RequestContext(t, b, p)
        for t in ("chat", "reasoning", "tool_call", "code_edit", "summarize", "rag", "custom")
        for b in (1, 3, 8, 24, 64)
        for p in ("local", "gpu", None)
    ]
    n_rounds = 200
    for ctx in contexts:  # warm up
        store.decide(ctx)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n_rounds):
            for ctx in contexts:
                store.decide(ctx)
        best = min(best, (time.perf_counter() - t0) / (n_rounds * len(contexts)))
    print(
        f"{best * 1e6:.2f} us per decision ({len(contexts)} contexts x {n_rounds}, best of 5, policy {store.version})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
