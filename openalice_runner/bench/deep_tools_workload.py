"""Write a `loadtest --workload` file of long prompts (~3.5k tokens on the default model) with deeply
nested tool schemas and a large max_tokens: the requests that once took `serve` past 2 GB of RSS
(the KV cache was sized for max_tokens at admission). scripts/loadtest.sh runs it as its memory check.

    python -m openalice_runner.bench.deep_tools_workload OUT.jsonl
"""

from __future__ import annotations

import json
import sys


def nested(depth: int) -> dict:
    if depth == 0:
        return {"type": "string", "description": "a leaf value with a fairly long description of what it holds"}
    return {
        "type": "object",
        "description": f"level {depth} of the configuration tree",
        "properties": {
            f"field_{depth}_{i}": nested(depth - 1) if i == 0 else {"type": "integer", "description": f"count {i}"}
            for i in range(3)
        },
        "required": [f"field_{depth}_0"],
    }


TOOLS = [
    {"type": "function", "function": {"name": f"tool_{t}", "description": f"tool number {t}", "parameters": nested(7)}}
    for t in range(6)
]


def main(out: str) -> None:
    with open(out, "w") as f:
        for i in range(4):
            text = " ".join(f"line {i}-{k}: the quick brown fox jumps over the lazy dog again and again."
                            for k in range(140))  # fmt: skip
            request = {
                "messages": [{"role": "system", "content": "You are a careful agent."},
                             {"role": "user", "content": text}],  # fmt: skip
                "tools": TOOLS,
                "max_tokens": 4000,
            }
            f.write(json.dumps(request) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
