"""What a stream tells an observer about the text, measured (issue 48; docs/security.md).

- `fingerprint`: K prompts x R repeats through `serve` under each stream release mode, n-gram and
  suffix speculation, temperature 0 and 0.7; an observer that sees only what crosses the network
  (each read's byte count and arrival time, as over TLS) names the prompt by leave-one-out nearest
  neighbour (`classify`). `pass` is the control; `fixed:N` and `paced` should be near chance.
- `cross_tenant`: one tenant's reply sent again by another tenant, a fresh one and itself, under
  suffix speculation: the others must draft as from an empty store, the writer from its own;
- `cost`: the agent loops through `serve` under each release mode, side by side (`bench-loops`).

    python -m openalice_runner.bench.side_channel fingerprint --json fp.json
    python -m openalice_runner.bench.side_channel cross-tenant --json xt.json
    python -m openalice_runner.bench.side_channel cost --workload ../shared/workloads/agent-loops.jsonl
"""
