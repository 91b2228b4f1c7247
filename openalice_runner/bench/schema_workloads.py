"""Write the load test's two schema phases as `loadtest --workload` files (scripts/loadtest.sh):

* deep-schema.jsonl: tool parameters and response formats nested 30 objects deep (just inside the
  server's 64-level limit, openalice_runner/schema_limits.py), both validated and compiled per request;
* large-grammar.jsonl: response formats of 450 optional properties (llguidance refuses objects of
  much more: 500 optional keys make a row past its 2,000 items) and of 1,500 `anyOf` branches,
  eight distinct ones in turn, so the grammar cache keeps evicting (it is bounded by the grammars'
  text, engine/grammar.py: 64 such grammars once held 1.6 GB).

    python -m openalice_runner.bench.schema_workloads OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ASK = [{"role": "user", "content": "Fill in the form as JSON."}]


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for level in range(depth):
        schema = {"type": "object", "properties": {f"level_{level}": schema}, "required": [f"level_{level}"]}
    return schema


def wide(tag: str, n: int) -> dict:
    # optional properties: a large grammar whose shortest reply is still short (`{}`)
    return {"type": "object", "properties": {f"{tag}_{i}": {"type": "integer"} for i in range(n)}}


def branches(tag: str, n: int) -> dict:
    return {"anyOf": [{"type": "object", "properties": {f"{tag}_{i}": {"type": "integer"}}, "required": [f"{tag}_{i}"]}
                      for i in range(n)]}  # fmt: skip


def fmt(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def main(out_dir: str) -> None:
    out = Path(out_dir)
    tool = {"type": "function", "function": {"name": "fill", "description": "fill the form", "parameters": nested(30)}}
    deep = [
        {"messages": ASK, "tools": [tool], "tool_choice": "required", "max_tokens": 256},
        {"messages": ASK, "response_format": fmt("deep", nested(30)), "max_tokens": 256},
    ]
    large = [{"messages": ASK, "response_format": fmt(f"wide{v}", wide(f"w{v}", 450)), "max_tokens": 24} for v in range(4)]
    large += [{"messages": ASK, "response_format": fmt(f"any{v}", branches(f"b{v}", 1_500)), "max_tokens": 24}
              for v in range(4)]  # fmt: skip
    for name, items in (("deep-schema", deep), ("large-grammar", large)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))


if __name__ == "__main__":
    main(sys.argv[1])
